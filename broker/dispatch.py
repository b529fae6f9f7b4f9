"""Per-model-version bounded queues and the choice of worker: credit-based, least loaded first.

Pure bookkeeping, no sockets: placement (:mod:`ipuserve.broker.placement`) asks
:meth:`Dispatcher.choose` for a worker and queues the job when none has spare credit;
when a worker frees credit it asks :meth:`Dispatcher.next_for` for the oldest job
among the models it serves.
"""

from __future__ import annotations

from collections import deque

from ipuserve.broker.jobs import JobEntry, State
from ipuserve.broker.registry import Registry, Worker
from ipuserve.errors import OverloadedError
from ipuserve.versions import Key


class ModelQueue:
    """A FIFO of queued jobs. Jobs answered while queued (expired, or answered by a
    late result) stay in the deque as DONE and are skipped.

    ``len`` and ``limit`` count the clients' requests, not jobs: a group job holds
    several, and the limit is what an operator sets in requests (``--queue-limit``).
    A queue holding none admits any one job, so a limit smaller than a group does
    not refuse that group forever.
    """

    __slots__ = ("_jobs", "_requests", "_total", "limit", "model", "version")

    def __init__(
        self, model: str, limit: int, total: Total | None = None, version: str = ""
    ) -> None:
        self.model = model
        self.version = version
        self.limit = limit
        self._jobs: deque[JobEntry] = deque()
        self._requests = 0
        #: the count of queued jobs over every queue of one dispatcher
        self._total = total or Total()

    def __len__(self) -> int:
        """Queued requests (every member of a group job counts)."""
        return self._requests

    def push(self, job: JobEntry) -> None:
        requests = len(job.request_ids)
        if self._requests and self._requests + requests > self.limit:
            which = f" version {self.version}" if self.version else ""
            raise OverloadedError(
                f"model {self.model!r}{which} has {self._requests} queued requests and a limit of "
                f"{self.limit}; {requests} more request(s) do not fit; try again later"
            )
        self._append(job, front=False)

    def push_front(self, job: JobEntry) -> None:
        """Re-queue a job that was already admitted (its worker died): never refused."""
        self._append(job, front=True)

    def _append(self, job: JobEntry, front: bool) -> None:
        job.state = State.QUEUED
        job.worker = None
        (self._jobs.appendleft if front else self._jobs.append)(job)
        self._requests += len(job.request_ids)
        self._total.jobs += 1

    def head(self) -> JobEntry | None:
        while self._jobs and self._jobs[0].state is not State.QUEUED:
            self._jobs.popleft()
        return self._jobs[0] if self._jobs else None

    def pop(self) -> JobEntry | None:
        job = self.head()
        if job is not None:
            self._jobs.popleft()
            self._requests -= len(job.request_ids)
            self._total.jobs -= 1
        return job

    def forget(self, job: JobEntry) -> None:
        """A queued job was answered another way (the caller marks it DONE)."""
        self._requests -= len(job.request_ids)
        self._total.jobs -= 1

    def live_jobs(self) -> list[JobEntry]:
        return [job for job in self._jobs if job.state is State.QUEUED]


class Total:
    """Jobs queued over all of a dispatcher's queues: whether a worker with spare credit
    has anything to take is one integer test, not a look at each of its models."""

    __slots__ = ("jobs",)

    def __init__(self) -> None:
        self.jobs = 0


class Dispatcher:
    def __init__(self, registry: Registry, queue_limit: int) -> None:
        self._serving = registry.serving
        self._limit = queue_limit
        #: jobs waiting in any queue
        self.total = Total()
        self.queues: dict[Key, ModelQueue] = {}

    def choose(self, key: Key) -> Worker | None:
        """The least-loaded worker serving ``key`` (a model version) with spare credit,
        if any (the first registered of equals)."""
        best: Worker | None = None
        best_load = 1.0
        for worker in self._serving.get(key, ()):
            held, credit = len(worker.in_flight), worker.credit
            if held < credit and held / credit < best_load:
                best, best_load = worker, held / credit
        return best

    def queue(self, key: Key) -> ModelQueue:
        queue = self.queues.get(key)
        if queue is None:
            queue = self.queues[key] = ModelQueue(key[0], self._limit, self.total, key[1])
        return queue

    def enqueue(self, job: JobEntry) -> None:
        self.queue(job.key).push(job)

    def requeue(self, job: JobEntry) -> None:
        self.queue(job.key).push_front(job)

    def forget(self, job: JobEntry) -> None:
        self.queues[job.key].forget(job)

    def take_all(self, key: Key) -> list[JobEntry]:
        """Empty ``key``'s queue; its live jobs, oldest first (to be moved or put back)."""
        queue = self.queues.get(key)
        jobs: list[JobEntry] = []
        while queue is not None and (job := queue.pop()) is not None:
            jobs.append(job)
        return jobs

    def next_for(self, worker: Worker) -> JobEntry | None:
        """The oldest queued job among the model versions ``worker`` serves."""
        best: ModelQueue | None = None
        oldest = float("inf")
        queues = self.queues
        for model in worker.models:
            queue = queues.get(model)
            head = queue.head() if queue is not None and len(queue) else None
            if head is not None and head.received < oldest:
                best, oldest = queue, head.received
        return best.pop() if best is not None else None
