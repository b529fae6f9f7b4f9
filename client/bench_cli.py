"""``ipuserve bench``: load one model of a running deployment, or run the fabric suite.

Two forms::

    ipuserve bench --broker tcp://HOST:5555 --model mlp --concurrency 64 --duration-s 10
    ipuserve bench --suite fabric --runs 5 --json

The first measures an existing deployment (closed loop with ``--concurrency``
requests in flight, or open loop at ``--rate`` requests/s). The second starts
everything itself on loopback and compares the fabric with the pyzmq relay
baseline (:mod:`ipuserve.client.suite`).
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
from ipuserve.client.report import ProgressLine, run_table, suite_table
from ipuserve.clikit import option
from ipuserve.errors import IpuserveError


def _positive_int(**kwargs: Any) -> Any:
    return click.IntRange(min=1, **kwargs)


@click.command()
@option("--broker", help="The broker's frontend endpoint (not with --suite).")
@option("--model", help="Model to load (not with --suite).")
@option("--input", "input_files", multiple=True, help="NAME=FILE.npy; default: random inputs.")
@option("--batch", type=_positive_int(), help="Samples per request along the batching dim.")
@option("--concurrency", type=_positive_int(), default=1, help="Closed loop: requests in flight.")
@option("--rate", type=click.FloatRange(min=0, min_open=True), help="Open loop: requests/s.")
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
def bench(**opts: Any) -> None:
    """Measure throughput and latency (split into broker queue, worker queue, device, wire)."""
    if opts["suite"]:
        result = _suite(opts)
        text = suite_table(result)
    else:
        result = _single(opts)
        text = run_table(result)
    if opts["output"] is not None:
        opts["output"].write_text(json.dumps(result, indent=2) + "\n")
    click.echo(json.dumps(result, indent=2) if opts["as_json"] else text)


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


def _load(opts: dict[str, Any]) -> LoadConfig:
    return LoadConfig(
        warmup_s=opts["warmup_s"],
        duration_s=opts["duration_s"],
        requests=opts["requests"],
        in_flight=opts["concurrency"],
        rate=opts["rate"],
        poisson=opts["arrivals"] == "poisson",
    )


def _single(opts: dict[str, Any]) -> dict[str, Any]:
    if not opts["broker"] or not opts["model"]:
        raise click.UsageError("--broker and --model are required (or use --suite fabric)")
    inputs = parse_npy_inputs(None, None, opts["input_files"]) if opts["input_files"] else None
    progress = ProgressLine()
    try:
        with Client(opts["broker"], timeout=opts["timeout_s"]) as client:
            return run_bench(
                client,
                opts["model"],
                _load(opts),
                inputs=inputs,
                batch=opts["batch"],
                progress=progress,
            )
    except IpuserveError as exc:
        raise click.ClickException(f"[{exc.code}] {exc}") from exc
    finally:
        progress.finish()


def _suite(opts: dict[str, Any]) -> dict[str, Any]:
    from ipuserve.client.suite import SuiteConfig, run_suite

    config = SuiteConfig(runs=opts["runs"], quick=opts["quick"], mlp_workers=opts["workers"])
    try:
        return run_suite(config, log=lambda line: click.echo(line, err=True))
    except IpuserveError as exc:
        raise click.ClickException(f"[{exc.code}] {exc}") from exc
