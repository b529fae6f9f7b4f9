"""The wire's cost on the request path: encode and decode of the one-row hot messages.

    python benchmarks/wire.py [--header-formats]

Times ``encode()`` and ``decode()`` of a one-row REQUEST, JOBS, RESULTS and REPLY
(one float32[1, 64] tensor, a 16-byte id, three timing entries) as microseconds per
call: the median of 7 runs, each the best of 3 repeats of N calls. Only the public API
is used, so the same file measures another checkout (``cd OTHER && python
/path/to/benchmarks/wire.py``): docs/benchmarks.md, "The declared wire (issue 21)".
``--header-formats`` also times msgspec decoding and validating the declared REQUEST
header and a 32-row JOBS header from JSON and from MessagePack (the spike that chose
JSON).
"""

from __future__ import annotations

import argparse
import statistics
import timeit
from collections.abc import Callable
from typing import Any

import numpy as np

from ipuserve import protocol as wire


def per_call_us(call: Callable[[], Any], number: int = 20_000) -> float:
    runs = [min(timeit.repeat(call, number=number, repeat=3)) / number for _ in range(7)]
    return statistics.median(runs) * 1e6


def hot_messages() -> dict[str, Any]:
    x = wire.Tensors.of({"x": np.ones((1, 64), np.float32)})
    timing = {"device_us": 812.5, "worker_queue_us": 30.25, "broker_queue_us": 11.0}
    return {
        "REQUEST": wire.Request(b"r" * 16, "mlp", x, 30000.0),
        "JOBS": wire.Jobs((wire.Job(b"j" * 16, "mlp", x, 29000.5, 1),)),
        "RESULTS": wire.Results((wire.Result(b"j" * 16, x, dict(timing)),)),
        "REPLY": wire.Reply(b"r" * 16, x, dict(timing)),
    }


def received(frames: list[Any]) -> list[bytes]:
    """Frames as a receiver holds them: bytes (a socket's zmq.Frame reads the same)."""
    return [bytes(frame) if isinstance(frame, bytes) else np.asarray(frame).tobytes()
            for frame in frames]  # fmt: skip


def header_formats() -> None:
    import msgspec

    from ipuserve.protocol.batches import JobsHeader
    from ipuserve.protocol.client_messages import RequestHeader

    spec = [{"name": "x", "dtype": "float32", "shape": [1, 64]}]
    request = {"model": "mlp", "tensors": spec, "timeout_ms": 30000.0}
    rows = [[f"{i:032x}", 0, 29000.5, 1, 1] for i in range(32)]
    jobs = {"specs": [{"model": "mlp", "tensors": spec}], "jobs": rows}
    for name, kind, value in (("REQUEST", RequestHeader, request), ("JOBS x32", JobsHeader, jobs)):
        for fmt, module in (("JSON", msgspec.json), ("MessagePack", msgspec.msgpack)):
            raw, decoder = module.encode(value), module.Decoder(kind)
            decoder.decode(raw)
            took = per_call_us(lambda d=decoder, r=raw: d.decode(r), 2000)
            print(f"{name:9s} {fmt:12s} {took:6.2f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--header-formats", action="store_true")
    args = parser.parse_args()
    print(f"protocol version {wire.PROTOCOL_VERSION}: us per call (median of 7)")
    print(f"{'message':8s} {'encode':>7s} {'decode':>7s}")
    for name, message in hot_messages().items():
        frames = received(message.encode())
        assert type(wire.decode(frames)) is type(message)
        encode, decode = per_call_us(message.encode), per_call_us(lambda f=frames: wire.decode(f))
        print(f"{name:8s} {encode:7.2f} {decode:7.2f}")
    if args.header_formats:
        header_formats()


if __name__ == "__main__":
    main()
