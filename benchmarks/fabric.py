"""Run the fabric suite and print the figures docs/benchmarks.md quotes.

    python benchmarks/fabric.py --runs 5 --json out.json --markdown

The same as ``ipuserve bench --suite fabric`` plus a Markdown table (``--markdown``)
ready to paste into docs/benchmarks.md. Starts everything itself on loopback
(relay pairs, a broker, workers on example models) and stops it at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ipuserve.bench.report import suite_table
from ipuserve.bench.suite import SuiteConfig, run_suite


def markdown(results: dict[str, Any]) -> str:
    """The comparisons as a Markdown table: medians, the same-run ratio, the target."""
    lines = [
        "| comparison | ipuserve | baseline | ratio (same run) | target | met |",
        "|---|---:|---:|---:|---|---|",
    ]
    for row in results["comparisons"]:
        per_run = ", ".join(f"{r['ratio']:.2f}" for r in row["per_run"])
        lines.append(
            f"| {row['name']} ({row['unit']}) | {row['ipuserve']:.1f} | {row['baseline']:.1f} "
            f"| **{row['ratio']:.2f}** ({per_run}) | {row['target']} | "
            f"{'yes' if row['met'] else 'no'} |"
        )
    lines += [
        "",
        "| from the relay to the fabric | p50 µs (1 in flight) | x relay "
        "| req/s (64 in flight) | of relay |",
        "|---|---:|---:|---:|---:|",
    ]
    for stage in results["breakdown"]:
        lines.append(
            f"| {stage['name']} | {stage['latency_p50_us']:.0f} | {stage['latency_vs_relay']:.2f} "
            f"| {stage['req_per_s']:.0f} | {stage['req_per_s_vs_relay']:.2f} |"
        )
    lines += [
        "",
        "| CPU µs per request: client / broker (relay) / worker (echo) = sum "
        "| 1 in flight | 64 in flight |",
        "|---|---:|---:|",
    ]
    for stage in results["breakdown"]:
        cells = []
        for case in ("latency", "throughput"):
            cpu = stage["cpu_us_per_request"][case]
            total = cpu["client"] + cpu["broker"] + cpu["worker"]
            parts = " / ".join(f"{cpu[role]:.0f}" for role in ("client", "broker", "worker"))
            cells.append(f"{parts} = {total:.0f}")
        lines.append(f"| {stage['name']} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--mlp-workers", type=int, default=2)
    parser.add_argument("--mlp-device-ms", type=float, default=5.0)
    parser.add_argument("--json", type=Path, help="write the full results here")
    parser.add_argument("--markdown", action="store_true", help="also print a Markdown table")
    args = parser.parse_args()
    config = SuiteConfig(
        runs=args.runs,
        quick=args.quick,
        mlp_workers=args.mlp_workers,
        mlp_device_ms=args.mlp_device_ms,
    )
    results = run_suite(config, log=lambda line: print(line, file=sys.stderr))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(suite_table(results))
    if args.markdown:
        print()
        print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
