"""Jobs: one per accepted request, from admission until its one reply.

A job keeps the request's tensor frames by reference until the reply, so it can be
sent to another worker if the first one dies. Job ids start with a random per-broker
prefix: a late result from a worker that served a previous broker can never match a
job of this one.
"""

from __future__ import annotations

import enum
import itertools
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ipuserve.protocol import Tensors
from ipuserve.versions import Key

if TYPE_CHECKING:
    from ipuserve.broker.registry import Worker


_NO_TENSORS = Tensors()


class State(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


@dataclass(slots=True, eq=False)
class JobEntry:
    job_id: bytes
    client: bytes
    request_id: bytes
    model: str
    #: the (model, version) it is queued for or placed on: the version asked for, or
    #: the model's default when it was admitted (moved to the new default if every
    #: worker of that one leaves while it waits: see ``asked``)
    key: Key
    tensors: Tensors
    received: float
    deadline: float | None
    timeout_ms: float | None
    #: it came in a REQUESTS message: its reply may go out in a REPLIES
    batched: bool = False
    #: a group job: the ids of its requests (``request_id`` is the first), else ()
    group: tuple[bytes, ...] = ()
    state: State = State.QUEUED
    attempts: int = 0
    worker: Worker | None = None
    dispatched: float = 0.0
    #: seconds spent in the model's queue, over every stay (a job whose worker left
    #: waits again); the current stay began at ``enqueued_at``
    queued_s: float = 0.0
    enqueued_at: float = 0.0
    #: (connection, worker id) of every worker it was placed on: only they may answer
    holders: list[tuple[bytes, str]] = field(default_factory=list)
    #: the client's requests this job answers: a group's, or its one (set once, by
    #: :meth:`JobTable.create`)
    request_ids: tuple[bytes, ...] = ()
    #: samples along the model's batching dimension, all members together: computed once,
    #: at admission (0 while the model is unknown, in the start-up grace), for the
    #: group sizer when the result comes back
    samples: int = 0
    #: the version the request named; None: the model's default (it may move)
    asked: str | None = None

    @property
    def version(self) -> str:
        return self.key[1]

    def placed_on(self, sender: bytes, worker: Worker | None) -> bool:
        """Whether ``sender`` may answer: a connection it was placed on, or a registered
        worker under the id of one (a worker that reconnected has a new connection)."""
        if worker is not None and worker is self.worker:
            return True  # the worker holding it now: every result but a late one
        return any(
            sender == identity or (worker is not None and worker.worker_id == worker_id)
            for identity, worker_id in self.holders
        )

    def budget_ms(self, now: float) -> float | None:
        return None if self.deadline is None else (self.deadline - now) * 1000


class JobTable:
    """Live jobs by id, and by (client identity, request id) to spot re-sent requests."""

    def __init__(self) -> None:
        self._prefix = os.urandom(4)
        self._ids = itertools.count(1)
        self._jobs: dict[bytes, JobEntry] = {}
        #: live jobs by (client identity, request id): a re-sent request is found here
        self.keys: dict[tuple[bytes, bytes], JobEntry] = {}

    def __len__(self) -> int:
        return len(self._jobs)

    def live(self) -> list[JobEntry]:
        return list(self._jobs.values())

    def pending(self, client: bytes, request_id: bytes) -> bool:
        return (client, request_id) in self.keys

    def create(
        self,
        client: bytes,
        request_id: bytes,
        key: Key,
        tensors: Tensors,
        now: float,
        timeout_ms: float | None,
        batched: bool = False,
        group: tuple[bytes, ...] = (),
        samples: int = 0,
        asked: str | None = None,
    ) -> JobEntry:
        job_id = self._prefix + next(self._ids).to_bytes(8, "big")
        deadline = None if timeout_ms is None else now + timeout_ms / 1000
        ids = group or (request_id,)
        job = JobEntry(
            job_id,
            client,
            request_id,
            key[0],
            key,
            tensors,
            now,
            deadline,
            timeout_ms,
            batched,
            group,
            enqueued_at=now,
            request_ids=ids,
            samples=samples,
            asked=asked,
        )
        self._jobs[job_id] = job
        keys = self.keys
        for member in ids:
            keys[(client, member)] = job
        return job

    def get(self, job_id: bytes) -> JobEntry | None:
        return self._jobs.get(job_id)

    def finish(self, job: JobEntry) -> None:
        job.state = State.DONE
        # The timer heap and a queue's deque keep a finished job until it reaches
        # their front, behind a slow job for minutes: without its payload it is small.
        job.tensors = _NO_TENSORS
        self._jobs.pop(job.job_id, None)
        for member in job.request_ids:
            self.keys.pop((job.client, member), None)
