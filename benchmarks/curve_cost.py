"""What CurveZMQ costs: the same fabric with and without keys, measured in one run.

    python benchmarks/curve_cost.py --runs 3 [--json curve.json]

Starts two stacks on loopback -- a plaintext broker, and a broker with keys
(``--curve-secret-key``, allow-lists of one client and one worker key) -- each with a
``noop`` worker (16 float32 elements, no simulated device time) and a ``noop4m``
worker (4 MiB tensors), the workers of the second stack with worker keys. Then, in
each run, measures on both stacks back to back, alternating: p50 and p99 at one
request in flight, requests/s at 64 in flight (small requests) and MB/s (in + out)
at 4 in flight with 4 MiB tensors -- the fabric suite's cases -- and reports the
medians and the median of the same-run ratios (CURVE over plaintext), since these
machines vary more from run to run than a ratio does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ipuserve.bench.bench import bench
from ipuserve.bench.loadgen import LoadConfig
from ipuserve.bench.processes import PYTHON, ChildProcesses, endpoint
from ipuserve.bench.suite import ONE_BLAS_THREAD
from ipuserve.client.client import Client
from ipuserve.errors import DeadlineExceeded
from ipuserve.security import generate_keypair

CASES = {  # name -> (model, in flight, figure)
    "latency": ("noop", 1, "p50"),
    "throughput": ("noop", 64, "req_per_s"),
    "goodput": ("noop4m", 4, "mb_per_s"),
}
LARGE_ELEMENTS = 1 << 20  # 4 MiB of float32


def write_models(workdir: Path) -> dict[str, Path]:
    paths = {"noop": workdir / "noop.popef", "noop4m": workdir / "noop4m.popef"}
    for name, elements in (("noop", 16), ("noop4m", LARGE_ELEMENTS)):
        argv = [*PYTHON, "ipuserve", "model", "example", "noop", str(paths[name])]
        subprocess.run([*argv, "--elements", str(elements)], check=True, capture_output=True)
    return paths


def write_keys(workdir: Path) -> dict[str, Path]:
    """A broker pair, and one client and one worker key in their allow-list folders."""
    keys = workdir / "keys"
    found: dict[str, Path] = {}
    for role in ("broker", "client", "worker"):
        folder = keys / role
        folder.mkdir(parents=True)
        pair = generate_keypair(role, folder)
        found[f"{role}_public"], found[f"{role}_secret"] = pair.public, pair.secret
        found[f"{role}_dir"] = folder
    return found


def start_stack(
    procs: ChildProcesses, name: str, models: dict[str, Path], keys: dict[str, Path] | None
) -> str:
    """A broker and a worker per model; the broker's frontend."""
    front, back = endpoint(), endpoint()
    broker = [*PYTHON, "ipuserve", "broker", "--frontend", front, "--backend", back]
    worker_keys: list[str] = []
    if keys is not None:
        broker += ["--curve-secret-key", str(keys["broker_secret"]),
                   "--client-keys", str(keys["client_dir"]),
                   "--worker-keys", str(keys["worker_dir"])]  # fmt: skip
        worker_keys = ["--curve-secret-key", str(keys["worker_secret"]),
                       "--broker-public-key", str(keys["broker_public"])]  # fmt: skip
    procs.start(f"broker-{name}", broker)
    for model, path in models.items():
        argv = [*PYTHON, "ipuserve", "worker", "--broker", back, "--model", str(path)]
        procs.start(f"worker-{name}-{model}", [*argv, "--name", model, *worker_keys])
    return front


def client_for(front: str, keys: dict[str, Path] | None) -> Client:
    if keys is None:
        return Client(front, timeout=60)
    return Client(
        front,
        timeout=60,
        curve_secret_key=str(keys["client_secret"]),
        broker_public_key=str(keys["broker_public"]),
    )


def wait_registered(
    procs: ChildProcesses, client: Client, models: list[str], timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        procs.check()
        try:
            listed = {info.spec.name for info in client.models(timeout=2.0) if info.workers}
        except DeadlineExceeded:
            listed = set()
        if set(models) <= listed:
            return
        if time.monotonic() > deadline:
            raise DeadlineExceeded(f"workers did not register in {timeout_s} s: {listed}")
        time.sleep(0.2)  # polling processes we do not control; nothing to wait on


def measure(client: Client, case: str, seconds: float, warm: float) -> float:
    model, in_flight, figure = CASES[case]
    load = LoadConfig(warmup_s=warm, duration_s=seconds, in_flight=in_flight)
    summary = bench(client, model, load)
    if figure == "p50":
        return float(summary["latency_us"]["p50"])
    return float(summary["throughput"][figure])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0, help="measured, per case")
    parser.add_argument("--warmup-s", type=float, default=1.0, help="per case")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ipuserve-curve-") as tmp:
        workdir = Path(tmp)
        models = write_models(workdir)
        keys = write_keys(workdir)
        env = {**ONE_BLAS_THREAD, "IPUSERVE_SIM_LOCK_DIR": str(workdir / "locks")}
        runs: list[dict[str, dict[str, float]]] = []
        with ChildProcesses(workdir, env) as procs:
            stacks = {
                "plaintext": (start_stack(procs, "plain", models, None), None),
                "curve": (start_stack(procs, "curve", models, keys), keys),
            }
            clients = {name: client_for(front, k) for name, (front, k) in stacks.items()}
            try:
                for client in clients.values():
                    wait_registered(procs, client, list(models), 120.0)
                for index in range(args.runs):
                    run: dict[str, dict[str, float]] = {name: {} for name in stacks}
                    for case in CASES:
                        for name, client in clients.items():
                            run[name][case] = measure(client, case, args.seconds, args.warmup_s)
                    runs.append(run)
                    print(f"run {index + 1} of {args.runs} done", file=sys.stderr)
            finally:
                for client in clients.values():
                    client.close()
    result = report(runs)
    if args.json is not None:
        args.json.write_text(json.dumps({"runs": runs, "summary": result}, indent=2))
    return 0


def report(runs: list[dict[str, dict[str, float]]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    print(f"{'case':<34}{'plaintext':>12}{'curve':>12}{'curve / plain':>15}  per run")
    for case, (model, in_flight, figure) in CASES.items():
        plain = [run["plaintext"][case] for run in runs]
        curve = [run["curve"][case] for run in runs]
        ratios = [c / p for c, p in zip(curve, plain, strict=True)]
        label = f"{model}, {in_flight} in flight: {figure}"
        result[case] = {
            "plaintext": statistics.median(plain),
            "curve": statistics.median(curve),
            "ratio": statistics.median(ratios),
            "ratios": [round(r, 3) for r in ratios],
        }
        row = result[case]
        per_run = ", ".join(f"{r:.2f}" for r in ratios)
        print(f"{label:<34}{row['plaintext']:>12.1f}{row['curve']:>12.1f}"
              f"{row['ratio']:>15.3f}  {per_run}")  # fmt: skip
    print(f"medians of {len(runs)} run(s); p50 in us, throughput in req/s, goodput in MB/s")
    return result


if __name__ == "__main__":
    sys.exit(main())
