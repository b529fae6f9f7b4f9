"""A fake worker: a bare DEALER that speaks the worker side of the protocol, step by step."""

from __future__ import annotations

import time
from collections.abc import Callable
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
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self.socket: zmq.Socket[Any] = (context or zmq.Context.instance()).socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self.credit, self.worker_id, self.models = credit, worker_id, models
        self.alive = True
        self.welcome: wire.Welcome | None = None
        self.jobs: list[wire.Job] = []  # received in a batch, not yet taken

    def close(self) -> None:
        self.socket.close(linger=0)

    def send(self, message: wire.Message) -> None:
        self.socket.send_multipart(message.encode(), copy=False)  # type: ignore[arg-type]

    def hello(self) -> wire.Welcome:
        """Register; the WELCOME is also kept as ``welcome``."""
        self.send(wire.Hello(self.worker_id, self.models, self.credit))
        self.welcome = self.expect(wire.Welcome)
        return self.welcome

    def recv(self, timeout: float = TIMEOUT) -> wire.Message | wire.Job:
        """The next message other than a broker HEARTBEAT; a JOBS batch comes job by job."""
        if self.jobs:
            return self.jobs.pop(0)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if self.alive:
                self.send(wire.Heartbeat(in_flight=0))
            if self.socket.poll(min(20, int(left * 1000) + 1)):
                message = wire.decode(self.socket.recv_multipart(copy=False))
                if isinstance(message, wire.Jobs):
                    self.jobs += message.jobs
                    return self.jobs.pop(0)
                if not isinstance(message, wire.Heartbeat):
                    return message
        raise TimeoutError(f"{self.worker_id}: nothing within {timeout} s")

    def next_batch(self, timeout: float = TIMEOUT) -> wire.Jobs:
        """The next JOBS message whole (after any jobs already taken apart)."""
        assert not self.jobs, "jobs of an earlier batch were not taken"
        message = self.recv(timeout)
        assert isinstance(message, wire.Job), message
        batch, self.jobs = (message, *self.jobs), []
        return wire.Jobs(batch)

    def idle_until(self, condition: Callable[[], bool], timeout: float = TIMEOUT) -> None:
        """Wait for ``condition`` (a broker state), heartbeating meanwhile: a fake worker
        is only as live as its calls, and a short liveness window would drop it."""
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"{self.worker_id}: condition never true"
            if self.alive:
                self.send(wire.Heartbeat(in_flight=0))
            # A pace between checks (what arrives stays for recv()). Not socket.poll(5):
            # it returns at once while an unread message waits (the broker's heartbeat
            # echo), and the loop then flooded the broker with heartbeats, which held
            # its timers back by seconds (a 200 ms liveness window fired after 1.8-9 s,
            # past this wait's 10 s once in CI).
            time.sleep(0.005)

    def die(self, context: zmq.Context[Any]) -> None:
        """Stop as the process's death would: silent, its connection closed. ``context``
        is this worker's own; its term() returns once the TCP connection is closed."""
        self.alive = False
        self.close()
        context.term()

    def expect(self, kind: type[Any], timeout: float = TIMEOUT) -> Any:
        message = self.recv(timeout)
        assert isinstance(message, kind), message
        return message

    def job(self, timeout: float = TIMEOUT) -> wire.Job:
        job: wire.Job = self.expect(wire.Job, timeout)
        return job

    def answer(self, *jobs: wire.Job) -> None:
        """One RESULTS message answering ``jobs``."""
        self.send(wire.Results(tuple(result_for(job) for job in jobs)))

    def fail(self, job: wire.Job, code: str, message: str) -> None:
        self.send(wire.Results(failures=(wire.Fail(job.job_id, code, message),)))


def result_for(job: wire.Job) -> wire.Result:
    """z = x + 2y for a job (a group's for each member, as a worker joins and cuts it)."""
    arrays = job.tensors.stacked(0)
    z = np.asarray(arrays["x"] + 2 * arrays["y"])
    outputs = wire.Tensors.unstacked({"z": z}, job.tensors.members, 0)
    return wire.Result(job.job_id, outputs, {"device_us": 1.0})
