"""``ipuserve models load | unload | index``: the model repository from the shell.

Each command asks a broker (an admin's key with CURVE; in protected mode, any process
on the broker's host: docs/repository.md) and, unless ``--no-wait``, waits for the
state it asked for, drawing its progress on a terminal (:class:`ProgressLine`). The
index is a table (or ``--json``): each version's state, workers, reason, and ``*``
on the model's default version.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from ipuserve.client.cli_support import client_for, typed_errors
from ipuserve.client.client import Client
from ipuserve.client.repository import LOAD_TIMEOUT_S, OnProgress, RepositoryIndex
from ipuserve.clikit import Endpoint, ModelName, TimeoutSeconds, option
from ipuserve.progress import Progress, ProgressLine
from ipuserve.security.cli import curve_client_options, keys_from_options

__all__ = ["index_table", "repository_commands"]

F = TypeVar("F", bound=Callable[..., object])

_BROKER_HELP = (
    "The broker's frontend endpoint, e.g. tcp://HOST:5555; repeat it for several brokers "
    "(in the variable: space-separated): any one of them answers."
)
_VERSION_HELP = "A version of the model (a whole number >= 1)."


def _common(wait: bool) -> Callable[[F], F]:
    """``--broker`` (the ``models`` listing's variable), the CURVE options, the
    request timeout and, for the commands that wait, ``--no-wait`` and ``--wait-s``."""

    def apply(command: F) -> F:
        decorators = [
            option(
                "--broker",
                required=True,
                multiple=True,
                type=Endpoint(),
                envvar="IPUSERVE_MODELS_BROKER",
                help=_BROKER_HELP,
            ),
            option("--json", "as_json", is_flag=True, help="Print JSON instead of a table."),
            option(
                "--timeout-s",
                type=TimeoutSeconds(),
                default=10.0,
                help="Give up on one question to the broker after this long.",
            ),
            curve_client_options,
        ]
        if wait:
            decorators += [
                option(
                    "--wait/--no-wait",
                    default=True,
                    help="Wait until the state asked for is reached, or return at once.",
                ),
                option(
                    "--wait-s",
                    type=click.FloatRange(min=0, min_open=True),
                    default=LOAD_TIMEOUT_S,
                    help="Give up waiting after this long.",
                ),
            ]
        for decorator in reversed(decorators):
            command = decorator(command)
        return command

    return apply


def _connecting(command: Callable[..., None]) -> Callable[..., None]:
    """The command gets ``connect`` (a Client of ``--broker`` with the CURVE options and
    ``--timeout-s``) in place of those options: one config object, as rq does it."""

    @functools.wraps(command)
    def run(
        *,
        broker: tuple[str, ...],
        timeout_s: float,
        curve_secret_key: Path | None,
        broker_public_key: Path | None,
        **options: Any,
    ) -> None:
        keys = keys_from_options(curve_secret_key, broker_public_key)
        command(connect=lambda: client_for(broker, timeout_s, keys), **options)

    return run


Connect = Callable[[], Client]


@click.command("index")
@_common(wait=False)
@_connecting
def index(connect: Connect, as_json: bool) -> None:
    """Every model version in the workers' repositories: its state (READY, LOADING,
    UNLOADING, UNAVAILABLE), workers, and why; * marks a model's default version."""
    with typed_errors(), connect() as client:
        found = client.repository_index()
    _show(found, as_json)


@click.command("load")
@click.argument("name", type=ModelName())
@option("--version", help=_VERSION_HELP + " Default: the latest in any repository.")
@option(
    "--replicas",
    type=click.IntRange(min=1),
    help="IPUs each worker gives the version. Default: the model's config.toml.",
)
@option(
    "--workers",
    type=click.IntRange(min=1),
    help="How many repository workers load it. Default: 1.",
)
@_common(wait=True)
@_connecting
def load(
    connect: Connect,
    name: str,
    version: str | None,
    replicas: int | None,
    workers: int | None,
    as_json: bool,
    wait: bool,
    wait_s: float,
) -> None:
    """Load NAME (a version of it) on repository workers with free IPUs, least loaded
    first, and wait until it is READY."""
    found = _drawn(
        connect,
        f"loading {name}",
        name,
        lambda client, progress: client.load_model(
            name,
            version,
            replicas=replicas,
            workers=workers,
            wait=wait,
            timeout=wait_s,
            on_progress=progress,
        ),
    )
    _show(found, as_json, only=name)


@click.command("unload")
@click.argument("name", type=ModelName())
@option("--version", help=_VERSION_HELP + " Default: every loaded version.")
@_common(wait=True)
@_connecting
def unload(
    connect: Connect, name: str, version: str | None, as_json: bool, wait: bool, wait_s: float
) -> None:
    """Unload NAME (a version of it): its workers finish what they hold, hand back what
    they have not started, and free their IPUs; wait until it is gone."""
    found = _drawn(
        connect,
        f"unloading {name}",
        name,
        lambda client, progress: client.unload_model(
            name, version, wait=wait, timeout=wait_s, on_progress=progress
        ),
    )
    _show(found, as_json, only=name)


def _drawn(
    connect: Connect,
    phase: str,
    name: str,
    call: Callable[[Client, OnProgress], RepositoryIndex],
) -> RepositoryIndex:
    """``call`` with a client, its wait drawn on a terminal's progress line."""
    line = ProgressLine()
    try:
        with typed_errors(), connect() as client:
            return call(client, _drawing(line, phase, name))
    finally:
        line.finish()


def _drawing(line: ProgressLine, phase: str, name: str) -> OnProgress:
    """The wait's progress on ``line``: the model's versions and their states."""

    def draw(found: RepositoryIndex, waited_s: float) -> None:
        states = " ".join(f"v{v.version} {v.state}" for v in found.versions(name))
        ready = sum(v.state == "READY" for v in found.versions(name))
        line(Progress(phase, waited_s, ready, "ready", states, rate=False))

    return draw


def _show(found: RepositoryIndex, as_json: bool, only: str | None = None) -> None:
    if as_json:
        click.echo(json.dumps(found.to_json(), indent=2))
        return
    if found.message:
        click.echo(found.message, err=True)
    click.echo(index_table(found, only))


_ROW = "{:20} {:>8} {:1} {:12} {:>7}  {}"


def index_table(found: RepositoryIndex, only: str | None = None) -> str:
    """One row per version (``only``: that model's): name, version (``*``: the
    default), state, how many workers serve it, and the reason (or the workers)."""
    header = _ROW.format("model", "version", "", "state", "workers", "reason")
    lines = [header, "-" * len(header)]
    shown = [v for v in found if only is None or v.name == only]
    for v in sorted(shown, key=lambda v: (v.name, int(v.version))):
        why = v.reason or " ".join(v.workers)
        lines.append(
            _ROW.format(v.name, v.version, "*" if v.default else "", v.state, len(v.workers), why)
        )
    if not shown:
        lines.append("(nothing: no repository worker has joined, or none holds it)")
    return "\n".join(lines)


repository_commands: list[click.Command] = [index, load, unload]
