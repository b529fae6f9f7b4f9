"""The wire's limits on names and durations, without the wire.

A command line refuses a model name or a timeout the wire could not carry before it
connects anywhere (:mod:`ipuserve.clikit`), and the runtime's commands share those
helpers; importing :mod:`ipuserve.protocol` for two constants and one check would
pull ZeroMQ into processes that have no network (DESIGN.md §1: the runtime imports
nothing that imports zmq). So these pure rules live here, and the protocol enforces
the same ones at decode.
"""

from __future__ import annotations

from typing import Any

#: The longest model or tensor name, in characters.
MAX_NAME_CHARS = 256
#: Timeouts, budgets and timings are below this many milliseconds (~31 years).
MAX_DURATION_MS = 1e12
#: What a name must be, as error messages say it.
NAME_RULE = f"a string of 1..{MAX_NAME_CHARS} characters"


def name_problem(value: Any) -> str | None:
    """Why ``value`` cannot be a model or tensor name on the wire, else None: for
    senders, which refuse such a name before encoding it."""
    if type(value) is not str:
        return f"must be {NAME_RULE}, not a {type(value).__name__}"
    if not 0 < len(value) <= MAX_NAME_CHARS:
        return f"must have 1..{MAX_NAME_CHARS} characters; got {len(value)}"
    if not value.isascii():
        try:  # JSON may carry a lone surrogate, which no UTF-8 log or metrics page can
            value.encode()
        except UnicodeEncodeError:
            return f"must be UTF-8 text; {value!r} holds a lone surrogate"
    return None
