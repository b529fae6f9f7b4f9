"""Client against AsyncClient: the two faces of the one client core, same fabric.

    python benchmarks/client_faces.py --runs 3 --seconds 3

Starts a broker and the runtime-free ``echo`` worker on loopback (64-byte requests),
then, alternating the faces within each run so that both see the same machine,
measures a closed loop at 1 in flight (p50, p99 latency) and at 64 in flight
(requests/s) through :class:`Client` (a caller's ``infer`` for one; done-callbacks
chaining ``infer_async`` for 64, as ``ipuserve bench`` does) and through
:class:`AsyncClient` (one coroutine awaiting ``infer``; 64 coroutines). Prints the
medians over the runs and AsyncClient / Client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np

from ipuserve.bench.processes import PYTHON, ChildProcesses, endpoint, wait_for_models
from ipuserve.client import AsyncClient, Client

INPUTS = {"input": np.zeros((1, 16), np.float32)}
MODEL = "echo"


def client_lone(client: Client, seconds: float) -> list[float]:
    latencies = []
    end = time.perf_counter() + seconds
    while (now := time.perf_counter()) < end:
        client.infer(MODEL, INPUTS)
        latencies.append(time.perf_counter() - now)
    return latencies


def client_many(client: Client, in_flight: int, seconds: float) -> float:
    done = 0
    lock = threading.Lock()
    stop_at = time.perf_counter() + seconds
    finished = threading.Event()
    running = [in_flight]

    def again(future: Future[Any]) -> None:
        nonlocal done
        future.result()
        with lock:
            done += 1
        if time.perf_counter() < stop_at:
            client.infer_async(MODEL, INPUTS, copy=False).add_done_callback(again)
            return
        with lock:
            running[0] -= 1
            if not running[0]:
                finished.set()

    start = time.perf_counter()
    for _ in range(in_flight):
        client.infer_async(MODEL, INPUTS, copy=False).add_done_callback(again)
    finished.wait(seconds + 30)
    return done / (time.perf_counter() - start)


async def async_lone(client: AsyncClient, seconds: float) -> list[float]:
    latencies = []
    end = time.perf_counter() + seconds
    while (now := time.perf_counter()) < end:
        await client.infer(MODEL, INPUTS, copy=False)
        latencies.append(time.perf_counter() - now)
    return latencies


async def async_many(client: AsyncClient, in_flight: int, seconds: float) -> float:
    done = 0
    stop_at = time.perf_counter() + seconds

    async def loop() -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            await client.infer(MODEL, INPUTS, copy=False)
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(in_flight)))
    return done / (time.perf_counter() - start)


def figures(latencies: list[float]) -> dict[str, float]:
    us = np.array(latencies[len(latencies) // 10 :]) * 1e6  # the first 10 %: warm-up
    return {"p50_us": float(np.percentile(us, 50)), "p99_us": float(np.percentile(us, 99))}


def one_run(frontend: str, seconds: float, in_flight: int) -> dict[str, dict[str, float]]:
    """Each face's figures; CPU: this process's (every thread's) per request."""
    with Client(frontend, timeout=30) as client:
        client_many(client, in_flight, 0.5)  # warm
        cpu = time.process_time()
        latencies = client_lone(client, seconds)
        sync = figures(latencies)
        sync["cpu_us_lone"] = (time.process_time() - cpu) / len(latencies) * 1e6
        cpu = time.process_time()
        sync["req_per_s"] = client_many(client, in_flight, seconds)
        sync["cpu_us_many"] = (time.process_time() - cpu) / (sync["req_per_s"] * seconds) * 1e6

    async def run_async() -> dict[str, float]:
        async with AsyncClient(frontend, timeout=30) as client:
            await async_many(client, in_flight, 0.5)  # warm
            cpu = time.process_time()
            latencies = await async_lone(client, seconds)
            found = figures(latencies)
            found["cpu_us_lone"] = (time.process_time() - cpu) / len(latencies) * 1e6
            cpu = time.process_time()
            found["req_per_s"] = await async_many(client, in_flight, seconds)
            spent = time.process_time() - cpu
            found["cpu_us_many"] = spent / (found["req_per_s"] * seconds) * 1e6
            return found

    return {"Client": sync, "AsyncClient": asyncio.run(run_async())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--json", type=Path, help="write the per-run figures here")
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp, ChildProcesses(Path(tmp)) as procs:
        frontend, backend = endpoint(), endpoint()
        procs.start(
            "broker",
            [
                *PYTHON,
                "ipuserve",
                "broker",
                "--frontend",
                frontend,
                "--backend",
                backend,
                "--queue-limit",
                "100000",
            ],
        )
        procs.start("worker-echo", [*PYTHON, "ipuserve.worker.echo", "--broker", backend])
        wait_for_models(procs, frontend, {MODEL: 1})
        for index in range(args.runs):
            runs.append(one_run(frontend, args.seconds, args.in_flight))
            print(f"run {index + 1}: {json.dumps(runs[-1])}")
    print(f"\nmedians of {args.runs} runs, {args.in_flight} in flight for req/s")
    keys = ("p50_us", "p99_us", "cpu_us_lone", "req_per_s", "cpu_us_many")
    print(f"{'':14}" + "".join(f"{k:>12}" for k in keys))
    medians = {}
    for face in ("Client", "AsyncClient"):
        medians[face] = {key: statistics.median(run[face][key] for run in runs) for key in keys}
        print(f"{face:14}" + "".join(f"{medians[face][k]:12.0f}" for k in keys))
    ratio = {k: medians["AsyncClient"][k] / medians["Client"][k] for k in medians["Client"]}
    print(f"{'Async/Client':14}" + "".join(f"{ratio[k]:12.2f}" for k in keys))
    if args.json is not None:
        args.json.write_text(json.dumps({"runs": runs, "medians": medians}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
