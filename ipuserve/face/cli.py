"""The ``ipuserve`` command: one click group; each component mounts its own commands.

The components own their commands (``runtime/cli.py``, ``worker/cli.py``,
``broker/cli.py``, ``client/cli.py``, ``bench/cli.py``); this module only collects
them, and adds ``ipuserve demo`` (:mod:`ipuserve.face.demo`), which uses several,
and ``ipuserve health`` (:mod:`ipuserve.face.health`), which checks any of them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ipuserve._version import __version__
from ipuserve.logs import LOG_LEVEL_ENV, configure_logging

#: Exit status after Ctrl-C, as a shell reports a command killed by SIGINT.
INTERRUPTED = 128 + 2


class _Group(click.Group):
    """Ctrl-C ends every command with exit 130 and one line, not click's "Aborted!" and
    1, which a script cannot tell from a failure. Commands with figures to show (bench,
    demo, the tools) catch it themselves, print them, then exit 130 too."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            click.echo("\nError: interrupted (Ctrl-C)", err=True)
            ctx.exit(INTERRUPTED)


@click.group(cls=_Group, context_settings={"auto_envvar_prefix": "IPUSERVE", "show_default": True})
@click.version_option(__version__, prog_name="ipuserve")
@click.option(
    "--log-level",
    envvar=LOG_LEVEL_ENV,
    show_envvar=True,
    default="WARNING",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], case_sensitive=False),
    help="Verbosity of the logs written to stderr.",
)
def main(log_level: str) -> None:
    """Serve models on a fleet of (simulated) Graphcore IPUs over ZeroMQ."""
    configure_logging(log_level)


@main.command()
@click.option(
    "--requests",
    default=3000,
    show_default=True,
    type=click.IntRange(min=1),
    envvar="IPUSERVE_DEMO_REQUESTS",
    show_envvar=True,
    help="Requests to send.",
)
@click.option(
    "--clients",
    default=8,
    show_default=True,
    type=click.IntRange(min=1),
    envvar="IPUSERVE_DEMO_CLIENTS",
    show_envvar=True,
    help="Concurrent clients.",
)
@click.option(
    "--in-flight",
    default=8,
    show_default=True,
    type=click.IntRange(min=1),
    envvar="IPUSERVE_DEMO_IN_FLIGHT",
    show_envvar=True,
    help="Requests each client keeps in flight.",
)
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    envvar="IPUSERVE_DEMO_WORKDIR",
    show_envvar=True,
    help="Where models and process logs go [default: a new temporary directory].",
)
def demo(requests: int, clients: int, in_flight: int, workdir: Path | None) -> None:
    """Run a broker and two workers locally, send traffic, check it, report, stop."""
    from ipuserve.face.demo import DemoConfig, run_demo

    try:
        code = run_demo(
            DemoConfig(requests=requests, clients=clients, in_flight=in_flight, workdir=workdir)
        )
    except KeyboardInterrupt:
        click.echo(
            "\ninterrupted: the broker and workers were stopped; their logs stay in the "
            "working directory named above",
            err=True,
        )
        code = INTERRUPTED
    sys.exit(code)


def _mount() -> None:
    from ipuserve.bench.cli import commands as bench_commands
    from ipuserve.broker.cli import commands as broker_commands
    from ipuserve.client.cli import commands as client_commands
    from ipuserve.face.health import commands as health_commands
    from ipuserve.gateway.cli import commands as gateway_commands
    from ipuserve.runtime.cli import commands as runtime_commands
    from ipuserve.worker.cli import commands as worker_commands

    for command in [
        *runtime_commands,
        *worker_commands,
        *broker_commands,
        *client_commands,
        *bench_commands,
        *gateway_commands,
        *health_commands,
    ]:
        main.add_command(command)

    from ipuserve.security.cli import keys_group  # `ipuserve keys` (issue 16)

    main.add_command(keys_group)


_mount()
