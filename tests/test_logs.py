"""Logging: one line per record, whichever of the library and the CLI set it up first."""

from __future__ import annotations

import os
import subprocess
import sys

LIBRARY_THEN_CLI = """
import logging
import ipuserve.runtime  # the library honours IPUSERVE_LOG_LEVEL on import
from ipuserve.logs import configure_logging
configure_logging()  # then the CLI sets logging up, as every ipuserve command does
logging.getLogger("ipuserve.test").info("a record")
"""


def test_a_record_is_printed_once_when_the_cli_configures_after_the_library() -> None:
    done = subprocess.run(
        [sys.executable, "-c", LIBRARY_THEN_CLI],
        env={**os.environ, "IPUSERVE_LOG_LEVEL": "INFO"},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stderr.count("a record") == 1, done.stderr
