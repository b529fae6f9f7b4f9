"""The README's promises that can drift: the configuration reference and the two commands."""

from __future__ import annotations

import re
from pathlib import Path

from ipuserve.cli import main
from ipuserve.config_reference import render

README = Path(__file__).resolve().parent.parent / "README.md"
CI = Path(__file__).resolve().parent.parent / ".ci" / "run"


def test_configuration_reference_is_current() -> None:
    text = README.read_text()
    found = re.search(
        r"<!-- config-reference:start -->\n(.*)<!-- config-reference:end -->", text, re.S
    )
    assert found, "README.md lost its config-reference markers"
    assert found.group(1) == render(main), (
        "README.md's configuration reference is stale: regenerate it with "
        "`python -m ipuserve.config_reference --write README.md`"
    )


def test_ci_runs_the_readmes_test_command() -> None:
    commands = re.findall(r"^(python3 -m venv .*)$", README.read_text(), re.M)
    demo, tests = commands[:2]
    assert demo.endswith("ipuserve demo") and tests.endswith("pytest")
    assert tests in CI.read_text()
