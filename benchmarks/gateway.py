"""The front door against the fabric's own clients, in one run.

    python benchmarks/gateway.py --runs 3 --json gateway.json

Starts a broker, a worker serving the example ``mlp`` (its device time scaled so a
batch of 16 takes ``--mlp-device-ms``, 2 ms by default), a worker serving ``noop``
with no device time, and an ``ipuserve gateway`` (HTTP and gRPC) on loopback. Then,
in each run, one-sample requests in a closed loop at each ``--in-flight`` level
through each path, the paths in a new order every run:

* ``client``: :class:`ipuserve.client.Client` (``infer_async``, callbacks re-submit);
* ``async``: :class:`ipuserve.client.AsyncClient` (one task per request in flight);
* ``http``: Triton's ``tritonclient.http.aio`` with binary tensor data, through the gateway;
* ``grpc``: Triton's ``tritonclient.grpc.aio`` (raw contents), through the gateway;
* ``raw``: one pre-built binary HTTP/1.1 infer request written again and again on
  ``level`` keep-alive connections (asyncio streams), through the gateway: what the
  gateway costs with a client that costs almost nothing, to tell the gateway's share
  of the ``http`` path from ``tritonclient``'s.

``noop`` runs at 1 and 64 in flight only: it measures the front door alone. Prints
per model, level and path the medians over runs of throughput (and for ``mlp``, the
share of the ideal: one replica x batch / device time), p50 and p99 latency, and,
for the gateway's paths, the gateway's CPU per request. Every path also gets each
process's CPU per request (load generator, gateway, broker, workers) and their sum:
with the machine's cores that bounds the throughput any path can reach here
(``cores x 1e6 / total us``), and the same bound without the gateway's share says
whether a target is this machine's limit or the gateway's. The issue's targets
(issue 20): at 64 in flight on the MLP, HTTP and gRPC >= 0.9 of Client's
throughput; at 1 in flight on noop, the gateway adds <= 200 us to Client's p50;
AsyncClient within 10 % of Client at every level. Every figure comes from this
one machine and run: compare paths, not machines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gateway_paths import (  # benchmarks/, beside this script
    drive_async,
    drive_client,
    drive_grpc,
    drive_http,
    drive_raw,
    one_sample,
)

from ipuserve.bench.processes import (
    PYTHON,
    ChildProcesses,
    endpoint,
    free_port,
    process_cpu_seconds,
    wait_for_models,
)
from ipuserve.client import Client
from ipuserve.runtime.simulator.cost import time_scale_for

PATHS = ("client", "async", "http", "grpc", "raw")
GATEWAY_PATHS = ("http", "grpc", "raw")


def start(procs: ChildProcesses, work: Path, args: Any) -> tuple[str, str, str, float]:
    """Broker, workers and gateway; the frontend, HTTP and gRPC addresses, and the
    MLP's ideal samples/s."""
    mlp, noop = work / "mlp.popef", work / "noop.popef"
    model = [*PYTHON, "ipuserve", "model"]
    subprocess.run([*model, "example", "mlp", str(mlp)], check=True, capture_output=True)
    subprocess.run([*model, "example", "noop", str(noop)], check=True, capture_output=True)
    inspected = json.loads(
        subprocess.run(
            [*model, "inspect", "--json", str(mlp)], check=True, capture_output=True, text=True
        ).stdout
    )
    [main] = [p for p in inspected["programs"] if p["phase"] == "main"]
    scale = time_scale_for(args.mlp_device_ms / 1e3, float(main["estimated_seconds"]))
    ideal = int(inspected["batch_size"]) / (args.mlp_device_ms / 1e3)
    front, back = endpoint(), endpoint()
    procs.start("broker", [*PYTHON, "ipuserve", "broker", "--frontend", front, "--backend", back])
    worker = [*PYTHON, "ipuserve", "worker", "--broker", back]
    procs.start(
        "worker-mlp",
        [*worker, "--model", str(mlp)],
        env={"IPUSERVE_SIM_TIME_SCALE": f"{scale:.6g}"},
    )
    procs.start(
        "worker-noop", [*worker, "--model", str(noop)], env={"IPUSERVE_SIM_TIME_SCALE": "0"}
    )
    wait_for_models(procs, front, {"mlp": 1, "noop": 1})
    http, grpc = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    procs.start(
        "gateway",
        [*PYTHON, "ipuserve", "gateway", "--broker", front, "--http", http, "--grpc", grpc]
        + (["--processes", str(args.gateway_processes)] if args.gateway_processes > 1 else []),
    )
    wait_ready(procs, http)
    return front, http, grpc, ideal


def wait_ready(procs: ChildProcesses, http: str, timeout_s: float = 60.0) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        procs.check()
        try:
            with urllib.request.urlopen(f"http://{http}/v2/health/ready", timeout=2) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)  # polling a process's start-up, not synchronising a test
    raise RuntimeError(f"the gateway at {http} was not ready within {timeout_s} s")


def tree_cpu_seconds(pids: list[int]) -> float:
    """CPU of these processes and every process under them (a supervisor's children).
    Not for this process: everything the bench starts is under it."""
    total, seen, todo = 0.0, set(), list(pids)
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += process_cpu_seconds(pid) or 0.0
        for task in Path(f"/proc/{pid}/task").glob("*/children"):
            try:
                todo.extend(int(child) for child in task.read_text().split())
            except OSError:
                pass
    return total


def measure(
    path: str,
    addresses: tuple[str, str, str],
    client: Client,
    model: str,
    inputs: dict[str, Any],
    expected: dict[str, Any],
    level: int,
    roles: dict[str, list[int]],
    args: Any,
) -> dict[str, float]:
    """One path at one level; with each role's CPU per request (``roles``: pids)."""
    front, http, grpc = addresses

    def cpu(role: str) -> float:
        if role == "loadgen":  # this process alone, its threads included
            return process_cpu_seconds(os.getpid()) or 0.0
        return tree_cpu_seconds(roles[role])

    cpu_before = {role: cpu(role) for role in roles}
    if path == "client":
        window = drive_client(client, model, inputs, level, args)
    elif path == "async":
        window = asyncio.run(drive_async(front, model, inputs, level, args))
    elif path == "http":
        window = asyncio.run(drive_http(http, model, inputs, list(expected), level, args))
    elif path == "raw":
        window = asyncio.run(drive_raw(http, model, inputs, expected, level, args))
    else:
        window = asyncio.run(drive_grpc(grpc, model, inputs, level, args))
    figures = window.figures()
    # each role's CPU over the whole drive (warm-up and drain too), scaled to the
    # window's share of it, over the requests answered in the window
    answered = max(figures["req_per_s"] * args.seconds, 1.0)
    share = args.seconds / (args.seconds + args.warmup_s)
    total = 0.0
    for role in roles:
        if role == "gateway" and path not in GATEWAY_PATHS:
            continue  # idle while the fabric's own clients run
        cpu_us = (cpu(role) - cpu_before[role]) * share / answered * 1e6
        figures[f"{role}_cpu_us_per_req"] = round(cpu_us, 1)
        total += cpu_us
    figures["total_cpu_us_per_req"] = round(total, 1)
    return figures


def cases(args: Any) -> list[tuple[str, int]]:
    mlp = [("mlp", level) for level in args.in_flight]
    return [*mlp, ("noop", 1), ("noop", 64)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--in-flight", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64]
    )
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--warmup-s", type=float, default=1.0)
    parser.add_argument("--mlp-device-ms", type=float, default=2.0)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument(
        "--gateway-processes",
        type=int,
        default=1,
        help="the gateway's --processes (several processes on the doors' ports)",
    )
    parser.add_argument(
        "--paths", type=lambda s: tuple(s.split(",")), default=PATHS, help="of " + ",".join(PATHS)
    )
    args = parser.parse_args()

    runs: list[dict[str, dict[str, float]]] = []
    with (
        tempfile.TemporaryDirectory(prefix="ipuserve-gateway-bench-") as tmp,
        ChildProcesses(Path(tmp)) as procs,
    ):
        front, http, grpc, ideal = start(procs, Path(tmp), args)
        pids = {c.name: c.popen.pid for c in procs.children}
        roles = {
            "loadgen": [],  # this process: see measure
            "gateway": [pids["gateway"]],
            "broker": [pids["broker"]],
            "workers": [pids["worker-mlp"], pids["worker-noop"]],
        }
        with Client(front, timeout=30.0) as client:
            specs = {m.spec.name: m.spec for m in client.models()}
            inputs = {name: one_sample(spec) for name, spec in specs.items()}
            expected = {name: dict(client.infer(name, inputs[name])) for name in specs}
            for run in range(args.runs):
                paths = args.paths
                order = paths[run % len(paths) :] + paths[: run % len(paths)]
                figures: dict[str, dict[str, float]] = {}
                for model, level in cases(args):
                    for path in order:
                        key = f"{model}/{level}/{path}"
                        figures[key] = measure(
                            path,
                            (front, http, grpc),
                            client,
                            model,
                            inputs[model],
                            expected[model],
                            level,
                            roles,
                            args,
                        )
                        procs.check()
                        print(f"run {run + 1} {key}: {figures[key]}", file=sys.stderr)
                runs.append(figures)
    median = {
        key: {
            name: round(statistics.median(r[key][name] for r in runs), 1) for name in runs[0][key]
        }
        for key in runs[0]
    }
    result: dict[str, Any] = {
        "cores": os.cpu_count(),
        "mlp_device_ms": args.mlp_device_ms,
        "mlp_ideal_samples_per_s": ideal,
        "gateway_processes": args.gateway_processes,
        "runs": runs,
        "median": median,
    }
    print(report(median, ideal, args))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


ROLES = ("loadgen", "gateway", "broker", "workers")


def report(median: dict[str, dict[str, float]], ideal: float, args: Any) -> str:
    cores = os.cpu_count() or 1
    lines = [
        f"{cores} cores; medians of {args.runs} runs of {args.seconds:g} s; "
        f"mlp ideal {ideal:,.0f} samples/s ({args.mlp_device_ms:g} ms per batch); "
        f"gateway processes {args.gateway_processes}",
        f"{'model':6} {'in flight':>9} {'path':7} {'req/s':>9} {'% ideal':>8} {'vs Client':>9}"
        f" {'p50 us':>9} {'p99 us':>9} {'errors':>6} | CPU us/req: {'loadgen':>7} {'gateway':>7}"
        f" {'broker':>6} {'workers':>7} {'total':>6} | {cores}-core bound req/s:"
        f" {'all':>7} {'w/o gw':>7}",
    ]
    for key, figures in median.items():
        model, level, path = key.split("/")
        base = median.get(f"{model}/{level}/client")
        ratio = None if base is None else figures["req_per_s"] / max(base["req_per_s"], 1e-9)
        versus = "" if ratio is None else f"{ratio:.2f}"
        share = f"{figures['req_per_s'] / ideal:8.0%}" if model == "mlp" else f"{'':8}"
        cpu = {role: figures.get(f"{role}_cpu_us_per_req") for role in ROLES}
        total = figures.get("total_cpu_us_per_req", 0.0)
        bound = cores * 1e6 / max(total, 1e-9)
        bound_without = cores * 1e6 / max(total - (cpu["gateway"] or 0.0), 1e-9)
        cells = " ".join(
            f"{'' if cpu[role] is None else f'{cpu[role]:,.0f}':>{width}}"
            for role, width in zip(ROLES, (7, 7, 6, 7), strict=True)
        )
        lines.append(
            f"{model:6} {level:>9} {path:7} {figures['req_per_s']:>9,.0f} {share}"
            f" {versus:>9}"
            f" {figures['p50_us']:>9,.0f} {figures['p99_us']:>9,.0f} {figures['errors']:>6.0f}"
            f" |             {cells} {total:>6,.0f} |"
            f" {' ' * 19}{bound:>7,.0f} {bound_without:>7,.0f}"
        )
    noop_client = median.get("noop/1/client")
    for path in GATEWAY_PATHS:
        through = median.get(f"noop/1/{path}")
        if noop_client and through:
            added = through["p50_us"] - noop_client["p50_us"]
            lines.append(
                f"noop at 1 in flight: the {path} path through the gateway adds {added:,.0f} us"
                " to Client's p50 (target <= 200)"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
