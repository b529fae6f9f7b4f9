"""Small helpers shared by every component's click commands.

Every option gets an environment variable automatically: the root group sets
``auto_envvar_prefix="IPUSERVE"``, so ``ipuserve worker --broker`` reads
``IPUSERVE_WORKER_BROKER``. :func:`option` makes ``--help`` show both the
default and that variable, so the configuration reference is the help text.
"""

from __future__ import annotations

import functools
from typing import Any

import click

option = functools.partial(click.option, show_default=True, show_envvar=True)


def fail(message: str) -> None:
    """Exit with a clear one-line error instead of a traceback."""
    raise click.ClickException(message)


def parse_duration_ms(_ctx: Any, _param: Any, value: float | None) -> float | None:
    if value is not None and value < 0:
        raise click.BadParameter("must be >= 0 milliseconds")
    return value
