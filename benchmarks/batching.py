"""Batching policies compared: the example MLP, one-sample requests, closed loops.

    python benchmarks/batching.py --runs 3 --json batching.json

Starts a broker and one worker per setting on loopback -- ``eager``, ``fixed`` 1, 2
and 4 ms, and the default (``adaptive``), each serving the example MLP
(``ipuserve model example mlp``) under its own name at ``--device-ms`` per batch of
16 -- then, in each run, drives every setting at 1, 4, 16 and 64 one-sample requests
in flight (closed loop), settings interleaved so that the machine's drift hits them
alike. Each request travels alone, as independent clients' requests do
(``--client-groups``: as one process's Client sends them, those leaving together as
one group, which the fabric handles as one job; batches are then full at every
setting, and the policy has little to decide).

Prints per level and setting the medians over runs of req/s, % of ideal (``batch /
device time``), p50 and p99, and, from each worker's metrics, the real samples per
device run and the time a batch took to form: the policy's decisions, which the
machine's noise blurs less than it blurs the rates. Then, for the default at each
level, its throughput against the best other setting's and its p50 against the
lowest, as the median of the same-run ratios, beside the targets (>= 0.95 and <=
1.1; at 16 in flight >= 70% of ideal).

The device time per batch is the model's cost estimate (``ipuserve model inspect
--json``) times ``IPUSERVE_SIM_TIME_SCALE``, chosen as the fabric suite chooses it.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from ipuserve.bench.bench import bench
from ipuserve.bench.loadgen import LoadConfig
from ipuserve.bench.processes import PYTHON, ChildProcesses, endpoint, wait_for_models
from ipuserve.bench.suite import ONE_BLAS_THREAD, SuiteConfig, time_scale_for, write_models
from ipuserve.client.client import Client
from ipuserve.client.config import ClientConfig

LEVELS = (1, 4, 16, 64)
#: name -> worker options; the default policy is the one with no options
SETTINGS = {
    "eager": ("--batch-policy", "eager"),
    "fixed-1ms": ("--batch-policy", "fixed", "--batch-timeout-ms", "1"),
    "fixed-2ms": ("--batch-policy", "fixed", "--batch-timeout-ms", "2"),
    "fixed-4ms": ("--batch-policy", "fixed", "--batch-timeout-ms", "4"),
    "default": (),
}
DEFAULT = "default"
TARGET_THROUGHPUT = 0.95  # of the best other setting's
TARGET_P50 = 1.1  # times the lowest other setting's
TARGET_IDEAL_AT_16 = 0.70


def start(procs: ChildProcesses, mlp: Path, scale: float) -> tuple[str, dict[str, str]]:
    """A broker and one worker per setting; the broker's frontend and each worker's
    metrics URL."""
    front, back = endpoint(), endpoint()
    procs.start("broker", [*PYTHON, "ipuserve", "broker", "--frontend", front, "--backend", back])
    children = {}
    for name, options in SETTINGS.items():
        argv = [*PYTHON, "ipuserve", "worker", "--broker", back, "--model", str(mlp)]
        argv += ["--metrics-port", "0", "--metrics-host", "127.0.0.1"]
        children[name] = procs.start(
            f"worker-{name}",
            [*argv, "--name", f"mlp-{name}", *options],
            env={"IPUSERVE_SIM_TIME_SCALE": f"{scale:.6g}"},
        )
    wait_for_models(procs, front, {f"mlp-{name}": 1 for name in SETTINGS})
    urls = {}
    for name, child in children.items():
        found = re.search(r"metrics on (http://\S+/metrics)", child.log.read_text())
        if found is None:
            raise RuntimeError(f"worker {name} did not say where its metrics are: {child.log}")
        urls[name] = found[1]
    return front, urls


def batches(url: str) -> tuple[float, float, float]:
    """(batches, real samples, seconds spent forming them) so far, from a worker's metrics."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line[:1] not in "#":  # a sample: every model version's, summed per name
            key, value = line.rsplit(" ", 1)
            name = key.split("{", 1)[0]
            values[name] = values.get(name, 0.0) + float(value)
    p = "ipuserve_worker_batch_"
    return values[p + "samples_count"], values[p + "samples_sum"], values[p + "wait_seconds_sum"]


def one_run(
    frontend: str, urls: dict[str, str], args: argparse.Namespace, log: Any
) -> dict[str, Any]:
    """Every level, every setting; {setting: {level: bench summary + the worker's batches}}."""
    run: dict[str, Any] = {name: {} for name in SETTINGS}
    seconds, warm = args.seconds, args.warmup_s
    # By default each request travels alone, as independent clients' requests do; the
    # Client would otherwise send those that leave together as one group (one job).
    config = ClientConfig() if args.client_groups else ClientConfig(batch_payload_bytes=0)
    with Client(frontend, timeout=60, config=config) as client:
        for level in LEVELS:
            for name in SETTINGS:
                load = LoadConfig(warmup_s=warm, duration_s=seconds, in_flight=level)
                before = batches(urls[name])
                summary = bench(client, f"mlp-{name}", load, batch=1)
                after = batches(urls[name])
                runs, samples, waited = (b - a for a, b in zip(before, after, strict=True))
                summary["batches"] = {
                    "samples_per_run": round(samples / max(runs, 1), 2),
                    "forming_ms": round(1e3 * waited / max(runs, 1), 3),
                }
                run[name][str(level)] = summary
            log(f"  {level} in flight done")
    return run


def summary(runs: list[dict[str, Any]], ideal: float) -> dict[str, Any]:
    """Medians over runs per setting and level, and the default against the others."""
    table: dict[str, Any] = {}
    for name in SETTINGS:
        table[name] = {}
        for level in map(str, LEVELS):
            cells = [run[name][level] for run in runs]
            rate = statistics.median(c["throughput"]["req_per_s"] for c in cells)
            table[name][level] = {
                "req_per_s": round(rate, 1),
                "of_ideal": round(rate / ideal, 3),
                "p50_us": statistics.median(c["latency_us"]["p50"] for c in cells),
                "p99_us": statistics.median(c["latency_us"]["p99"] for c in cells),
                "errors": sum(sum(c["errors"].values()) for c in cells),
                "samples_per_run": statistics.median(
                    c["batches"]["samples_per_run"] for c in cells
                ),
                "forming_ms": statistics.median(c["batches"]["forming_ms"] for c in cells),
            }
    return {"table": table, "default_vs_best": [_versus(runs, level, ideal) for level in LEVELS]}


def _versus(runs: list[dict[str, Any]], level: int, ideal: float) -> dict[str, Any]:
    """The default at ``level`` against the best other setting of the same run."""
    key, others = str(level), [n for n in SETTINGS if n != DEFAULT]
    thr, lat = [], []
    for run in runs:
        rate = {n: run[n][key]["throughput"]["req_per_s"] for n in SETTINGS}
        p50 = {n: run[n][key]["latency_us"]["p50"] for n in SETTINGS}
        thr.append(rate[DEFAULT] / max(max(rate[n] for n in others), 1e-9))
        lat.append(p50[DEFAULT] / max(min(p50[n] for n in others), 1e-9))
    of_ideal = statistics.median(r[DEFAULT][key]["throughput"]["req_per_s"] for r in runs) / ideal
    row = {
        "in_flight": level,
        "throughput_vs_best": round(statistics.median(thr), 3),
        "p50_vs_best": round(statistics.median(lat), 3),
        "of_ideal": round(of_ideal, 3),
        "per_run": {"throughput": [round(t, 3) for t in thr], "p50": [round(p, 3) for p in lat]},
    }
    row["met"] = (
        row["throughput_vs_best"] >= TARGET_THROUGHPUT
        and row["p50_vs_best"] <= TARGET_P50
        and (level != 16 or of_ideal >= TARGET_IDEAL_AT_16)
    )
    return row


def render(result: dict[str, Any]) -> str:
    lines = [
        f"MLP, {result['device_ms']:.2f} ms per batch of {result['batch']} "
        f"(ideal {result['ideal_req_per_s']:.0f} req/s), one-sample requests"
        f"{' (client groups)' if result['client_groups'] else ''}, closed loop; "
        f"medians of {result['runs']} run(s) of {result['seconds']} s",
        "",
        f"{'in flight':>9}  {'setting':<10} {'req/s':>8} {'% ideal':>8} {'p50 ms':>8} "
        f"{'p99 ms':>8} {'samples/run':>11} {'forming ms':>10}",
    ]
    for level in map(str, LEVELS):
        for name in SETTINGS:
            c = result["table"][name][level]
            errors = f"  ({c['errors']} errors)" if c["errors"] else ""
            lines.append(
                f"{level:>9}  {name:<10} {c['req_per_s']:>8.0f} {100 * c['of_ideal']:>7.1f}% "
                f"{c['p50_us'] / 1e3:>8.2f} {c['p99_us'] / 1e3:>8.2f} "
                f"{c['samples_per_run']:>11.1f} {c['forming_ms']:>10.2f}{errors}"
            )
        lines.append("")
    lines.append(
        f"default vs the best other setting of the same run (median of runs): throughput >= "
        f"{TARGET_THROUGHPUT}, p50 <= {TARGET_P50}x; at 16 in flight >= "
        f"{TARGET_IDEAL_AT_16:.0%} of ideal"
    )
    for row in result["default_vs_best"]:
        lines.append(
            f"{row['in_flight']:>9}  throughput x{row['throughput_vs_best']:.3f}  "
            f"p50 x{row['p50_vs_best']:.3f}  {100 * row['of_ideal']:.1f}% of ideal  "
            f"{'met' if row['met'] else 'MISSED'}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0, help="measured, per case")
    parser.add_argument("--warmup-s", type=float, default=0.5, help="per case")
    parser.add_argument("--device-ms", type=float, default=2.0, help="per batch of 16")
    parser.add_argument(
        "--client-groups",
        action="store_true",
        help="let the Client send requests that leave together as one group (one job), "
        "as one process's requests travel; by default each travels alone, as independent "
        "clients' do",
    )
    parser.add_argument("--json", type=Path, help="write the full results here")
    args = parser.parse_args()

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="ipuserve-batching-") as tmp:
        workdir = Path(tmp)
        models = write_models(workdir, SuiteConfig())
        scale = time_scale_for(args.device_ms / 1e3, models)
        env = {**ONE_BLAS_THREAD, "IPUSERVE_SIM_LOCK_DIR": str(workdir / "locks"),
               "IPUSERVE_SIM_IPUS": "16"}  # fmt: skip
        with ChildProcesses(workdir, env) as procs:
            frontend, urls = start(procs, models["mlp"], scale)
            runs = []
            for index in range(args.runs):
                log(f"run {index + 1} of {args.runs}")
                runs.append(one_run(frontend, urls, args, log))
            procs.check()
    batch = int(models["mlp_batch"])
    ideal = batch / (args.device_ms / 1e3)
    result = {
        "device_ms": args.device_ms,
        "batch": batch,
        "ideal_req_per_s": ideal,
        "runs": args.runs,
        "seconds": args.seconds,
        "client_groups": args.client_groups,
        "settings": {name: list(options) for name, options in SETTINGS.items()},
        **summary(runs, ideal),
        "raw": runs,
    }
    print(render(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
