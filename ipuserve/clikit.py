"""Small helpers shared by every component's click commands.

Every option gets an environment variable automatically: the root group sets
``auto_envvar_prefix="IPUSERVE"``, so ``ipuserve worker --broker`` reads
``IPUSERVE_WORKER_BROKER``. :func:`option` makes ``--help`` show both the
default and that variable, so the configuration reference is the help text.
Every endpoint option takes :class:`Endpoint`, so a mistyped endpoint is a one-line
usage error instead of ZeroMQ's ``Invalid argument`` traceback.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import click

from ipuserve.endpoints import endpoint_problem
from ipuserve.limits import MAX_DURATION_MS, name_problem

option = functools.partial(click.option, show_default=True, show_envvar=True)


def fail(message: str) -> None:
    """Exit with a clear one-line error instead of a traceback."""
    raise click.ClickException(message)


@contextlib.contextmanager
def writing(path: Path, mode: str = "w") -> Iterator[IO[Any]]:
    """``path`` opened for writing; an OSError on the way is a one-line error."""
    try:
        with open(path, mode) as file:
            yield file
    except OSError as exc:
        fail(f"cannot write {path}: {exc.strerror or exc}")


def check_writable(path: Path) -> None:
    """Fail now, not after the work, when ``path`` could not be written: its folder is
    missing or read-only."""
    folder = path.parent
    if not folder.is_dir():
        fail(f"cannot write {path}: {folder} is not a directory")
    if not os.access(folder, os.W_OK):
        fail(f"cannot write {path}: {folder} is not writable")


def parse_duration_ms(_ctx: Any, _param: Any, value: float | None) -> float | None:
    if value is not None and value < 0:
        raise click.BadParameter("must be >= 0 milliseconds")
    return value


class TimeoutSeconds(click.FloatRange):
    """A request timeout: finite seconds > 0 the wire can carry (click's range lets nan
    through, and the Client's own message offers None, which no option can give)."""

    def __init__(self) -> None:
        super().__init__(min=0, max=MAX_DURATION_MS / 1e3, min_open=True, max_open=True)

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        seconds: float = super().convert(value, param, ctx)
        if not math.isfinite(seconds):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        return seconds


class ModelName(click.ParamType):  # type: ignore[type-arg]
    """A model name option: the wire's rule for names, as a usage error."""

    name = "NAME"

    def convert(self, value: Any, param: Any, ctx: Any) -> str:
        problem = name_problem(value)
        if problem is not None:
            self.fail(f"a model name {problem}", param, ctx)
        return str(value)


class Endpoint(click.ParamType):  # type: ignore[type-arg]
    """A ZeroMQ endpoint option (:func:`endpoint_problem`): a usage error, not a traceback."""

    name = "ENDPOINT"

    def __init__(self, *, bind: bool = False, port: int = 5555) -> None:
        self.bind = bind
        self.port = port

    def convert(self, value: Any, param: Any, ctx: Any) -> str:
        problem = endpoint_problem(str(value), bind=self.bind, port=self.port)
        if problem is not None:
            self.fail(problem, param, ctx)
        return str(value)
