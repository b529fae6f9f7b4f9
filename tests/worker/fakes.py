"""A fake broker (a bare ROUTER speaking the broker side) and a controllable add model."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import zmq

from ipuserve import protocol as wire
from ipuserve.worker.backend import FunctionBackend

ADD = wire.ModelSpec(
    "add",
    inputs=(wire.TensorSpec("x", "float32", (4, 8)), wire.TensorSpec("y", "float32", (4, 8))),
    outputs=(wire.TensorSpec("z", "float32", (4, 8)),),
    batch_size=4,
    batching_dim=0,
)
TIMEOUT = 10.0
Received = wire.Message | wire.Result | wire.Fail


class GatedAdd:
    """z = x + 2y, but each call waits for the gate while ``gated``; tracks concurrency."""

    def __init__(self, gated: bool = False) -> None:
        self.gate = threading.Event()
        if not gated:
            self.gate.set()
        self.started = threading.Semaphore(0)
        self.running = 0
        self.most_running = 0
        self._lock = threading.Lock()

    def __call__(self, inputs: Mapping[str, Any]) -> Mapping[str, Any]:
        with self._lock:
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        self.started.release()
        self.gate.wait(TIMEOUT)
        with self._lock:
            self.running -= 1
        return {"z": inputs["x"] + 2 * inputs["y"]}

    def wait_started(self, count: int = 1) -> None:
        for _ in range(count):
            assert self.started.acquire(timeout=TIMEOUT), "the model was not called"

    def backend(self, threads: int = 2, capacity: int | None = None) -> FunctionBackend:
        return FunctionBackend({ADD: self}, threads=threads, capacity=capacity)


class FakeBroker:
    def __init__(self) -> None:
        self.socket: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind("tcp://127.0.0.1:*")
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.outcomes: list[tuple[bytes, Received]] = []  # from a RESULTS, not yet taken

    def close(self) -> None:
        self.socket.close(linger=0)

    def send(self, identity: bytes, message: wire.Message) -> None:
        self.socket.send_multipart([identity, *message.encode()], copy=False)  # type: ignore[list-item]

    def recv(self, timeout: float = TIMEOUT, heartbeats: bool = False) -> tuple[bytes, Received]:
        """The next message (skipping heartbeats unless asked); RESULTS come outcome by
        outcome, as the wire.Result or wire.Fail items they carry."""
        if self.outcomes:
            return self.outcomes.pop(0)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if self.socket.poll(int(left * 1000) + 1):
                identity, *frames = self.socket.recv_multipart(copy=False)
                message = wire.decode(frames)
                if isinstance(message, wire.Results):
                    items = [*message.results, *message.failures]
                    self.outcomes += [(identity.bytes, item) for item in items]
                    return self.outcomes.pop(0)
                if heartbeats or not isinstance(message, wire.Heartbeat):
                    return identity.bytes, message
        raise TimeoutError(f"the fake broker got nothing within {timeout} s")

    def next_message(self, kind: type[Any], timeout: float = TIMEOUT) -> Any:
        """The next whole message of ``kind`` (a batch not taken apart); others are skipped."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if self.socket.poll(int(left * 1000) + 1):
                _identity, *frames = self.socket.recv_multipart(copy=False)
                if isinstance(message := wire.decode(frames), kind):
                    return message
        raise TimeoutError(f"the fake broker got no {kind.__name__} within {timeout} s")

    def expect(self, kind: type[Any], timeout: float = TIMEOUT) -> tuple[bytes, Any]:
        identity, message = self.recv(timeout)
        assert isinstance(message, kind), message
        return identity, message

    def welcome(self, epoch: str = "epoch1", liveness_ms: int = 60_000) -> bytes:
        identity, hello = self.expect(wire.Hello)
        assert hello.models == (ADD,)
        self.send(identity, wire.Welcome(epoch, 50, liveness_ms))
        return identity

    def job(
        self,
        identity: bytes,
        job_id: bytes,
        inputs: Mapping[str, Any] | None = None,
        budget_ms: float | None = None,
        model: str = "add",
    ) -> dict[str, Any]:
        inputs = dict(inputs or add_inputs())
        job = add_job(job_id, wire.Tensors.of(inputs), budget_ms, model)
        self.send(identity, wire.Jobs((job,)))
        return inputs


def add_job(
    job_id: bytes, tensors: wire.Tensors, budget_ms: float | None = None, model: str = "add"
) -> wire.Job:
    """A JOBS row for ``tensors`` as a broker sends it: the samples counted by the
    broker, all members together (ADD's rule, which the tests' other models share)."""
    samples = tensors.members * ADD.samples(spec.shape for spec in tensors.specs)
    return wire.Job(job_id, model, tensors, budget_ms, samples)


def add(inputs: Mapping[str, Any]) -> Mapping[str, Any]:
    return {"z": inputs["x"] + 2 * inputs["y"]}


def add_inputs(rows: int = 2) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(rows)
    return {
        "x": rng.standard_normal((rows, 8), dtype=np.float32),
        "y": rng.standard_normal((rows, 8), dtype=np.float32),
    }
