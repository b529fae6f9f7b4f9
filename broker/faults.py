"""The broker's own bugs, logged without flooding: a handler that raises on one message
raises on every copy of it, and a peer may send the copy in a loop.

Each kind of fault (the exception's type and the line that raised it) is logged once
with its traceback; its repeats are counted (``ipuserve_broker_errors_total``
``{code="INTERNAL"}`` for those answered, ``dropped_total{reason="handler_failed"}``
for those not) and logged at DEBUG. The kinds remembered are bounded, so a fault
whose line varies cannot grow the set without end.
"""

from __future__ import annotations

import logging
import traceback

#: Kinds of fault remembered; beyond them every fault is logged at DEBUG only.
MAX_KINDS = 64


class Faults:
    """Logs each kind of unexpected exception once, with its traceback."""

    def __init__(self, log: logging.Logger) -> None:
        self._log = log
        self._seen: set[tuple[str, str, int | None]] = set()

    def log(self, exc: BaseException, what: str) -> None:
        """Log ``what`` happened with ``exc``: its traceback the first time its kind is
        seen, at DEBUG after that."""
        kind = _kind(exc)
        if kind in self._seen or len(self._seen) >= MAX_KINDS:
            self._log.debug("%s (again): %r", what, exc)
            return
        self._seen.add(kind)
        self._log.error(
            "%s; this kind of fault is logged once, its repeats counted", what, exc_info=exc
        )


def _kind(exc: BaseException) -> tuple[str, str, int | None]:
    """The exception's type and where it was raised (the innermost frame)."""
    frames = traceback.extract_tb(exc.__traceback__)
    last = frames[-1] if frames else None
    return type(exc).__name__, last.filename if last else "", last.lineno if last else None
