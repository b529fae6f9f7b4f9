"""Latency against throughput for small requests: ipuserve beside the pyzmq relay.

    python benchmarks/curves.py --levels 1,2,4,8,16,32,64 --seconds 3 \\
        --plot docs/img/noop-curve.svg --markdown

The fabric suite (benchmarks/fabric.py) compares two points, 1 and 64 in flight.
This sweeps the whole closed-loop range on both stacks, each level measured on
ipuserve (the ``Client`` against a broker and a ``noop`` worker) and then on the
relay baseline (DEALER -> one-thread ROUTER/ROUTER relay -> DEALER echo) back to
back, so each ratio compares figures taken moments apart. It prints a table (and a
Markdown one with ``--markdown``) and writes the curve as SVG with ``--plot``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ipuserve.bench.bench import bench
from ipuserve.bench.loadgen import LoadConfig
from ipuserve.bench.processes import PYTHON, ChildProcesses, endpoint, wait_for_models
from ipuserve.bench.relay import raw_closed_loop
from ipuserve.bench.svgplot import COLOURS, Axis, Series, line_chart
from ipuserve.client.client import Client
from ipuserve.latency import latency_us

ELEMENTS = 16  # float32: 64-byte requests, as in the fabric suite


def sweep(levels: list[int], seconds: float, log: Any) -> list[dict[str, Any]]:
    """Start a relay pair, a broker and a noop worker; measure every level on both."""
    with (
        tempfile.TemporaryDirectory(prefix="ipuserve-curves-") as tmp,
        ChildProcesses(Path(tmp)) as procs,
    ):
        model = Path(tmp) / "noop.popef"
        argv = [*PYTHON, "ipuserve", "model", "example", "noop", str(model)]
        subprocess.run([*argv, "--elements", str(ELEMENTS)], check=True, capture_output=True)
        relay_front, relay_back = endpoint(), endpoint()
        relay = [*PYTHON, "ipuserve.bench.relay"]
        procs.start("relay", [*relay, "relay", "--frontend", relay_front, "--backend", relay_back,
                              "--copy"])  # fmt: skip
        procs.start("echo", [*relay, "echo", "--backend", relay_back, "--copy"])
        front, back = endpoint(), endpoint()
        procs.start("broker", [*PYTHON, "ipuserve", "broker", "--frontend", front,
                               "--backend", back, "--queue-limit", "100000"])  # fmt: skip
        procs.start("worker", [*PYTHON, "ipuserve", "worker", "--broker", back,
                               "--model", str(model), "--name", "noop"])  # fmt: skip
        wait_for_models(procs, front, {"noop": 1})
        rows = []
        with Client(front, timeout=60) as client:
            for n in levels:
                load = LoadConfig(warmup_s=min(1.0, seconds / 2), duration_s=seconds, in_flight=n)
                ours = bench(client, "noop", load)
                raw = raw_closed_loop(
                    relay_front,
                    payload_bytes=4 * ELEMENTS,
                    in_flight=n,
                    duration_s=seconds,
                    warmup=max(20, 2 * n),
                )
                base = {
                    "req_per_s": round(raw.requests / max(raw.elapsed_s, 1e-9), 1),
                    "latency_us": latency_us(raw.latencies_ns),
                }
                rows.append({"in_flight": n, "ipuserve": ours, "relay": base})
                log(f"{n} in flight: {ours['throughput']['req_per_s']:.0f} vs "
                    f"{base['req_per_s']:.0f} req/s")  # fmt: skip
        procs.check()
    return rows


def table(rows: list[dict[str, Any]], markdown: bool) -> str:
    head = ["in flight", "ipuserve req/s", "p50 µs", "p99 µs", "relay req/s", "p50 µs",
            "p99 µs", "req/s of relay", "p50 x relay"]  # fmt: skip
    body = []
    for row in rows:
        ours, base = row["ipuserve"], row["relay"]
        rate, lat = ours["throughput"]["req_per_s"], ours["latency_us"]
        body.append([
            f"{row['in_flight']}", f"{rate:.0f}", f"{lat['p50']:.0f}", f"{lat['p99']:.0f}",
            f"{base['req_per_s']:.0f}", f"{base['latency_us']['p50']:.0f}",
            f"{base['latency_us']['p99']:.0f}", f"{rate / base['req_per_s']:.2f}",
            f"{lat['p50'] / base['latency_us']['p50']:.2f}",
        ])  # fmt: skip
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
        return "\n".join([*lines, *("| " + " | ".join(cells) + " |" for cells in body)])
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(head)]
    return "\n".join(
        "  ".join(cell.rjust(w) for cell, w in zip(cells, widths, strict=True))
        for cells in [head, *body]
    )


def plot(rows: list[dict[str, Any]]) -> str:
    labels = [str(row["in_flight"]) for row in rows]
    series = []
    stacks = (("ipuserve", "ipuserve"), ("relay", "pyzmq relay (baseline)"))
    for colour, (stack, name) in zip(COLOURS, stacks, strict=False):
        for key in ("p50", "p99"):
            points = [
                (
                    row[stack]["throughput"]["req_per_s"]
                    if stack == "ipuserve"
                    else row[stack]["req_per_s"],
                    row[stack]["latency_us"][key],
                )
                for row in rows
            ]
            series.append(Series(f"{name} {key}", points, labels, key == "p99", colour))
    return line_chart(
        series,
        title="noop, 64-byte requests: latency against throughput (points: requests in flight)",
        x=Axis("throughput (requests/s)"),
        y=Axis("latency (µs)", log=True),
        width=800,
        height=480,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1,2,4,8,16,32,64", help="requests in flight")
    parser.add_argument("--seconds", type=float, default=3.0, help="measured per level")
    parser.add_argument("--plot", type=Path, help="write the curve here (SVG)")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = parser.parse_args()
    levels = [int(level) for level in args.levels.split(",")]
    rows = sweep(levels, args.seconds, lambda line: print(line, file=sys.stderr))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    if args.plot is not None:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        args.plot.write_text(plot(rows))
    print(table(rows, args.markdown))


if __name__ == "__main__":
    main()
