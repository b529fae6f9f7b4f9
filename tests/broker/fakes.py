"""A fake worker: a bare DEALER that speaks the worker side of the protocol, step by step."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import zmq

from ipuserve import protocol as wire

ADD = wire.ModelSpec(
    "add",
    inputs=(wire.TensorSpec("x", "float32", (4, 8)), wire.TensorSpec("y", "float32", (4, 8))),
    outputs=(wire.TensorSpec("z", "float32", (4, 8)),),
    batch_size=4,
    batching_dim=0,
)
TIMEOUT = 10.0


class FakeWorker:
    """Heartbeats (when ``alive``) every time it waits, so the broker keeps it."""

    def __init__(
        self,
        endpoint: str,
        *,
        credit: int = 2,
        worker_id: str = "fake",
        models: tuple[wire.ModelSpec, ...] = (ADD,),
    ) -> None:
        self.socket: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self.credit, self.worker_id, self.models = credit, worker_id, models
        self.alive = True

    def close(self) -> None:
        self.socket.close(linger=0)

    def send(self, message: wire.Message) -> None:
        self.socket.send_multipart(message.encode(), copy=False)  # type: ignore[arg-type]

    def hello(self) -> wire.Welcome:
        self.send(wire.Hello(self.worker_id, self.models, self.credit))
        return self.expect(wire.Welcome)

    def recv(self, timeout: float = TIMEOUT) -> wire.Message:
        """The next message other than a broker HEARTBEAT."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if self.alive:
                self.send(wire.Heartbeat(in_flight=0))
            if self.socket.poll(min(20, int(left * 1000) + 1)):
                message = wire.decode(self.socket.recv_multipart(copy=False))
                if not isinstance(message, wire.Heartbeat):
                    return message
        raise TimeoutError(f"{self.worker_id}: nothing within {timeout} s")

    def expect(self, kind: type[Any], timeout: float = TIMEOUT) -> Any:
        message = self.recv(timeout)
        assert isinstance(message, kind), message
        return message

    def job(self, timeout: float = TIMEOUT) -> wire.Job:
        job: wire.Job = self.expect(wire.Job, timeout)
        return job

    def answer(self, job: wire.Job) -> None:
        arrays = job.tensors.arrays()
        z = np.asarray(arrays["x"] + 2 * arrays["y"])
        self.send(wire.Result(job.job_id, wire.Tensors.of({"z": z}), {"device_us": 1.0}))
