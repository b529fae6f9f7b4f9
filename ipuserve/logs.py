"""Logging setup shared by every ipuserve process.

Library code only calls ``logging.getLogger(__name__)``; the level is decided
once, at the edge (CLI or a test), from ``IPUSERVE_LOG_LEVEL``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

LOG_LEVEL_ENV = "IPUSERVE_LOG_LEVEL"
DEFAULT_LEVEL = "WARNING"
_FORMAT = "%(asctime)s %(levelname)-7s %(processName)s %(name)s: %(message)s"


def level_from_env(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    return env.get(LOG_LEVEL_ENV, DEFAULT_LEVEL).upper()


def apply_env_level(environ: Mapping[str, str] | None = None) -> None:
    """For library use (no CLI): honour ``IPUSERVE_LOG_LEVEL`` if it is set.

    Sets the level of the ``ipuserve`` loggers and, only if the application has
    configured no logging at all, gives them a stderr handler so the records are
    seen. Unset: nothing changes (Python's default: warnings and errors only).
    """
    env = os.environ if environ is None else environ
    if LOG_LEVEL_ENV not in env:
        return
    level = level_from_env(env)
    if level not in logging.getLevelNamesMapping():
        raise ValueError(
            f"unknown log level {level!r} in {LOG_LEVEL_ENV}; "
            "use DEBUG, INFO, WARNING, ERROR or CRITICAL"
        )
    logger = logging.getLogger("ipuserve")
    logger.setLevel(level)
    if not logging.getLogger().handlers and not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT))
        logger.addHandler(handler)


def configure_logging(level: str | None = None) -> None:
    """Send ipuserve's records to stderr at ``level`` (default: from the environment)."""
    chosen = (level or level_from_env()).upper()
    if chosen not in logging.getLevelNamesMapping():
        raise ValueError(
            f"unknown log level {chosen!r} (from {LOG_LEVEL_ENV}); "
            "use DEBUG, INFO, WARNING, ERROR or CRITICAL"
        )
    logging.basicConfig(level=chosen, format=_FORMAT)
    logging.getLogger("ipuserve").setLevel(chosen)
