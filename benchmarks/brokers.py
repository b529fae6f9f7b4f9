"""One broker against two: does a second broker carry more of the same load?

    python benchmarks/brokers.py --runs 3 --json brokers.json

Starts two brokers and ``--workers`` workers on loopback, every worker registered with
both (``--broker B1 --broker B2``), each serving the ``noop`` example with no device
time (``IPUSERVE_SIM_TIME_SCALE=0``), so that the brokers, not the workers, are the
limit. Then, in each run, ``--clients`` client processes (``ipuserve bench``: a real
Client, closed loop, ``--in-flight`` one-sample requests each) drive

* **one**: every client process through broker 1 (broker 2 idles; the workers' credit
  follows the demand to broker 1), and
* **two**: half of the client processes through each broker,

one after the other in the same run, alternating which goes first. Prints per case
the medians over runs of the summed req/s and the per-run ratio two / one, with the
machine's cores: on a machine with fewer cores than the brokers, workers and clients
need, the ratio shows the cores, not the brokers (target >= 1.7 on a machine with
room for them, issue 17).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ipuserve.bench.processes import (
    PYTHON,
    ChildProcesses,
    endpoint,
    process_cpu_seconds,
    wait_for_models,
)

TARGET_RATIO = 1.7


def start(
    procs: ChildProcesses, model: Path, workers: int, credit: int | None
) -> tuple[list[str], list[str]]:
    """Two brokers and the workers; their frontends and backends."""
    fronts, backs = [endpoint(), endpoint()], [endpoint(), endpoint()]
    for i, (front, back) in enumerate(zip(fronts, backs, strict=True)):
        argv = [*PYTHON, "ipuserve", "broker", "--frontend", front, "--backend", back]
        procs.start(f"broker{i + 1}", argv)
    for i in range(workers):
        argv = [*PYTHON, "ipuserve", "worker", "--model", str(model)]
        argv += [part for back in backs for part in ("--broker", back)]
        argv += ["--credit", str(credit)] if credit else []
        procs.start(f"worker{i + 1}", argv, env={"IPUSERVE_SIM_TIME_SCALE": "0"})
    for front in fronts:
        wait_for_models(procs, front, {"noop": workers})
    return fronts, backs


def drive(fronts: list[str], clients: int, args: argparse.Namespace) -> float:
    """``clients`` bench processes at once, spread over ``fronts``; their summed req/s."""
    procs = []
    for i in range(clients):
        argv = [*PYTHON, "ipuserve", "bench", "--broker", fronts[i % len(fronts)]]
        argv += ["--model", "noop", "--batch", "1", "--concurrency", str(args.in_flight)]
        argv += ["--duration-s", str(args.seconds), "--warmup-s", str(args.warmup_s), "--json"]
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    total = 0.0
    for proc in procs:
        out, err = proc.communicate(timeout=args.seconds * 10 + 120)
        if proc.returncode != 0:
            raise RuntimeError(f"a bench client failed ({proc.returncode}): {err.decode()[-2000:]}")
        report = json.loads(out)
        levels = report.get("sweep", [report])
        total += sum(level["throughput"]["req_per_s"] for level in levels)
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--clients", type=int, default=4, help="client processes")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument(
        "--credit", type=int, default=None, help="each worker's capacity [default: its own]"
    )
    parser.add_argument("--in-flight", type=int, default=64, help="per client process")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--warmup-s", type=float, default=1.0)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()

    cores = os.cpu_count() or 1
    runs: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="ipuserve-brokers-") as tmp:
        work = Path(tmp)
        model = work / "noop.popef"
        subprocess.run(
            [*PYTHON, "ipuserve", "model", "example", "noop", str(model)],
            check=True,
            capture_output=True,
        )
        with ChildProcesses(work) as procs:
            fronts, _backs = start(procs, model, args.workers, args.credit)
            for run in range(args.runs):
                cases = ["one", "two"] if run % 2 == 0 else ["two", "one"]
                figures: dict[str, float] = {}
                brokers = [c for c in procs.children if c.name.startswith("broker")]
                for case in cases:
                    used = fronts[:1] if case == "one" else fronts
                    started = time.monotonic()
                    cpu = [process_cpu_seconds(b.popen.pid) or 0.0 for b in brokers]
                    figures[case] = drive(used, args.clients, args)
                    procs.check()
                    wall = time.monotonic() - started
                    busy = [
                        ((process_cpu_seconds(b.popen.pid) or 0.0) - before) / wall
                        for b, before in zip(brokers, cpu, strict=True)
                    ]
                    figures[f"{case}_busiest_broker_cores"] = max(busy)
                    print(
                        f"run {run + 1} {case}: {figures[case]:,.0f} req/s"
                        f" ({time.monotonic() - started:.0f} s)",
                        file=sys.stderr,
                    )
                figures["ratio"] = figures["two"] / figures["one"]
                runs.append(figures)
    result: dict[str, Any] = {
        "cores": cores,
        "clients": args.clients,
        "workers": args.workers,
        "worker_credit": args.credit,
        "in_flight_per_client": args.in_flight,
        "runs": runs,
        "median": {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]},
        "target_ratio": TARGET_RATIO,
    }
    median = result["median"]
    print(
        f"{cores} cores, {args.clients} client processes x {args.in_flight} in flight, "
        f"{args.workers} workers (noop, no device time), medians of {args.runs} runs:\n"
        f"  one broker:  {median['one']:>10,.0f} req/s\n"
        f"  two brokers: {median['two']:>10,.0f} req/s\n"
        f"  two / one:   {median['ratio']:>10.2f}  (target >= {TARGET_RATIO})\n"
        f"  busiest broker's CPU, in cores (incl. warm-up and start): one"
        f" {median['one_busiest_broker_cores']:.2f}, two {median['two_busiest_broker_cores']:.2f}"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
