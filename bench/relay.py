"""The baseline the fabric is measured against: a minimal pyzmq relay of the same shape.

``client DEALER -> relay ROUTER/ROUTER (one thread) -> DEALER echo worker``, with no
validation, no queues, no runtime: what ZeroMQ from Python can do at best on this
machine. ``ipuserve bench --suite fabric`` runs it in the same run as the real
broker and workers, so each figure has a same-run ratio.

Frames on the relay are opaque. The only convention is the echo worker's
``READY`` frame on connect (so the relay learns its identity) and, on the raw
client, a first frame holding the send time, which the echo returns untouched so
the client needs no table of outstanding requests.

Run as processes::

    python -m ipuserve.bench.relay relay --frontend tcp://127.0.0.1:5600 --backend tcp://127.0.0.1:5601
    python -m ipuserve.bench.relay echo --backend tcp://127.0.0.1:5601
"""

from __future__ import annotations

import argparse
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import zmq

READY = b"READY"
_STAMP = struct.Struct("<q")


def _socket(context: zmq.Context[zmq.Socket[bytes]], kind: int) -> zmq.Socket[bytes]:
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    return sock


def run_relay(frontend: str, backend: str, *, copy: bool = False) -> None:
    """Forward client requests round-robin to echo workers and replies back; never returns.

    ``copy=False`` forwards the received frames themselves (no copy of the
    payload in Python), which is what makes the relay fast for large tensors.
    """
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    front = _socket(context, zmq.ROUTER)
    back = _socket(context, zmq.ROUTER)
    front.bind(frontend)
    back.bind(backend)
    workers: list[bytes] = []
    turn = 0
    poller = zmq.Poller()
    poller.register(back, zmq.POLLIN)
    while True:
        for sock, _ in poller.poll():
            if sock is back:
                if _from_worker(back, front, workers, copy) and len(workers) == 1:
                    poller.register(front, zmq.POLLIN)  # requests wait until a worker exists
            else:
                turn = (turn + 1) % len(workers)
                msg = front.recv_multipart(0, copy)
                back.send_multipart([workers[turn], *msg], copy=copy)


def _from_worker(
    back: zmq.Socket[bytes], front: zmq.Socket[bytes], workers: list[bytes], copy: bool
) -> bool:
    """Forward one reply, or register a worker's READY; True when a worker was added."""
    msg = back.recv_multipart(0, copy)
    if len(msg) == 2:
        workers.append(_bytes(msg[0]))
        return True
    front.send_multipart(msg[1:], copy=copy)
    return False


def _bytes(frame: bytes | zmq.Frame) -> bytes:
    return frame if isinstance(frame, bytes) else frame.bytes


def run_echo(backend: str, *, copy: bool = False) -> None:
    """Return every request to its sender unchanged; never returns."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = _socket(context, zmq.DEALER)
    sock.connect(backend)
    sock.send(READY)
    while True:
        sock.send_multipart(sock.recv_multipart(0, copy), copy=copy)


@dataclass(frozen=True)
class RawResult:
    """What :func:`raw_closed_loop` measured: per-request latencies and the wall time."""

    latencies_ns: np.ndarray
    elapsed_s: float
    payload_bytes: int

    @property
    def requests(self) -> int:
        return int(self.latencies_ns.size)


def raw_closed_loop(
    address: str,
    *,
    payload_bytes: int,
    in_flight: int,
    requests: int | None = None,
    duration_s: float | None = None,
    warmup: int = 0,
    copy: bool | None = None,
) -> RawResult:
    """Keep ``in_flight`` echo requests outstanding on one DEALER; time them.

    Stops after ``requests`` measured requests or ``duration_s`` measured seconds,
    whichever comes first (the first ``warmup`` replies are not measured). One
    thread, blocking receives, no futures: the ceiling a Python client can reach.
    The send time rides in the first frame and comes back in the reply.
    """
    if requests is None and duration_s is None:
        raise ValueError("give requests or duration_s")
    if copy is None:
        copy = payload_bytes < 64 * 1024
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = _socket(context, zmq.DEALER)
    sock.connect(address)
    payload = np.random.default_rng(0).integers(0, 255, payload_bytes, dtype=np.uint8).tobytes()
    limit = _Limit(requests, duration_s, warmup)
    try:
        return _drive(sock, payload, in_flight, limit, copy)
    finally:
        sock.close(linger=0)


@dataclass(frozen=True)
class _Limit:
    requests: int | None
    duration_s: float | None
    warmup: int

    def reached(self, counted: int, start: float) -> bool:
        """Stop sending? ``counted`` = measured replies + requests still outstanding."""
        if self.requests is not None and counted >= self.requests:
            return True
        return self.duration_s is not None and time.perf_counter() - start >= self.duration_s


def _drive(
    sock: zmq.Socket[bytes], payload: bytes, in_flight: int, limit: _Limit, copy: bool
) -> RawResult:
    def send() -> None:
        sock.send_multipart([_STAMP.pack(time.perf_counter_ns()), payload], copy=copy)

    for _ in range(in_flight):
        send()
    latencies: list[int] = []
    outstanding, replies, stopped = in_flight, 0, False
    start = end = time.perf_counter()
    while outstanding:
        stamp = _bytes(sock.recv_multipart(0, copy)[0])
        end = time.perf_counter()
        outstanding, replies = outstanding - 1, replies + 1
        if replies > limit.warmup:
            latencies.append(time.perf_counter_ns() - _STAMP.unpack(stamp)[0])
        elif replies == limit.warmup:
            start = end
        stopped = stopped or limit.reached(len(latencies) + outstanding, start)
        if not stopped:
            send()
            outstanding += 1
    return RawResult(np.asarray(latencies, dtype=np.int64), end - start, len(payload))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ipuserve.bench.relay", description=__doc__)
    sub = parser.add_subparsers(dest="role", required=True)
    relay = sub.add_parser("relay", help="one-thread ROUTER/ROUTER relay")
    relay.add_argument("--frontend", required=True)
    relay.add_argument("--backend", required=True)
    echo = sub.add_parser("echo", help="DEALER echo worker")
    echo.add_argument("--backend", required=True)
    for p in (relay, echo):
        p.add_argument("--copy", action="store_true", help="copy frames (faster when small)")
    args = parser.parse_args(argv)
    try:
        if args.role == "relay":
            run_relay(args.frontend, args.backend, copy=args.copy)
        else:
            run_echo(args.backend, copy=args.copy)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
