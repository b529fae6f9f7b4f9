"""The ``ipuserve`` command: one click group; each component mounts its own commands.

The components own their commands (``runtime/cli.py``, ``worker/cli.py``,
``broker/cli.py``, ``client/cli.py``); this module only collects them.
"""

from __future__ import annotations

import click

from ipuserve._version import __version__
from ipuserve.logs import LOG_LEVEL_ENV, configure_logging


@click.group(context_settings={"auto_envvar_prefix": "IPUSERVE", "show_default": True})
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


def _mount() -> None:
    from ipuserve.broker.cli import commands as broker_commands
    from ipuserve.client.cli import commands as client_commands
    from ipuserve.runtime.cli import commands as runtime_commands
    from ipuserve.worker.cli import commands as worker_commands

    for command in [*runtime_commands, *worker_commands, *broker_commands, *client_commands]:
        main.add_command(command)


_mount()
