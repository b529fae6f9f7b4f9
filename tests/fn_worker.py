"""A worker process with a FunctionBackend: what the fabric's tests run as workers.

    python tests/fn_worker.py --broker tcp://127.0.0.1:PORT --model add [--delay-ms 20]

``--broker`` repeats (a worker serving several brokers); ``--metrics-port`` serves the
worker's credit metrics (capacity, jobs held, each broker's credit) and prints
``metrics on URL``.

Models (all with batching dimension 0):
  add    x, y: float32 [B, 8]  ->  z = x + 2 * y + 10 * (V - 1), V its ``--version``
  echo   x: uint8 [B, N]        ->  y = x          (N from --echo-bytes)
  fail   x: float32 [B, 8]     ->  raises ValueError (INFERENCE_FAILED)
``--delay-ms`` makes every job take at least that long; ``--fail-every K`` makes
every K-th job fail (INFERENCE_FAILED), for a run with a known share of failures.
``--curve-secret-key FILE --broker-public-key FILE``: a broker with keys, as the
real worker's options.
``--version V`` announces every model as version V (default 1; ``add`` answers told
apart per version), ``--default-version P`` pins the default its spec announces.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

import msgspec

from ipuserve.discovery import split_endpoints
from ipuserve.metrics import MetricsServer
from ipuserve.protocol import ModelSpec, TensorSpec
from ipuserve.security import client_keys
from ipuserve.worker.backend import FunctionBackend, ModelFn
from ipuserve.worker.cli import serve
from ipuserve.worker.config import WorkerConfig
from ipuserve.worker.metrics import CreditMetrics

WIDTH = 8
log = logging.getLogger("fn_worker")


def models(args: argparse.Namespace) -> dict[ModelSpec, ModelFn]:
    jobs, counting = itertools.count(1), threading.Lock()

    def delayed(fn: ModelFn) -> ModelFn:
        def run(inputs: Mapping[str, Any]) -> Mapping[str, Any]:
            if args.delay_ms:
                log.info("running a job for %s ms", args.delay_ms)
                time.sleep(args.delay_ms / 1000)
            with counting:
                job = next(jobs)
            if args.fail_every and job % args.fail_every == 0:
                raise ValueError(f"job {job} fails, as every {args.fail_every}th does")
            return fn(inputs)

        return run

    def fail(_inputs: Mapping[str, Any]) -> Mapping[str, Any]:
        raise ValueError("this model always fails")

    f32 = (TensorSpec("x", "float32", (4, WIDTH)), TensorSpec("y", "float32", (4, WIDTH)))
    shift = 10 * (int(args.version) - 1)
    table: dict[str, tuple[ModelSpec, ModelFn]] = {
        "add": (
            ModelSpec("add", f32, (TensorSpec("z", "float32", (4, WIDTH)),), 4, 0),
            lambda t: {"z": t["x"] + 2 * t["y"] + shift} if shift else {"z": t["x"] + 2 * t["y"]},
        ),
        "echo": (
            ModelSpec(
                "echo",
                (TensorSpec("x", "uint8", (1, args.echo_bytes)),),
                (TensorSpec("y", "uint8", (1, args.echo_bytes)),),
                1,
                0,
            ),
            lambda t: {"y": t["x"]},
        ),
        "fail": (ModelSpec("fail", f32[:1], f32[:1], 4, 0), fail),
    }
    versioned = {"version": args.version, "default_version": args.default_version}
    return {
        msgspec.structs.replace(table[name][0], **versioned): delayed(table[name][1])
        for name in args.model
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--broker", required=True, action="append")
    parser.add_argument("--model", action="append", choices=["add", "echo", "fail"])
    parser.add_argument("--worker-id", default=None)
    parser.add_argument("--credit", type=int, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--fail-every", type=int, default=0)
    parser.add_argument("--echo-bytes", type=int, default=1024)
    parser.add_argument("--heartbeat-ms", type=float, default=50.0)
    parser.add_argument("--handshake-ms", type=float, default=300.0)
    parser.add_argument("--reconnect-max-ms", type=float, default=200.0)
    parser.add_argument("--drain-timeout-ms", type=float, default=10_000.0)
    parser.add_argument("--metrics-port", type=int, default=None)
    parser.add_argument("--curve-secret-key", default=None)
    parser.add_argument("--broker-public-key", default=None)
    parser.add_argument("--version", default="1")
    parser.add_argument("--default-version", default=None)
    args = parser.parse_args()
    args.model = args.model or ["add"]
    logging.basicConfig(
        level="INFO", stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    backend = FunctionBackend(models(args), threads=args.threads, capacity=args.credit)
    options: dict[str, Any] = {} if args.worker_id is None else {"worker_id": args.worker_id}
    endpoints = split_endpoints(args.broker)
    config = WorkerConfig(
        broker=endpoints[0],
        credit=args.credit,
        heartbeat_ms=args.heartbeat_ms,
        handshake_timeout_ms=args.handshake_ms,
        reconnect_min_ms=20.0,
        reconnect_max_ms=args.reconnect_max_ms,
        drain_timeout_ms=args.drain_timeout_ms,
        keys=client_keys(args.curve_secret_key, args.broker_public_key),
        **options,
    )
    metrics = CreditMetrics(args.credit or backend.capacity())
    server = None
    if args.metrics_port is not None:
        server = MetricsServer(metrics.registry, "127.0.0.1", args.metrics_port)
        print(f"metrics on http://127.0.0.1:{server.port}/metrics", file=sys.stderr, flush=True)
    try:
        return serve(backend, config, endpoints, metrics)
    finally:
        if server is not None:
            server.close()


if __name__ == "__main__":
    sys.exit(main())
