"""A worker with no runtime behind it, for measuring the fabric alone.

    python -m ipuserve.worker.echo --broker tcp://127.0.0.1:5556 [--elements 16]

Serves one model, ``echo`` (``input`` float32 ``[B, elements]`` -> ``output``, the
same values), through the same WorkerNode socket loop as ``ipuserve worker``, but
with the ModelRunner replaced by a function run inline on the socket thread. The
fabric suite measures it beside the ``noop`` ModelRunner worker: the difference is
what the runtime (its device threads, queues and batching) costs per request, and
the difference to the bare pyzmq relay is what the broker and worker loops cost.
Not a product command: nothing but the benchmarks starts it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from ipuserve.protocol import ModelSpec, TensorSpec
from ipuserve.worker.backend import FunctionBackend
from ipuserve.worker.cli import serve
from ipuserve.worker.config import WorkerConfig

MODEL = "echo"


def echo_spec(elements: int) -> ModelSpec:
    tensor = (1, elements)
    return ModelSpec(
        MODEL,
        (TensorSpec("input", "float32", tensor),),
        (TensorSpec("output", "float32", tensor),),
        batch_size=1,
        batching_dim=0,
    )


def echo(inputs: Mapping[str, Any]) -> Mapping[str, Any]:
    return {"output": inputs["input"]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ipuserve.worker.echo", description=__doc__)
    parser.add_argument("--broker", required=True, help="the broker's backend endpoint")
    parser.add_argument("--elements", type=int, default=16, help="float32 elements per sample")
    parser.add_argument("--credit", type=int, default=256, help="jobs held at once")
    args = parser.parse_args(argv)
    backend = FunctionBackend({echo_spec(args.elements): echo}, threads=0, capacity=args.credit)
    return serve(backend, WorkerConfig(broker=args.broker))


if __name__ == "__main__":
    sys.exit(main())
