"""Turn bench results into text: the progress line, one run's table, the suite's table.

Pure formatting: everything here takes the JSON-ready dicts that
:mod:`ipuserve.bench.recording` and :mod:`ipuserve.bench.suite` build, so the
table and ``--json`` always show the same numbers.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, TextIO

from ipuserve.bench.recording import SPLIT_PARTS, Recording
from ipuserve.bench.svgplot import COLOURS, Axis, Series, line_chart
from ipuserve.latency import PERCENTILES
from ipuserve.progress import Progress, ProgressLine

#: how long requests may stay in flight after the window before bench says it waits
DRAIN_NOTICE_S = 2.0


class LoadProgress:
    """``ipuserve bench``'s progress while a load runs, drawn by the one
    :class:`~ipuserve.progress.ProgressLine` (so only on a terminal).

    Terminal or not, it says once when requests still in flight after the window keep
    the run waiting (a worker that died with them: each ends at its timeout), so a
    bench that looks finished is not silently stuck for --timeout-s."""

    def __init__(self, stream: TextIO | None = None, *, enabled: bool | None = None) -> None:
        # the load generator reports about four times a second: draw every report
        self._line = ProgressLine(stream, enabled=enabled, interval_s=0.0)
        self._started = time.perf_counter_ns()
        self._draining_since: int | None = None
        self._told = False

    def __call__(self, recording: Recording, outstanding: int) -> None:
        if recording.window_closed and outstanding:
            self._notice_drain(outstanding)
        if not self._line.enabled:
            return
        now = time.perf_counter_ns()
        errors = sum(1 for s in recording.samples if s.error is not None)
        phase = "warm-up" if now < recording.start_ns else "measuring"
        detail = f"errors {errors:5d}  in flight {outstanding:5d}"
        elapsed_s = (now - self._started) / 1e9
        self._line(Progress(phase, elapsed_s, len(recording.samples), "requests", detail))

    def _notice_drain(self, outstanding: int) -> None:
        now = time.perf_counter_ns()
        if self._draining_since is None:
            self._draining_since = now
        elif not self._told and now - self._draining_since >= DRAIN_NOTICE_S * 1e9:
            self._told = True
            self._line.note(
                f"waiting for {outstanding} request(s) still in flight after the measurement "
                "window (each ends by its --timeout-s at the latest)"
            )

    def finish(self) -> None:
        self._line.finish()


#: the latency figures a run's block shows (the count is the ``ok`` above them)
LATENCY_SHOWN = (*(key for key, _ in PERCENTILES), "mean", "max")


def run_table(summary: dict[str, Any]) -> str:
    """A human-readable block for one bench run (the ``summarize`` dict plus its config)."""
    tp, lat, split = summary["throughput"], summary["latency_us"], summary["split_us"]
    lines = [
        f"mode        {summary.get('mode', '?')}  {_load(summary)}",
        f"requests    {summary['requests']} ok {summary['ok']}  errors {_errors(summary)}"
        f"  skipped {summary['skipped']}  in {summary['duration_s']} s",
        f"throughput  {tp['req_per_s']:.1f} req/s  {tp['samples_per_s']:.1f} samples/s  "
        f"{tp['mb_per_s']:.2f} MB/s",
        "latency us  " + "  ".join(f"{k} {lat[k]:.0f}" for k in LATENCY_SHOWN),
        "split us    " + "  ".join(f"{k} {split[k]:.0f}" for k in (*SPLIT_PARTS, "total")),
    ]
    return "\n".join(lines + error_lines([summary]))


def sweep_table(levels: list[dict[str, Any]]) -> str:
    """One row per load level of a sweep: throughput, latency percentiles, errors."""
    closed = levels[0].get("mode") == "closed"
    header = (
        f"{'in flight' if closed else 'rate/s':>10} {'req/s':>10} {'samples/s':>10} "
        f"{'p50 us':>9} {'p90 us':>9} {'p99 us':>9} {'p99.9 us':>9} {'ok':>8}  errors"
    )
    lines = [f"mode        {levels[0].get('mode', '?')}", header, "-" * len(header)]
    for level in levels:
        tp, lat = level["throughput"], level["latency_us"]
        lines.append(
            f"{level['in_flight'] if closed else level['rate']:>10g} "
            f"{tp['req_per_s']:10.1f} {tp['samples_per_s']:10.1f} "
            + " ".join(f"{lat[key]:9.0f}" for key in ("p50", "p90", "p99", "p99.9"))
            + f" {level['ok']:8d}  {_errors(level)}"
        )
    return "\n".join(lines + error_lines(levels))


def first_errors(summaries: list[dict[str, Any]]) -> dict[str, str]:
    """The first message of each error code over one run or a sweep's levels."""
    found: dict[str, str] = {}
    for summary in summaries:
        for code, message in summary.get("error_messages", {}).items():
            found.setdefault(code, message)
    return found


def error_lines(summaries: list[dict[str, Any]]) -> list[str]:
    """``error       CODE: first message``, one line per code (none without errors), after
    a line for requests that failed after the measurement window, if any did."""
    late: Counter[str] = sum(
        (Counter(s.get("after_window", {}).get("errors", {})) for s in summaries), Counter()
    )
    lines = []
    if late:
        counts = ", ".join(f"{code} {n}" for code, n in late.items())
        lines.append(f"after       the window closed, {sum(late.values())} failed: {counts}")
    found = first_errors(summaries)
    return lines + [f"error       {code}: {message}" for code, message in found.items()]


def _load(summary: dict[str, Any]) -> str:
    if summary.get("mode") == "open":
        return f"rate {summary.get('rate')} req/s  seed {summary.get('seed')}"
    return f"in flight {summary.get('in_flight')}"


def _errors(summary: dict[str, Any]) -> str:
    errors: dict[str, int] = summary["errors"]
    if not errors:
        return "0"
    return ", ".join(f"{code} {n}" for code, n in errors.items())


def _label(row: dict[str, Any]) -> str:
    return f"{row['name']} ({row['unit']})"


def _rows(rows: list[dict[str, Any]], width: int) -> list[str]:
    return [
        f"{_label(row):{width}} {row['ipuserve']:12.1f} "
        f"{row['baseline']:12.1f} {row['ratio']:8.2f} {row['target']:>9}  "
        f"{'yes' if row['met'] else 'NO'}"
        for row in rows
    ]


def suite_table(results: dict[str, Any]) -> str:
    """The fabric suite: one row per comparison, medians and same-run ratios."""
    rows = results["comparisons"] + results.get("diagnostics", [])
    width = max([44, *(len(_label(row)) for row in rows)])  # every row's columns aligned
    header = (
        f"{'comparison':{width}} {'ipuserve':>12} {'baseline':>12} {'ratio':>8} {'target':>9}  ok"
    )
    lines = [header, "-" * len(header)]
    lines.extend(_rows(results["comparisons"], width))
    lines.append("")
    lines.append(f"medians of {results['runs']} runs; ratio = median of the same-run ratios")
    if results.get("diagnostics"):
        lines.append("")
        lines.append("diagnostics (the client's own cost: Client vs a bare protocol loop)")
        lines.extend(_rows(results["diagnostics"], width))
    if results.get("breakdown"):
        lines.append("")
        lines.extend(breakdown_lines(results["breakdown"]))
    return "\n".join(lines)


def breakdown_lines(stages: list[dict[str, Any]]) -> list[str]:
    """Where the gap to the relay goes: each layer added, at 1 and at N in flight."""
    header = (
        f"{'from the relay to the fabric':64} {'p50 us':>8} {'x relay':>8} "
        f"{'req/s':>9} {'of relay':>9}"
    )
    lines = [header, "-" * len(header)]
    for stage in stages:
        lines.append(
            f"{stage['name']:64} {stage['latency_p50_us']:8.0f} {stage['latency_vs_relay']:8.2f} "
            f"{stage['req_per_s']:9.0f} {stage['req_per_s_vs_relay']:9.2f}"
        )
    if all("cpu_us_per_request" in stage for stage in stages):
        lines.append("")
        lines.extend(cpu_lines(stages))
    return lines


def cpu_lines(stages: list[dict[str, Any]]) -> list[str]:
    """CPU per request in each process (relay/echo for the baseline), every thread counted."""
    cases = ("latency", "throughput")
    header = (
        f"{'CPU us per request: client, broker (relay), worker (echo), sum':64} "
        f"{'1 in flight':>27}   {'N in flight':>27}"
    )
    lines = [header, "-" * len(header)]
    for stage in stages:
        cells = []
        for case in cases:
            cpu = stage["cpu_us_per_request"][case]
            total = cpu["client"] + cpu["broker"] + cpu["worker"]
            cells.append(
                f"{cpu['client']:6.0f} {cpu['broker']:6.0f} {cpu['worker']:6.0f} {total:7.0f}"
            )
        lines.append(f"{stage['name']:64} {cells[0]:>27}   {cells[1]:>27}")
    return lines


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
