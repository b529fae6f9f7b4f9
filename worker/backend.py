"""The seam between a worker's socket loop and whatever computes the results.

The socket thread (:mod:`ipuserve.worker.node`) admits each job -- the broker checked
its tensors against the :class:`ModelSpec` the backend described -- then calls
:meth:`Backend.submit_all` with the jobs it may start now. The backend runs each job
on its own thread(s) and calls ``done(job, outcome)`` from there exactly once per
submitted job, with a :class:`WorkResult` or an :class:`~ipuserve.errors.IpuserveError`
(never another exception type). ``done`` is thread-safe and never blocks: it sends the
result itself when the socket loop is idle, else hands it to the loop. It must not
be called with a lock held that ``submit_all`` takes.

``WorkResult.timing`` should hold ``queue_us`` (submit to start of execution) and
``device_us`` (execution); the worker turns them into the wire's
``worker_queue_us`` / ``device_us`` and passes any other keys on to the client.

``TensorSpec`` and ``ModelSpec`` are defined by :mod:`ipuserve.protocol` (HELLO
carries them) and re-exported here.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ipuserve.errors import (
    ClosedError,
    DeadlineExceeded,
    InferenceError,
    IpuserveError,
    UnavailableError,
    UnknownModelError,
)
from ipuserve.inbox import Inbox
from ipuserve.protocol import ModelSpec, TensorSpec

__all__ = [
    "Backend",
    "Done",
    "FunctionBackend",
    "Mailbox",
    "ModelSpec",
    "Refused",
    "TensorSpec",
    "WorkItem",
    "WorkResult",
]

log = logging.getLogger(__name__)

Array = np.ndarray[Any, Any]


@dataclass(frozen=True, slots=True)
class WorkItem:
    """One job as the backend sees it (a ``wire.Job`` admitted, its tensors decoded): a
    request, or a client's group of requests joined along the batching dimension.
    ``deadline`` is in ``time.monotonic()`` seconds; ``samples`` is its size along the
    batching dimension, counted once where the item was made (the worker's socket loop)
    so that nothing downstream re-derives it."""

    job_id: bytes
    model: str
    inputs: Mapping[str, Array]
    deadline: float | None = None
    samples: int = 1

    def expired(self, now: float | None = None) -> bool:
        return self.deadline is not None and (now or time.monotonic()) >= self.deadline


@dataclass(frozen=True, slots=True)
class WorkResult:
    """What a backend computed for one :class:`WorkItem`; the worker turns it into a
    ``wire.Result`` (named apart from it: this one holds arrays, not frames)."""

    outputs: Mapping[str, Array]
    timing: Mapping[str, float] = field(default_factory=dict)


Done = Callable[[WorkItem, "WorkResult | IpuserveError"], None]


class Backend(Protocol):
    def describe(self) -> list[ModelSpec]:
        """The models this backend serves (what HELLO announces)."""
        ...

    def capacity(self) -> int:
        """How many jobs it can usefully hold at once: the worker's default credit."""
        ...

    def submit_all(self, jobs: Sequence[WorkItem], done: Done) -> list[Refused]:
        """Start ``jobs``; returns those it refuses at once, with why (``done`` is never
        called for them)."""
        ...

    def room_for(self, jobs: Sequence[WorkItem]) -> int:
        """How many of ``jobs`` (a prefix) to start now. The rest wait in the worker,
        which answers one whose deadline passes there DEADLINE_EXCEEDED: a backend
        whose started jobs cannot be recalled (the runtime's queues) keeps only what
        the device will reach soon, so that an expired job is dropped, not run late."""
        ...

    def close(self) -> None:
        """Stop; every job submitted and not yet done is answered (with an error if need be)."""
        ...


Refused = tuple[WorkItem, IpuserveError]


def submit_each(
    submit: Callable[[WorkItem, Done], None], jobs: Sequence[WorkItem], done: Done
) -> list[Refused]:
    """``submit_all`` for a backend that starts jobs one at a time: ``submit`` raises
    IpuserveError for a job it refuses."""
    refused = []
    for job in jobs:
        try:
            submit(job, done)
        except IpuserveError as exc:
            refused.append((job, exc))
    return refused


ModelFn = Callable[[Mapping[str, Array]], Mapping[str, Any]]

_STOP = None


class FunctionBackend:
    """Runs a numpy function per model on ``threads`` threads: the reference backend.

    Jobs past their deadline when a thread picks them up are answered
    DeadlineExceeded without running. An exception from the function becomes an
    InferenceError that names the model. With ``threads=0`` jobs run inline, on the
    thread that submits them (for trivial functions: no thread hop at all).
    """

    def __init__(
        self,
        models: Mapping[ModelSpec, ModelFn],
        *,
        threads: int = 1,
        capacity: int | None = None,
    ) -> None:
        self._models = {spec.name: (spec, fn) for spec, fn in models.items()}
        self._capacity = capacity if capacity is not None else max(1, 2 * threads)
        self._jobs: queue.SimpleQueue[tuple[WorkItem, Done, float] | None] = queue.SimpleQueue()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._run, name=f"function-backend-{i}", daemon=True)
            for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def describe(self) -> list[ModelSpec]:
        return [spec for spec, _fn in self._models.values()]

    def capacity(self) -> int:
        return self._capacity

    def submit_all(self, jobs: Sequence[WorkItem], done: Done) -> list[Refused]:
        return submit_each(self.submit, jobs, done)

    def room_for(self, jobs: Sequence[WorkItem]) -> int:
        """All: its own queue drops what expires before a thread picks it up."""
        return len(jobs)

    def submit(self, job: WorkItem, done: Done) -> None:
        if self._closed:
            raise ClosedError("the backend is closed")
        if job.model not in self._models:
            raise UnknownModelError(f"this worker does not serve model {job.model!r}")
        if self._threads:
            self._jobs.put((job, done, time.monotonic()))
        else:
            done(job, self._execute(job, time.monotonic()))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for _thread in self._threads:
            self._jobs.put(_STOP)
        for thread in self._threads:
            thread.join()
        self._answer_leftovers()

    def _answer_leftovers(self) -> None:
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                job, done, _submitted = item
                done(job, UnavailableError("the worker's backend closed before running the job"))

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, done, submitted = item
            if self._closed:
                done(job, UnavailableError("the worker's backend closed before running the job"))
            else:
                done(job, self._execute(job, submitted))

    def _execute(self, job: WorkItem, submitted: float) -> WorkResult | IpuserveError:
        started = time.monotonic()
        if job.expired(started):
            return DeadlineExceeded(f"job for model {job.model!r} expired before it ran")
        _spec, fn = self._models[job.model]
        try:
            outputs = {name: np.asarray(value) for name, value in fn(job.inputs).items()}
        except IpuserveError as exc:
            return exc
        except Exception as exc:
            log.warning("model %r raised %r", job.model, exc)
            return InferenceError(f"model {job.model!r} raised {type(exc).__name__}: {exc}")
        finished = time.monotonic()
        timing = {"queue_us": (started - submitted) * 1e6, "device_us": (finished - started) * 1e6}
        return WorkResult(outputs, timing)


Outcome = tuple[WorkItem, "WorkResult | IpuserveError"]


#: Outcomes from backend threads to the socket thread: the one hand-off queue of
#: ipuserve's loops (:class:`ipuserve.inbox.Inbox`, shared with the client's I/O
#: thread): ``put`` wakes only on the empty -> non-empty transition, and ``take``
#: clears the waker before it swaps, so a wake-up is never lost.
Mailbox = Inbox[Outcome]
