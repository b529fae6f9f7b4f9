"""A bare protocol loop through the fabric, to tell the client's cost from the fabric's.

One DEALER, one thread, blocking receives, ``in_flight`` requests outstanding,
frames built and parsed by :mod:`ipuserve.protocol` — the same messages as
:class:`~ipuserve.client.client.Client` sends, without its I/O thread, futures,
liveness or deadlines. Client figures close to these mean the fabric (broker,
worker, runtime) sets the pace; a gap is the client's own overhead.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import zmq

from ipuserve import protocol as wire
from ipuserve.bench.relay import RawResult


def protocol_closed_loop(
    address: str,
    model: str,
    inputs: Mapping[str, Any],
    *,
    in_flight: int,
    duration_s: float,
    warmup: int = 0,
) -> RawResult:
    """Closed loop of REQUEST/REPLY for ``duration_s`` measured seconds (errors raise)."""
    context: zmq.Context[Any] = zmq.Context.instance()
    sock: zmq.Socket[Any] = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        return _drive(sock, model, wire.Tensors.of(inputs), in_flight, duration_s, warmup)
    finally:
        sock.close(linger=0)


def _drive(
    sock: zmq.Socket[Any],
    model: str,
    tensors: wire.Tensors,
    in_flight: int,
    duration_s: float,
    warmup: int,
) -> RawResult:
    ids = itertools.count()
    sent_at: dict[bytes, int] = {}

    def send() -> None:
        request_id = next(ids).to_bytes(8, "little")
        sent_at[request_id] = time.perf_counter_ns()
        frames = wire.Request(request_id, model, tensors, 60_000.0).encode()
        sock.send_multipart(frames, copy=False)  # type: ignore[arg-type]

    for _ in range(in_flight):
        send()
    latencies: list[int] = []
    replies, stopped = 0, False
    start = end = time.perf_counter()
    while sent_at:
        reply = wire.decode(sock.recv_multipart(copy=False))
        if isinstance(reply, wire.ErrorReply):
            raise reply.exception()
        assert isinstance(reply, wire.Reply)
        end, replies = time.perf_counter(), replies + 1
        began = sent_at.pop(reply.request_id)
        if replies > warmup:
            latencies.append(time.perf_counter_ns() - began)
        elif replies == warmup:
            start = end
        stopped = stopped or end - start >= duration_s
        if not stopped:
            send()
    payload = tensors.nbytes
    return RawResult(np.asarray(latencies, dtype=np.int64), end - start, payload)
