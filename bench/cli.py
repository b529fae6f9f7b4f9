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
pyzmq relay baseline (:mod:`ipuserve.bench.suite`).

Options that would be ignored are usage errors instead
(:mod:`ipuserve.bench.options`). A run in which more requests failed than
``--max-error-pct`` allows (by default: any) prints its report, then exits 1 with the
most common error's first message, so a script or CI job cannot take a run with
failures for a clean one. Ctrl-C (or SIGTERM) reports what was measured and exits 130
(143).
"""

from __future__ import annotations

import contextlib
import json
import secrets
import signal
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

from ipuserve.bench.bench import bench as run_bench
from ipuserve.bench.loadgen import LoadConfig
from ipuserve.bench.options import check_load_options, refuse_load_options_with_suite
from ipuserve.bench.report import (
    LoadProgress,
    first_errors,
    latency_throughput_svg,
    run_table,
    suite_table,
    sweep_table,
)
from ipuserve.client.cli import client_for, parse_npy_inputs
from ipuserve.clikit import (
    Endpoint,
    ModelName,
    TimeoutSeconds,
    check_writable,
    option,
    writing,
)
from ipuserve.errors import IpuserveError
from ipuserve.security.cli import curve_client_options, keys_from_options


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
@option(
    "--broker",
    multiple=True,
    type=Endpoint(),
    help="The broker's frontend endpoint (not with --suite); repeat it for several brokers "
    "(in the variable: space-separated): one client spreads the load over them.",
)
@option("--model", type=ModelName(), help="Model to send requests to (not with --suite).")
@option(
    "--input",
    "input_files",
    multiple=True,
    callback=parse_npy_inputs,
    help="NAME=FILE.npy per input (in the variable: space-separated); default: random.",
)
@option(
    "--batch",
    type=_positive_int(),
    help="Random inputs: samples per request along the batching dim [default: the compiled batch].",
)
@option(
    "--concurrency",
    type=_Levels(int),
    default="1",
    help="Closed loop (not with --rate): requests in flight; several (1,4,16) sweep them.",
)
@option("--rate", type=_Levels(float), help="Open loop: requests/s; several sweep them.")
@option(
    "--arrivals",
    type=click.Choice(["poisson", "fixed"]),
    default="poisson",
    help="Open loop (with --rate): arrival process.",
)
@option(
    "--seed",
    type=click.IntRange(min=0),
    default=None,
    help="Seed of the Poisson arrivals and the random inputs, to repeat a run "
    "[default: a new one each run, shown in the report].",
)
@option(
    "--warmup-s",
    type=click.FloatRange(min=0),
    default=1.0,
    help="Send load this long before measuring (not in the figures).",
)
@option(
    "--duration-s",
    type=click.FloatRange(min=0, min_open=True),
    default=10.0,
    help="Measure for this long (or until --requests).",
)
@option("--requests", type=_positive_int(), help="Stop after this many measured requests.")
@option(
    "--timeout-s",
    type=TimeoutSeconds(),
    default=30.0,
    help="Per-request timeout.",
)
@option("--suite", type=click.Choice(["fabric"]), help="Run a self-contained suite instead.")
@option("--runs", type=_positive_int(), default=3, help="Suite: repetitions (medians).")
@option("--quick", is_flag=True, help="Suite: short phases (a smoke test, not figures).")
@option("--workers", type=_positive_int(), default=2, help="Suite: workers for the MLP.")
@option(
    "--max-error-pct",
    type=click.FloatRange(min=0, max=100),
    default=0.0,
    help="Exit 1 if more than this % of requests failed (the report is printed first).",
)
@option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@option(
    "--output", type=click.Path(dir_okay=False, path_type=Path), help="Also write the JSON here."
)
@option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write latency (p50, p99) against throughput as SVG, a point per level.",
)
@curve_client_options
@click.pass_context
def bench(ctx: click.Context, /, **opts: Any) -> None:
    """Measure throughput and latency (split into broker queue, worker queue, device, wire)."""
    failure, exit_code, show = None, 1, True
    for path in (opts["output"], opts["plot"]):
        if path is not None:
            check_writable(path)  # before the run, which a late failure would waste
    if opts["plot"] is not None and opts["plot"].suffix.lower() != ".svg":
        raise click.UsageError(f"--plot writes SVG: give a .svg path, not {opts['plot']}")
    if opts["suite"]:
        if opts["plot"] is not None:
            raise click.UsageError("--plot draws a --concurrency or --rate sweep, not --suite")
        refuse_load_options_with_suite(ctx)
        with _sigterm_as_ctrl_c():
            result = _suite(opts)
        text = suite_table(result)
    else:
        check_load_options(ctx, opts)
        loads = _loads(opts)
        with _sigterm_as_ctrl_c() as stopped_by:
            levels = _single(opts, loads)
        sweep = len(loads) > 1  # as asked, even when Ctrl-C cut it short
        result = {"sweep": levels} if sweep else levels[0]
        text = sweep_table(levels) if sweep else run_table(levels[0])
        failure = nothing_succeeded(levels) or too_many_failed(levels, opts["max_error_pct"])
        last = levels[-1]
        if last["interrupted"]:
            show = any(level["requests"] for level in levels)  # else a table of zeros
            level = f" of level {len(levels)}" if len(levels) > 1 else ""
            how = "SIGTERM" if stopped_by else "Ctrl-C"
            failure = (
                f"interrupted ({how}): the figures above cover the first "
                f"{last['duration_s']} s of measuring{level}"
                if last["requests"]
                else f"interrupted ({how}) before anything{level} was measured (warm-up)"
            )
            exit_code = 128 + (stopped_by[0] if stopped_by else signal.SIGINT)  # as a shell
    if show:
        click.echo(json.dumps(result, indent=2) if opts["as_json"] else text)  # shown first
        if opts["plot"] is not None and not opts["suite"]:
            _write(opts["plot"], latency_throughput_svg(levels))
        if opts["output"] is not None:
            _write(opts["output"], json.dumps(result, indent=2) + "\n")
    if failure is not None:
        click.echo(f"Error: {failure}", err=True)
        raise SystemExit(exit_code)


@contextlib.contextmanager
def _sigterm_as_ctrl_c() -> Iterator[list[int]]:
    """SIGTERM (``kill``, ``docker stop``, a CI timeout) ends the run like Ctrl-C: the
    figures measured so far are still printed. Yields the signals that did. Outside the
    measuring window (connecting, the suite) it ends the command with exit 143 and a
    line saying so, not click's "Aborted!" and 1."""
    stopped_by: list[int] = []

    def stop(signum: int, _frame: object) -> None:
        stopped_by.append(signum)
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():
        yield stopped_by  # signal handlers belong to the main thread (a test's CliRunner)
        return
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield stopped_by
    except KeyboardInterrupt:
        if not stopped_by:
            raise  # Ctrl-C: click reports it
        click.echo("Error: stopped by SIGTERM before anything was measured", err=True)
        raise SystemExit(128 + stopped_by[0]) from None
    finally:
        signal.signal(signal.SIGTERM, previous)


def _write(path: Path, text: str) -> None:
    with writing(path) as file:
        file.write(text)


def nothing_succeeded(levels: list[dict[str, Any]]) -> str | None:
    """Why a run (every level of a sweep) had no successful request; None if one succeeded."""
    if any(level["ok"] for level in levels):
        return None
    counts: Counter[str] = sum((Counter(level["errors"]) for level in levels), Counter())
    if not counts:
        return "no request finished inside the measurement window (see --duration-s)"
    ((code, _n),) = counts.most_common(1)
    return f"no request succeeded: [{code}] {first_errors(levels)[code]}"


def too_many_failed(levels: list[dict[str, Any]], max_error_pct: float) -> str | None:
    """Why a run failed more requests than allowed; None if it did not.

    Requests that failed after the measurement window count too: they are outside
    the figures, but a worker that died at the end must not pass for a clean run."""
    failed: Counter[str] = Counter()
    total = 0
    for level in levels:
        late = level.get("after_window", {})
        failed.update(level["errors"])
        failed.update(late.get("errors", {}))
        total += level["requests"] + late.get("ok", 0) + sum(late.get("errors", {}).values())
    count = sum(failed.values())
    if not count or count * 100 <= max_error_pct * total:
        return None
    ((code, _n),) = failed.most_common(1)
    return (
        f"{count} of {total} requests failed ({count * 100 / total:.2g}%, above "
        f"--max-error-pct {max_error_pct:g}); most often [{code}] {first_errors(levels)[code]}"
    )


def _loads(opts: dict[str, Any]) -> list[LoadConfig]:
    """One LoadConfig per level: every --rate (open loop), else every --concurrency."""
    common = {
        "warmup_s": opts["warmup_s"],
        "duration_s": opts["duration_s"],
        "requests": opts["requests"],
        "poisson": opts["arrivals"] == "poisson",
        "seed": opts["seed"] if opts["seed"] is not None else secrets.randbelow(2**31),
    }
    if opts["rate"]:
        return [LoadConfig(rate=rate, **common) for rate in opts["rate"]]
    return [LoadConfig(in_flight=int(n), **common) for n in opts["concurrency"]]


def _single(opts: dict[str, Any], loads: list[LoadConfig]) -> list[dict[str, Any]]:
    """Run each load level in turn, on one client; their summaries in order."""
    if not opts["broker"] or not opts["model"]:
        raise click.UsageError("--broker and --model are required (or use --suite fabric)")
    inputs = opts["input_files"] or None
    keys = keys_from_options(opts["curve_secret_key"], opts["broker_public_key"])
    results = []
    try:
        with client_for(opts["broker"], opts["timeout_s"], keys) as client:
            for index, load in enumerate(loads, 1):
                if len(loads) > 1:
                    what = f"rate {load.rate:g}/s" if load.rate else f"{load.in_flight} in flight"
                    click.echo(f"level {index}/{len(loads)}: {what}", err=True)
                progress = LoadProgress()
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
                if results[-1]["interrupted"]:
                    break  # Ctrl-C: report what was measured, run no further level
    except IpuserveError as exc:
        raise click.ClickException(f"[{exc.code}] {exc}") from exc
    return results


def _suite(opts: dict[str, Any]) -> dict[str, Any]:
    from ipuserve.bench.suite import SuiteConfig, run_suite

    config = SuiteConfig(runs=opts["runs"], quick=opts["quick"], mlp_workers=opts["workers"])
    try:
        return run_suite(config, log=lambda line: click.echo(line, err=True))
    except IpuserveError as exc:
        raise click.ClickException(f"[{exc.code}] {exc}") from exc


commands: list[click.Command] = [bench]
