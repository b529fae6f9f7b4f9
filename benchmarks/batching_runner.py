"""Batching policies on a bare ModelRunner: closed loops with a known return time.

    python benchmarks/batching_runner.py --runs 3 --return-ms 0.5,1.5

The fabric's own CPU cost per request blurs ``benchmarks/batching.py`` on a small
machine; here the policy alone is measured. N simulated clients each hold one
one-sample request; an answered client sends again ``--return-ms`` later (what the
client, the broker and the wire would take). The example MLP runs at
``--device-ms`` per batch of 16, each setting on a fresh ModelRunner with the
worker's configuration (dynamic batching, ``flush_on_waiting_outputs``). Prints,
per return time, level and setting, the medians over runs of req/s, % of ideal, p50
and the real samples per device run.
"""

from __future__ import annotations

import argparse
import heapq
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

os.environ.setdefault("IPUSERVE_SIM_LOCK_DIR", tempfile.mkdtemp(prefix="ipuserve-batching-"))
for _blas in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_blas, "1")

import numpy as np  # noqa: E402

from ipuserve.runtime import ModelRunner, ModelRunnerConfig  # noqa: E402
from ipuserve.runtime.model_runner.batch_policy import BatchPolicy, make_policy  # noqa: E402
from ipuserve.runtime.popef import examples  # noqa: E402
from ipuserve.runtime.popef.dump import describe  # noqa: E402
from ipuserve.runtime.popef.types import Model  # noqa: E402
from ipuserve.runtime.simulator.cost import time_scale_for  # noqa: E402

LEVELS = (1, 4, 16, 64)
SETTINGS = {
    "eager": ("eager", None),
    "fixed-1ms": ("fixed", 1e-3),
    "fixed-2ms": ("fixed", 2e-3),
    "fixed-4ms": ("fixed", 4e-3),
    "adaptive": ("adaptive", None),
}


class Loop:
    """N clients in a closed loop on ``runner``; answers come back ``return_s`` later."""

    def __init__(self, runner: ModelRunner, clients: int, return_s: float) -> None:
        self.runner, self.clients, self.return_s = runner, clients, return_s
        self.input = {"input": np.ones((1, 784), np.float32)}
        self.latencies: list[float] = []
        self._due: list[float] = []
        self._wake = threading.Condition()
        self._stop = False

    def run(self, seconds: float, warmup_s: float) -> tuple[int, float, list[float]]:
        """(answers, elapsed seconds, latencies) over the measured window."""
        returner = threading.Thread(target=self._return, daemon=True)
        returner.start()
        with self._wake:
            self._due += [time.monotonic()] * self.clients
            self._wake.notify()
        time.sleep(warmup_s)  # the load runs; nothing here waits on it
        start, self.latencies = time.monotonic(), []
        time.sleep(seconds)
        answered, elapsed = len(self.latencies), time.monotonic() - start
        latencies = list(self.latencies)
        with self._wake:
            self._stop = True
            self._wake.notify()
        returner.join()
        return answered, elapsed, latencies

    def _return(self) -> None:
        while True:
            with self._wake:
                while not self._stop and (not self._due or self._due[0] > time.monotonic()):
                    wait = self._due[0] - time.monotonic() if self._due else None
                    self._wake.wait(wait)
                if self._stop:
                    return
                heapq.heappop(self._due)
            self._send()

    def _send(self) -> None:
        sent = time.monotonic()
        future = self.runner.executeAsync(self.input)
        future.add_done_callback(lambda _f: self._answered(sent))

    def _answered(self, sent: float) -> None:
        now = time.monotonic()
        self.latencies.append(now - sent)
        with self._wake:
            heapq.heappush(self._due, now + self.return_s)
            self._wake.notify()


def one_case(
    model: Model, setting: str, clients: int, return_s: float, args: argparse.Namespace
) -> dict[str, float]:
    name, limit = SETTINGS[setting]
    sizes: list[int] = []

    def policy(_replica: int) -> BatchPolicy:
        return make_policy(name, limit, lambda samples, _waited: sizes.append(samples))

    config = ModelRunnerConfig(
        batching_dim=0,
        is_batch_size_timeout_enabled=True,
        flush_on_waiting_outputs=True,
        ring_buffer_size_multiplier=8,
        check_package_hash=False,
    )
    runner = ModelRunner(model, config=config, batch_policy=policy)
    try:
        loop = Loop(runner, clients, return_s)
        answered, elapsed, latencies = loop.run(args.seconds, args.warmup_s)
    finally:
        runner.close()
    return {
        "req_per_s": answered / elapsed,
        "p50_ms": 1e3 * float(np.median(latencies)) if latencies else 0.0,
        "samples_per_run": float(np.mean(sizes)) if sizes else 0.0,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--warmup-s", type=float, default=0.3)
    parser.add_argument("--device-ms", type=float, default=2.0)
    parser.add_argument("--return-ms", default="0.5,1.5", help="comma-separated")
    args = parser.parse_args()
    model = examples.build("mlp")
    [main_row] = [p for p in describe(model)["programs"] if p["phase"] == "main"]
    scale = time_scale_for(args.device_ms / 1e3, main_row["estimated_seconds"])
    os.environ["IPUSERVE_SIM_TIME_SCALE"] = str(scale)
    batch = model.metadata.batchSize()
    ideal = batch / (args.device_ms / 1e3)
    print(f"ModelRunner, MLP {args.device_ms} ms per batch of {batch} (ideal {ideal:.0f} "
          f"req/s); medians of {args.runs} run(s) of {args.seconds} s")  # fmt: skip
    for return_ms in (float(r) for r in args.return_ms.split(",")):
        print(f"\nanswers return after {return_ms} ms")
        print(f"{'clients':>7}  {'setting':<10} {'req/s':>7} {'% ideal':>8} {'p50 ms':>7} "
              f"{'samples/run':>11}")  # fmt: skip
        for clients in LEVELS:
            for setting in SETTINGS:
                cases = [
                    one_case(model, setting, clients, return_ms / 1e3, args)
                    for _ in range(args.runs)
                ]
                med: dict[str, Any] = {k: statistics.median(c[k] for c in cases) for k in cases[0]}
                print(f"{clients:>7}  {setting:<10} {med['req_per_s']:>7.0f} "
                      f"{100 * med['req_per_s'] / ideal:>7.1f}% {med['p50_ms']:>7.2f} "
                      f"{med['samples_per_run']:>11.1f}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
