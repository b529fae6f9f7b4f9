"""The wire's limits on names, versions and durations, without the wire.

A command line refuses a model name or a timeout the wire could not carry before it
connects anywhere (:mod:`ipuserve.clikit`), and the runtime's commands share those
helpers; importing :mod:`ipuserve.protocol` for two constants and one check would
pull ZeroMQ into processes that have no network (DESIGN.md §1: the runtime imports
nothing that imports zmq). So these pure rules live here, and the protocol enforces
the same ones at decode.
"""

from __future__ import annotations

import re
from typing import Any

#: The longest model or tensor name, in characters.
MAX_NAME_CHARS = 256
#: Timeouts, budgets and timings are below this many milliseconds (~31 years).
MAX_DURATION_MS = 1e12
#: What a name must be, as error messages say it.
NAME_RULE = f"a string of 1..{MAX_NAME_CHARS} characters"
#: A model's version: a whole number >= 1 in ASCII digits (a repository's
#: ``NAME/VERSION/`` directory), ordered as numbers, of at most 18 digits (an int64).
MAX_VERSION_DIGITS = 18
#: What a version must be, as error messages say it.
VERSION_RULE = f"a whole number >= 1 of at most {MAX_VERSION_DIGITS} ASCII digits, no leading 0"
#: The one version syntax (the wire's, msgspec's ``Meta(pattern=...)``, which searches:
#: hence anchored, with ``\Z``, as ``$`` also matches before a final newline). ``[0-9]``,
#: not ``\d`` nor ``str.isdigit``, which take other scripts' digits: int() reads
#: "\u0661" (Arabic-Indic one) as 1.
VERSION_PATTERN = rf"^[1-9][0-9]{{0,{MAX_VERSION_DIGITS - 1}}}\Z"
_VERSION = re.compile(VERSION_PATTERN)


def is_version(value: Any) -> bool:
    """Whether ``value`` is a version as the wire writes it (VERSION_RULE): a string."""
    return type(value) is str and _VERSION.match(value) is not None


def version_problem(value: Any) -> str | None:
    """Why ``value`` cannot be a version on the wire, else None: for every reader of a
    version (a command line, a directory name, an HTTP path or body), which refuses
    one before it uses it. An int is no version: a caller that takes one writes it
    with ``str`` first."""
    if is_version(value):
        return None
    shown = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:30]}..."
    return f"must be {VERSION_RULE}, not {shown}"


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
