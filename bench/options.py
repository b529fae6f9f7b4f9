"""Which ``ipuserve bench`` options go together: a run against a deployment or the
suite, closed or open loop, random inputs or files.

An option that would be ignored is a usage error instead, naming the conflict. Only
options given on the command line count (click's parameter source): a value from an
``IPUSERVE_BENCH_*`` variable is a default, and ``--concurrency`` on the command
line beats a rate from the environment.
"""

from __future__ import annotations

from typing import Any

import click
from click.core import ParameterSource

#: what --suite fabric decides itself, and what only it uses
_LOAD_OPTIONS = (
    "broker",
    "model",
    "input_files",
    "batch",
    "concurrency",
    "rate",
    "arrivals",
    "seed",
    "warmup_s",
    "duration_s",
    "requests",
    "timeout_s",
    "max_error_pct",
    "curve_secret_key",
    "broker_public_key",
)
_SUITE_OPTIONS = ("runs", "quick", "workers")


def _given(ctx: click.Context, names: tuple[str, ...]) -> list[str]:
    """The options among ``names`` given on the command line (not defaults or variables)."""
    flags = {param.name: param.opts[0] for param in ctx.command.params}
    return [
        flags[name]
        for name in names
        if ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE
    ]


def refuse_load_options_with_suite(ctx: click.Context) -> None:
    given = _given(ctx, _LOAD_OPTIONS)
    if given:
        raise click.UsageError(
            "--suite fabric starts its own broker, workers and load; it does not take "
            + ", ".join(given)
        )


def check_load_options(ctx: click.Context, opts: dict[str, Any]) -> None:
    """Refuse what a run against a deployment would silently ignore."""
    suite_only = _given(ctx, _SUITE_OPTIONS)
    if suite_only:
        raise click.UsageError(f"{', '.join(suite_only)}: only for --suite fabric")
    if len(_given(ctx, ("concurrency", "rate"))) == 2:
        raise click.UsageError(
            "--concurrency (closed loop) and --rate (open loop) exclude each other; give one"
        )
    if _given(ctx, ("concurrency",)):
        opts["rate"] = None  # beats a rate from the environment
    if _given(ctx, ("arrivals",)) and not opts["rate"]:
        raise click.UsageError("--arrivals shapes the open loop's arrivals; it needs --rate")
    if _given(ctx, ("batch",)) and opts["input_files"]:
        raise click.UsageError(
            "--batch sizes the random inputs; with --input the files' shapes are sent as given"
        )
