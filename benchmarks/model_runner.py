"""ModelRunner throughput and latency on the example MLP, against the ideal device rate.

    python benchmarks/model_runner.py [--device-ms 4] [--replicas 1 2] [--seconds 5]

For each replica count the runner is loaded with dynamic batching and fed by a
closed loop of requests (``--request-samples`` each) keeping
``--in-flight`` requests outstanding per replica. The simulated IPU is slowed
down (``IPUSERVE_SIM_TIME_SCALE``) so that one batch takes ``--device-ms`` of
simulated time: at the real Mk2's speed a batch takes ~18 us, far less than
numpy needs on the host, and the figure would measure numpy, not the runtime.

Reported per configuration, median of ``--repeat`` runs: samples/s and
requests/s, request latency p50/p90/p99, and the ratio to the ideal
``replicas x batch / device time`` -- how well the runtime keeps its simulated
IPUs busy. Not a test: figures depend on the machine; compare the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Result:
    replicas: int
    samples_per_s: float
    requests_per_s: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    ideal_samples_per_s: float

    @property
    def efficiency(self) -> float:
        return self.samples_per_s / self.ideal_samples_per_s


def main() -> int:
    args = _parse()
    os.environ.setdefault("IPUSERVE_SIM_LOCK_DIR", tempfile.mkdtemp(prefix="bench-locks-"))
    from ipuserve.runtime.popef import examples
    from ipuserve.runtime.simulator.cost import CostModel, ipu_spec, time_scale_for

    model = examples.build("mlp", batch_size=args.batch)
    main_program = model.executable.program(model.metadata.programFlow().main()[0])
    device_s_at_scale_1 = CostModel(ipu_spec(2), 1, 1.0).program_seconds(main_program)
    scale = time_scale_for(args.device_ms / 1e3, device_s_at_scale_1)
    os.environ["IPUSERVE_SIM_TIME_SCALE"] = repr(scale)
    print(
        f"MLP batch {args.batch}: {device_s_at_scale_1 * 1e6:.1f} us per batch on a Mk2; "
        f"IPUSERVE_SIM_TIME_SCALE={scale:.0f} makes it {args.device_ms} ms",
        file=sys.stderr,
    )
    rows = []
    for replicas in args.replicas:
        runs = [_one_run(model, replicas, args) for _ in range(args.repeat)]
        rows.append(_median(runs))
    _report(rows, args)
    return 0


def _one_run(model: Any, replicas: int, args: argparse.Namespace) -> Result:
    import ipuserve.runtime as model_runtime

    config = model_runtime.ModelRunnerConfig(
        replication_factor=replicas,
        batching_dim=0,
        flush_on_waiting_outputs=True,
        is_batch_size_timeout_enabled=True,
        batch_size_timeout_ns=int(args.batch_timeout_ms * 1e6),
        ring_buffer_size_multiplier=4,
    )
    data = np.random.default_rng(0).standard_normal((args.request_samples, 784)).astype(np.float32)
    with model_runtime.ModelRunner(model, config=config) as runner:
        latencies = _closed_loop(runner, replicas, data, args.in_flight, args.warmup)
        start = time.perf_counter()
        latencies = _closed_loop(runner, replicas, data, args.in_flight, args.seconds)
        elapsed = time.perf_counter() - start
    done = len(latencies)
    ms = np.array(latencies) * 1e3
    return Result(
        replicas,
        done * args.request_samples / elapsed,
        done / elapsed,
        *(float(np.percentile(ms, q)) for q in (50, 90, 99)),
        ideal_samples_per_s=replicas * args.batch / (args.device_ms / 1e3),
    )


def _closed_loop(
    runner: Any, replicas: int, data: np.ndarray, in_flight: int, seconds: float
) -> list[float]:
    """Keep ``in_flight`` requests outstanding per replica for ``seconds``; their latencies."""
    latencies: list[float] = []
    slots = threading.Semaphore(in_flight * replicas)
    idle = threading.Event()
    outstanding = [0]
    lock = threading.Lock()

    def finished(started: float) -> None:
        latencies.append(time.perf_counter() - started)
        with lock:
            outstanding[0] -= 1
            if outstanding[0] == 0:
                idle.set()
        slots.release()

    deadline = time.perf_counter() + seconds
    replica = 0
    while time.perf_counter() < deadline:
        slots.acquire()
        with lock:
            outstanding[0] += 1
            idle.clear()
        started = time.perf_counter()
        future = runner.executeAsync({"input": data}, replica_id=replica)
        future.add_done_callback(lambda _f, s=started: finished(s))
        replica = (replica + 1) % replicas
    idle.wait(60)
    return latencies


def _median(runs: list[Result]) -> Result:
    by_rate = sorted(runs, key=lambda r: r.samples_per_s)
    return by_rate[len(by_rate) // 2]


def _report(rows: list[Result], args: argparse.Namespace) -> None:
    if args.json:
        print(json.dumps([{**r.__dict__, "efficiency": r.efficiency} for r in rows], indent=2))
        return
    print(
        f"{'replicas':>8} {'samples/s':>10} {'req/s':>8} {'p50 ms':>7} {'p90 ms':>7} "
        f"{'p99 ms':>7} {'ideal/s':>8} {'of ideal':>8}"
    )
    for r in rows:
        print(
            f"{r.replicas:>8} {r.samples_per_s:>10.0f} {r.requests_per_s:>8.0f} "
            f"{r.p50_ms:>7.2f} {r.p90_ms:>7.2f} {r.p99_ms:>7.2f} "
            f"{r.ideal_samples_per_s:>8.0f} {r.efficiency:>8.1%}"
        )
    print(
        f"(median of {args.repeat} runs of {args.seconds} s; requests of "
        f"{args.request_samples} samples, {args.in_flight} in flight per replica)"
    )


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--device-ms", type=float, default=4.0, help="simulated device time per batch"
    )
    parser.add_argument("--batch", type=int, default=16, help="compiled batch of the MLP")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--request-samples", type=int, default=4)
    parser.add_argument("--in-flight", type=int, default=32, help="per replica")
    parser.add_argument("--batch-timeout-ms", type=float, default=2.0)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    return parser.parse_args()


if __name__ == "__main__":
    sys.exit(main())
