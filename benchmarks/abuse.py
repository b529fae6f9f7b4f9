"""What each abusive client costs the gateway and the honest clients beside it: the
front-door abuse suite (tests/gateway/abuse) run ``--runs`` times with its reports on,
summarised per case.

    python benchmarks/abuse.py --runs 3

Per case: the gateway's peak RSS above where it was when the case began (the median of
the runs and the largest), the bound the suite asserts (3x the tensor bytes the request
declares + 32 MiB, at most 256 MiB; for a gRPC message that passed the token check,
plus the three copies grpcio holds before the gateway sees it), the honest ready
probe's p99 and longest wait, the honest infer client's p99, longest wait and failures
(all runs together). The suite
asserts the memory and the answers; the waits are measured here, not asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

MIB = 1024 * 1024


def run_suite(report: Path, extra: list[str]) -> int:
    env = {**os.environ, "IPUSERVE_ABUSE_REPORT": str(report)}
    argv = [sys.executable, "-m", "pytest", "tests/gateway/abuse", "-q", "-p", "no:cacheprovider"]
    return subprocess.run([*argv, *extra], env=env, check=False).returncode


def table(rows: list[dict[str, Any]]) -> str:
    cases: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        cases[row["case"]].append(row)
    lines = [
        "| case | RSS rise MiB (median, max) | bound MiB | probe p99 / max ms "
        "| infer p99 / max ms | honest failed / calls |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for case, runs in cases.items():
        rises = [r["rss_rise_bytes"] / MIB for r in runs]
        first = runs[0]
        bound = min(3 * first["declared_bytes"] + first["transport_bytes"] + 32 * MIB, 256 * MIB)
        bound /= MIB
        probe_p99 = max(r["probe"]["p99_ms"] for r in runs)
        probe_max = max(r["probe"]["max_ms"] for r in runs)
        infer_p99 = max(r["infer"]["p99_ms"] for r in runs)
        infer_max = max(r["infer"]["max_ms"] for r in runs)
        failed = sum(r["probe"]["failed"] + r["infer"]["failed"] for r in runs)
        calls = sum(r[k]["answered"] + r[k]["failed"] for r in runs for k in ("probe", "infer"))
        lines.append(
            f"| {case} | {statistics.median(rises):.1f}, {max(rises):.1f} | {bound:.0f} "
            f"| {probe_p99:.1f} / {probe_max:.1f} | {infer_p99:.1f} / {infer_max:.1f} "
            f"| {failed} / {calls} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (e.g. -k grpc)")
    args = parser.parse_args()
    status = 0
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "abuse.jsonl"
        for _ in range(args.runs):
            status |= run_suite(report, args.pytest_args)
        rows = [json.loads(line) for line in report.read_text().splitlines()]
    print(f"\n{args.runs} run(s) of tests/gateway/abuse on {os.cpu_count()} CPUs\n")
    print(table(rows))
    return status


if __name__ == "__main__":
    sys.exit(main())
