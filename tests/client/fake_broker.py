"""A minimal broker stand-in for client tests: a real ROUTER socket speaking ipuserve.protocol.

It runs on its own thread, answers PING with its epoch, MODELS with a fixed list,
and hands every REQUEST to a ``handler`` that returns the reply message (or None
to stay silent); the requests of a REQUESTS batch go to the handler one by one,
and their replies out one by one (which a batching client must accept). Tests use
it where the real broker cannot be steered: a restart that loses requests, duplicate
replies, malformed frames, every error code.
"""

from __future__ import annotations

import threading
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import zmq

from ipuserve import protocol as wire
from ipuserve.errors import IpuserveError

#: What the fake broker lists as ADD's ``group_samples``: groups of up to 32 requests.
GROUP_SAMPLES = 64

Handler = Callable[[wire.Request], "list[wire.Frame] | wire.Message | None"]

ADD = wire.ModelSpec(
    "add",
    inputs=(wire.TensorSpec("a", "float32", (2, 3)), wire.TensorSpec("b", "float32", (2, 3))),
    outputs=(wire.TensorSpec("y", "float32", (2, 3)),),
    batch_size=2,
    batching_dim=0,
)


def add_handler(request: wire.Request) -> wire.Message:
    """``y = a + b`` computed with numpy; timing as a worker would report it."""
    arrays = request.tensors.arrays()
    try:
        y = arrays["a"] + arrays["b"]
    except KeyError as exc:
        return wire.ErrorReply(request.request_id, "INVALID_INPUT", f"missing {exc}")
    timing = {"broker_queue_us": 5.0, "worker_queue_us": 7.0, "device_us": 11.0, "worker_us": 20.0}
    return wire.Reply(request.request_id, wire.Tensors.of({"y": y}), timing)


def answered_by(version: str) -> Handler:
    """:func:`add_handler`, its replies saying ``version`` answered."""

    def handler(request: wire.Request) -> wire.Message:
        reply = add_handler(request)
        assert isinstance(reply, wire.Reply)
        return wire.Reply(reply.request_id, reply.tensors, reply.timing, (), version)

    return handler


class FakeBroker:
    """A ROUTER on ``address`` (bound at start); :meth:`restart` rebinds with a new epoch."""

    def __init__(self, handler: Handler = add_handler, address: str | None = None) -> None:
        self.handler = handler
        self.address = address or ""
        self.epoch = uuid.uuid4().hex
        self.requests: list[wire.Request] = []
        self.pings = 0
        self.batches = 0  # REQUESTS messages received
        self.rows: list[wire.Request] = []  # REQUESTS rows as sent (a group is one row)
        self._outbox: deque[list[wire.Frame]] = deque()  # send_raw's, for the last client
        self._peer = b""
        self.duplicate_replies = 1  # how many times each reply is sent
        self.silent = False  # swallow everything, pings included (a hung broker)
        #: answers each REPOSITORY command (None: refused, as a broker before them does)
        self.repository: Callable[[wire.RepositoryCommand], wire.Message] | None = None
        self.commands: list[wire.RepositoryCommand] = []
        #: what MODELS lists as ADD's group_samples; None: it lists no model at all
        self.group_samples: int | None = GROUP_SAMPLES
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    def start(self) -> FakeBroker:
        self._stop.clear()
        self._ready.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(5)
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def restart(self) -> None:
        """Lose everything in flight and come back on the same address with a new epoch."""
        self.stop()
        self.epoch = uuid.uuid4().hex
        self.start()

    def blip(self) -> None:
        """Drop every connection and come back at once, remembering nothing sent on
        them (as a broken network path does); the epoch stays."""
        self.stop()
        self.start()

    def send_raw(self, frames: list[wire.Frame]) -> None:
        """Send ``frames`` to the last client heard from, from the broker's own thread."""
        self._outbox.append(frames)

    def _bind(self, context: zmq.Context[Any]) -> zmq.Socket[Any]:
        sock: zmq.Socket[Any] = context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if self.address:
            sock.bind(self.address)
        else:
            # Below the ephemeral range: while we are down for a restart, a client
            # reconnecting to an ephemeral port can connect to itself (TCP
            # simultaneous open) and hold the port, and the rebind then fails.
            port = sock.bind_to_random_port("tcp://127.0.0.1", 20_000, 32_000)
            self.address = f"tcp://127.0.0.1:{port}"
        return sock

    def _run(self) -> None:
        # A private context: term() returns once the listener is really closed, so a
        # restart can bind the same port at once (socket close alone is asynchronous).
        context: zmq.Context[Any] = zmq.Context()
        sock = self._bind(context)
        self._ready.set()
        try:
            while not self._stop.is_set():
                if sock.poll(20):
                    frames = sock.recv_multipart(copy=False)
                    self._peer = frames[0].bytes
                    self._answer(sock, self._peer, frames[1:])
                while self._outbox:
                    self._send(sock, self._peer, self._outbox.popleft())
        finally:
            sock.close(linger=0)
            context.term()

    def _answer(self, sock: zmq.Socket[Any], peer: bytes, frames: list[Any]) -> None:
        try:
            message = wire.decode(frames)
        except IpuserveError as exc:
            self._send(sock, peer, wire.error_frames(wire.peek_id(frames), exc))
            return
        if isinstance(message, wire.Requests):
            self.batches += 1
            self.rows += message.requests
            for failed in message.rejected:
                self._send(sock, peer, wire.error_frames(failed.job_id, failed.exception()))
            replies = [self._reply_to(one) for row in message.requests for one in row.members()]
        else:
            replies = [self._reply_to(message)]
        for reply in replies:
            if reply is None or self.silent:
                continue
            out = reply if isinstance(reply, list) else reply.encode()
            for _ in range(self.duplicate_replies):
                self._send(sock, peer, out)

    def _reply_to(self, message: wire.Message) -> list[wire.Frame] | wire.Message | None:
        if isinstance(message, wire.Ping):
            self.pings += 1
            return wire.Pong(message.request_id, self.epoch)
        if isinstance(message, wire.ListModels):
            load = wire.WorkerLoad("w1", credit=8, in_flight=1, requests=1)
            if self.group_samples is None:
                return wire.ModelsReply(message.request_id, ())
            info = wire.ModelInfo(ADD, 0, (load,), group_samples=self.group_samples)
            return wire.ModelsReply(message.request_id, (info,))
        if isinstance(message, wire.Request):
            self.requests.append(message)
            return self.handler(message)
        if isinstance(message, wire.RepositoryCommand):
            self.commands.append(message)
            if self.repository is None:
                return wire.ErrorReply(message.request_id, "PROTOCOL_ERROR", "not a command")
            return self.repository(message)
        return None

    @staticmethod
    def _send(sock: zmq.Socket[Any], peer: bytes, frames: list[wire.Frame]) -> None:
        sock.send_multipart([peer, *frames], copy=False)  # type: ignore[list-item]


def inputs(seed: int = 0) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    return {
        "a": rng.standard_normal((2, 3)).astype(np.float32),
        "b": rng.standard_normal((2, 3)).astype(np.float32),
    }


# ---------------------------------------------------------------- the model repository


def state(version: str, st: str, reason: str = "", workers: int = 0) -> wire.VersionState:
    """``mlp`` ``version`` in state ``st``, served by ``workers`` workers."""
    names = tuple(f"h{i}/mlp/{version}" for i in range(workers))
    return wire.VersionState("mlp", version, st, reason, names)  # type: ignore[arg-type]


class ScriptedRepository:
    """Answers REPOSITORY as a broker with repository workers would: a load is LOADING
    for ``loading_polls`` index questions, then READY; an unload makes it UNAVAILABLE."""

    def __init__(self, loading_polls: int = 2) -> None:
        self.states = {
            "1": state("1", "READY", workers=1),
            "2": state("2", "UNAVAILABLE", "not loaded"),
        }
        self.loading_polls = loading_polls
        self.refusal: wire.ErrorReply | None = None

    def __call__(self, command: wire.RepositoryCommand) -> wire.Message:
        if self.refusal is not None:
            return wire.ErrorReply(command.request_id, self.refusal.code, self.refusal.message)
        if command.action == "load":
            self.states[command.version or "2"] = state(command.version or "2", "LOADING")
        elif command.action == "unload":
            for version in [command.version] if command.version else list(self.states):
                self.states[version] = state(version, "UNAVAILABLE", "unloaded")
        elif any(s.state == "LOADING" for s in self.states.values()):
            self.loading_polls -= 1
            if self.loading_polls < 0:
                self.states = {
                    v: state(v, "READY", workers=1) if s.state == "LOADING" else s
                    for v, s in self.states.items()
                }
        reply = tuple(self.states.values())
        return wire.RepositoryReply(command.request_id, reply, f"{command.action} done")


@contextmanager
def scripted_broker() -> Iterator[FakeBroker]:
    """A started fake broker whose repository is a :class:`ScriptedRepository`."""
    fake = FakeBroker().start()
    fake.repository = ScriptedRepository()
    try:
        yield fake
    finally:
        fake.stop()
