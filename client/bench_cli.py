"""``ipuserve bench``: load one model of a running deployment, or run the fabric suite.

Two forms::

    ipuserve bench --broker tcp://HOST:5555 --model mlp --concurrency 64 --duration-s 10
    ipuserve bench --broker tcp://HOST:5555 --model mlp --concurrency 1,4,16,64 --plot c.svg
    ipuserve bench --suite fabric --runs 5 --json

The first measures an existing deployment (closed loop with ``--concurrency``
requests in flight, or open loop at ``--rate`` requests/s). Given several values,
it sweeps them one after the other, like perf_analyzer's ``--concurrency-range``:
one row per load level, and with ``--plot`` the latency/throughput curve as SVG.
The last form starts everything itself on loopback and compares the fabric with the
pyzmq relay baseline (:mod:`ipuserve.client.suite`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import numpy as np

from ipuserve.client.bench import bench as run_bench
from ipuserve.client.client import Client
from ipuserve.client.loadgen import LoadConfig
from ipuserve.client.report import ProgressLine, run_table, suite_table, sweep_table
from ipuserve.client.svgplot import COLOURS, Axis, Series, line_chart
from ipuserve.clikit import option
from ipuserve.errors import IpuserveError


def _positive_int(**kwargs: Any) -> Any:
    return click.IntRange(min=1, **kwargs)


class _Levels(click.ParamType):  # type: ignore[type-arg]
    """One load level or a comma-separated sweep of them: ``64`` or ``1,4,16,64``."""

    name = "N[,N...]"

    def __init__(self, kind: type[int] | type[float]) -> None:
        self._kind = kind

    def convert(self, value: Any, param: Any, ctx: Any) -> tuple[float, ...]:
        if isinstance(value, tuple):
            return value
        try:
            levels = tuple(self._kind(part) for part in str(value).split(","))
        except ValueError:
            self.fail(f"{value!r} is not a number or a comma-separated list of them", param, ctx)
        if any(level <= 0 for level in levels):
            self.fail(f"{value!r}: every value must be > 0", param, ctx)
        return levels


@click.command()
@option("--broker", help="The broker's frontend endpoint (not with --suite).")
@option("--model", help="Model to load (not with --suite).")
@option("--input", "input_files", multiple=True, help="NAME=FILE.npy; default: random inputs.")
@option("--batch", type=_positive_int(), help="Samples per request along the batching dim.")
@option(
    "--concurrency",
    type=_Levels(int),
    default="1",
    help="Closed loop: requests in flight; several (1,4,16) sweep them.",
)
@option("--rate", type=_Levels(float), help="Open loop: requests/s; several sweep them.")
@option(
    "--arrivals",
    type=click.Choice(["poisson", "fixed"]),
    default="poisson",
    help="Open loop: arrival process.",
)
@option("--warmup-s", type=click.FloatRange(min=0), default=1.0, help="Not measured.")
@option(
    "--duration-s",
    type=click.FloatRange(min=0, min_open=True),
    default=10.0,
    help="Measure for this long (or until --requests).",
)
@option("--requests", type=_positive_int(), help="Stop after this many measured requests.")
@option(
    "--timeout-s",
    type=click.FloatRange(min=0, min_open=True),
    default=30.0,
    help="Per-request timeout.",
)
@option("--suite", type=click.Choice(["fabric"]), help="Run a self-contained suite instead.")
@option("--runs", type=_positive_int(), default=3, help="Suite: repetitions (medians).")
@option("--quick", is_flag=True, help="Suite: short phases (a smoke test, not figures).")
@option("--workers", type=_positive_int(), default=2, help="Suite: workers for the MLP.")
@option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@option(
    "--output", type=click.Path(dir_okay=False, path_type=Path), help="Also write the JSON here."
)
@option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write latency (p50, p99) against throughput as SVG, a point per level.",
)
def bench(**opts: Any) -> None:
    """Measure throughput and latency (split into broker queue, worker queue, device, wire)."""
    if opts["suite"]:
        if opts["plot"] is not None:
            raise click.UsageError("--plot draws a --concurrency or --rate sweep, not --suite")
        result = _suite(opts)
        text = suite_table(result)
    else:
        levels = _single(opts)
        result = levels[0] if len(levels) == 1 else {"sweep": levels}
        text = run_table(levels[0]) if len(levels) == 1 else sweep_table(levels)
        if opts["plot"] is not None:
            opts["plot"].write_text(latency_throughput_svg(levels))
    if opts["output"] is not None:
        opts["output"].write_text(json.dumps(result, indent=2) + "\n")
    click.echo(json.dumps(result, indent=2) if opts["as_json"] else text)


def latency_throughput_svg(levels: list[dict[str, Any]]) -> str:
    """p50 and p99 latency against throughput, a point per load level (labelled)."""
    first = levels[0]
    closed = first["mode"] == "closed"
    labels = [f"{lv['in_flight']}" if closed else f"{lv['rate']:g}/s" for lv in levels]
    series = [
        Series(
            name,
            [(lv["throughput"]["req_per_s"], lv["latency_us"][key]) for lv in levels],
            labels,
            dashed=key == "p99",
            colour=COLOURS[0],
        )
        for name, key in (("p50", "p50"), ("p99", "p99"))
    ]
    level = "requests in flight" if closed else "offered rate"
    return line_chart(
        series,
        title=f"{first['model']}: latency against throughput (points: {level})",
        x=Axis("throughput (requests/s)"),
        y=Axis("latency (µs)", log=True),
    )


def parse_npy_inputs(
    _ctx: Any, _param: Any, values: tuple[str, ...]
) -> dict[str, np.ndarray[Any, Any]]:
    """NAME=FILE.npy option values -> arrays (click callback for --input)."""
    arrays = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise click.BadParameter(f"{value!r} is not NAME=FILE.npy")
        try:
            arrays[name] = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise click.BadParameter(f"cannot read {path}: {exc}") from exc
    return arrays


def _loads(opts: dict[str, Any]) -> list[LoadConfig]:
    """One LoadConfig per level: every --rate (open loop), else every --concurrency."""
    common = {
        "warmup_s": opts["warmup_s"],
        "duration_s": opts["duration_s"],
        "requests": opts["requests"],
        "poisson": opts["arrivals"] == "poisson",
    }
    if opts["rate"]:
        return [LoadConfig(rate=rate, **common) for rate in opts["rate"]]
    return [LoadConfig(in_flight=int(n), **common) for n in opts["concurrency"]]


def _single(opts: dict[str, Any]) -> list[dict[str, Any]]:
    """Run each load level in turn, on one client; their summaries in order."""
    if not opts["broker"] or not opts["model"]:
        raise click.UsageError("--broker and --model are required (or use --suite fabric)")
    inputs = parse_npy_inputs(None, None, opts["input_files"]) if opts["input_files"] else None
    loads = _loads(opts)
    results = []
    try:
        with Client(opts["broker"], timeout=opts["timeout_s"]) as client:
            for index, load in enumerate(loads, 1):
                if len(loads) > 1:
                    what = f"rate {load.rate:g}/s" if load.rate else f"{load.in_flight} in flight"
                    click.echo(f"level {index}/{len(loads)}: {what}", err=True)
                progress = ProgressLine()
                try:
                    results.append(
                        run_bench(
                            client,
                            opts["model"],
                            load,
                            inputs=inputs,
                            batch=opts["batch"],
                            progress=progress,
                        )
                    )
                finally:
                    progress.finish()
    except IpuserveError as exc:
        raise click.ClickException(f"[{exc.code}] {exc}") from exc
    return results


def _suite(opts: dict[str, Any]) -> dict[str, Any]:
    from ipuserve.client.suite import SuiteConfig, run_suite

    config = SuiteConfig(runs=opts["runs"], quick=opts["quick"], mlp_workers=opts["workers"])
    try:
        return run_suite(config, log=lambda line: click.echo(line, err=True))
    except IpuserveError as exc:
        raise click.ClickException(f"[{exc.code}] {exc}") from exc
