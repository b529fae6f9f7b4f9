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
#: the stderr handler apply_env_level gave the ipuserve logger, if it did
_library_handler: logging.Handler | None = None


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
    global _library_handler
    if not logging.getLogger().handlers and not logger.handlers:
        _library_handler = logging.StreamHandler()
        _library_handler.setFormatter(logging.Formatter(_FORMAT))
        logger.addHandler(_library_handler)


def configure_logging(level: str | None = None) -> None:
    """Send ipuserve's records to stderr at ``level`` (default: from the environment)."""
    chosen = (level or level_from_env()).upper()
    if chosen not in logging.getLevelNamesMapping():
        raise ValueError(
            f"unknown log level {chosen!r} (from {LOG_LEVEL_ENV}); "
            "use DEBUG, INFO, WARNING, ERROR or CRITICAL"
        )
    global _library_handler
    logger = logging.getLogger("ipuserve")
    if _library_handler is not None:  # the root handler below prints these records now
        logger.removeHandler(_library_handler)
        _library_handler = None
    logging.basicConfig(level=chosen, format=_FORMAT)
    logger.setLevel(chosen)
