"""The worker's books: which jobs it holds, which wait to start, and what to answer.

One owner for a job's life inside the worker, from admission to its outcome: a job
from JOBS is admitted (:meth:`JobBook.admit` -- only the checks a broker cannot make),
waits in a queue until the backend has room (:meth:`JobBook.start_waiting`; one that
expires there is answered DEADLINE_EXCEEDED, never started), runs, and its outcome --
a result cut back to wire tensors, or a failure -- joins this turn's RESULTS
(:meth:`JobBook.take_results`). Jobs of an older broker epoch are dropped, not answered.

The socket loop (:mod:`ipuserve.worker.node`) owns the book; it is used under the
node's lock only, from the loop or from a backend thread sending a result itself.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from ipuserve import protocol as wire
from ipuserve.errors import (
    DeadlineExceeded,
    InferenceError,
    InvalidInputError,
    IpuserveError,
    OverloadedError,
    PayloadTooLargeError,
    UnknownModelError,
)
from ipuserve.grouping import group_problem
from ipuserve.worker.backend import Backend, Done, Outcome, WorkItem, WorkResult
from ipuserve.worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Held:
    """A job this worker holds, and which broker epoch gave it to us."""

    job: WorkItem
    epoch: str
    received: float
    submitted: float = 0.0
    #: a group job: this many requests joined along the batching dimension
    members: int = 1
    #: the connection (JobBook.connection) it came on
    connection: int = 0


class JobBook:
    """Admission, the waiting queue, expiry and outcomes of the jobs a worker holds."""

    def __init__(
        self,
        backend: Backend,
        models: dict[str, wire.ModelSpec],
        credit: int,
        start_lock: threading.Lock | None = None,
    ) -> None:
        self._backend = backend
        #: held from asking the backend for room to handing it the jobs: the books of
        #: several brokers' loops share one backend, and two of them asking at once
        #: would each be told the same room
        self._start_lock = start_lock or threading.Lock()
        #: a backend written before room_for existed takes every job it is handed
        self._paced = hasattr(backend, "room_for")
        #: the backend's job metrics, if it keeps any (the ModelRunner backend does)
        self._metrics: WorkerMetrics | None = getattr(backend, "metrics", None)
        self._models = models
        self.credit = credit
        #: the broker epoch whose jobs we take now (None before the first WELCOME)
        self.epoch: str | None = None
        #: every job held: waiting, or handed to the backend and not yet answered
        self.jobs: dict[bytes, Held] = {}
        #: the current connection's number, and how many of the jobs held came on it
        #: (the others came on earlier ones: see ipuserve.worker.credit)
        self.connection = 0
        self.held_current = 0
        #: the most jobs of the current connection to hold; None: the single-broker
        #: rule (jobs beyond the credit wait here, up to twice the credit in all)
        self.connection_limit: int | None = None
        self.waiting: deque[Held] = deque()
        #: no waiting job expires before this (monotonic seconds)
        self.next_expiry = math.inf
        #: jobs handed to the backend and not yet finished
        self.running = 0
        #: the broker's payload limit (from WELCOME): bigger outputs fail here, not sent
        self.max_payload_bytes: int | None = None
        #: outcomes of this turn of the loop, sent together
        self._results: list[wire.Result] = []
        self._failures: list[wire.Fail] = []

    # ------------------------------------------------------------ admission

    def admit(self, jobs: Iterable[wire.Job], rejected: Iterable[wire.Fail]) -> None:
        """Take a JOBS message's jobs (and fail the rows it could not read)."""
        self._failures += rejected
        for job in jobs:
            if job.job_id in self.jobs:
                continue  # a re-sent job we already hold
            try:
                held = self._accept(job)
            except IpuserveError as exc:
                self.refuse(job.job_id, job.model, exc)
                continue
            self.jobs[job.job_id] = held
            self.held_current += 1
            self.waiting.append(held)
            if held.job.deadline is not None:
                self.next_expiry = min(self.next_expiry, held.job.deadline)

    def _accept(self, message: wire.Job) -> Held:
        """Stamp a job's deadline; its samples are the broker's count (JOBS carries it).

        The broker checked its tensors against the model's schema before forwarding it
        (it owns that check: docs/architecture.md §2); the worker checks only what the
        broker cannot know -- that this worker serves the model, its own load, and how
        much of the job's budget is left on arrival."""
        spec = self._models.get(message.model)
        if spec is None:
            raise UnknownModelError(f"this worker does not serve model {message.model!r}")
        members = message.tensors.members
        if members > 1:
            problem = group_problem(spec, members, message.samples // members)
            if problem is not None:  # the broker checked it: a broker of another version
                raise InvalidInputError(problem)
        if self.connection_limit is not None and self.held_current >= self.connection_limit:
            raise OverloadedError(
                f"the broker sent more jobs than this connection's credit "
                f"({self.connection_limit}); this worker serves several brokers"
            )
        if len(self.jobs) >= 2 * self.credit:
            held, credit = len(self.jobs), self.credit
            raise OverloadedError(f"worker holds {held} jobs; its credit is {credit}")
        now = time.monotonic()
        budget = message.budget_ms
        if budget is not None and budget <= 0:
            raise DeadlineExceeded("the job's deadline passed before it reached the worker")
        deadline = None if budget is None else now + budget / 1000
        inputs = (
            message.tensors.stacked(spec.batching_dim or 0)
            if members > 1
            else message.tensors.arrays()
        )
        job = WorkItem(message.job_id, message.model, inputs, deadline, message.samples)
        assert self.epoch is not None
        return Held(job, self.epoch, now, members=members, connection=self.connection)

    def new_connection(self) -> None:
        """A new connection: every job held now came on an earlier one."""
        self.connection += 1
        self.held_current = 0

    def drop(self, job_id: bytes) -> Held | None:
        """Stop holding a job (answered, expired, handed back or forgotten)."""
        held = self.jobs.pop(job_id, None)
        if held is not None and held.connection == self.connection:
            self.held_current -= 1
        return held

    # ------------------------------------------------------------ starting

    def start_waiting(self, done: Done) -> None:
        """Hand waiting jobs to the backend while fewer than credit run and it has room:
        all that may start now in one call, so the backend can run them together. A
        job whose deadline passed while it waited here is answered, not started.
        Jobs the backend refused at once free their room: the next waiting ones go
        then, not at the next JOBS or result (after a device fault there may be none)."""
        while self._start_some(done):
            pass

    def _start_some(self, done: Done) -> bool:
        """One hand-over; True if the backend refused some and others still wait."""
        candidates: list[Held] = []
        now = time.monotonic()
        while self.waiting and self.running + len(candidates) < self.credit:
            held = self.waiting.popleft()
            if held.job.expired(now):
                self._expired(held)
                continue
            candidates.append(held)
        if not candidates:
            return False
        with self._start_lock:
            room = (
                self._backend.room_for([held.job for held in candidates])
                if self._paced
                else len(candidates)
            )
            self.waiting.extendleft(reversed(candidates[room:]))
            starting = [held.job for held in candidates[:room]]
            for held in candidates[:room]:
                held.submitted = now
            self.running += len(starting)
            if not starting:
                return False
            refused = self._backend.submit_all(starting, done)
        for job, error in refused:
            self.running -= 1
            self.drop(job.job_id)
            self.refuse(job.job_id, job.model, error)
        return bool(refused) and bool(self.waiting)

    # ------------------------------------------------------------ expiry

    def _expired(self, held: Held) -> None:
        self.drop(held.job.job_id)
        waited = "the job's deadline passed while it waited at the worker"
        self.refuse(held.job.job_id, held.job.model, DeadlineExceeded(waited))

    def expire_waiting(self, now: float) -> None:
        """Answer waiting jobs at their deadline, not at the next event that starts jobs
        (the broker has answered their clients; they must not hold credit meanwhile)."""
        if now < self.next_expiry:
            return
        keep: deque[Held] = deque()
        for held in self.waiting:
            if held.job.expired(now):
                self._expired(held)
            else:
                keep.append(held)
        self.waiting = keep
        deadlines = [h.job.deadline for h in keep if h.job.deadline is not None]
        self.next_expiry = min(deadlines, default=math.inf)

    def set_aside_waiting(self) -> list[bytes]:
        """Stop holding the waiting jobs (draining: they are handed back); their ids."""
        ids = [held.job.job_id for held in self.waiting]
        for job_id in ids:
            self.drop(job_id)
        self.waiting.clear()
        return ids

    def forget_epoch(self, epoch: str | None, unsent: list[Outcome]) -> None:
        """Drop what an older broker gave us: its waiting jobs and its unsent results."""
        if epoch is None:
            return
        dropped = len(unsent) + len(self.waiting)
        for job, _outcome in unsent:
            self.drop(job.job_id)
        for held in self.waiting:
            self.drop(held.job.job_id)
        unsent.clear()
        self.waiting.clear()
        self._failures.clear()  # refusals of its jobs, made while disconnected
        running = sum(1 for held in self.jobs.values() if held.epoch == epoch)
        log.warning(
            "a new broker (the old one restarted): dropped %d waiting job(s) and unsent "
            "result(s) of the old one; %d job(s) of it are already running and will be "
            "finished, their results dropped (the clients re-send them to the new broker)",
            dropped,
            running,
        )

    # ------------------------------------------------------------ outcomes

    def refuse(self, job_id: bytes, model: str, error: IpuserveError) -> None:
        """Answer a job the backend never ran, and count it among the jobs answered (the
        backend counts those it ran)."""
        self._failures.append(wire.Fail.of(job_id, error))
        if self._metrics is not None:
            self._metrics.refused(model, error.code)

    def fail(self, failures: Iterable[wire.Fail]) -> None:
        self._failures += failures

    def finished(self, outcomes: Iterable[Outcome]) -> list[Outcome]:
        """Account for finished jobs; keep the outcomes still worth sending."""
        keep = []
        for job, outcome in outcomes:
            self.running -= 1
            held = self.jobs.get(job.job_id)
            if held is not None and held.job is job:
                keep.append((job, outcome))
        return keep

    def answer(self, job: WorkItem, outcome: WorkResult | IpuserveError) -> None:
        """The outcome of a job this book holds joins this turn's RESULTS."""
        held = self.drop(job.job_id)
        assert held is not None
        if held.epoch != self.epoch:
            log.debug("dropping the result of job %s from epoch %s", job.job_id.hex(), held.epoch)
            return
        if isinstance(outcome, IpuserveError):
            self._failures.append(wire.Fail.of(job.job_id, outcome))
            return
        try:
            tensors = self._sendable(outcome, held)
        except IpuserveError as exc:
            self._failures.append(wire.Fail.of(job.job_id, exc))
            return
        self._results.append(wire.Result(job.job_id, tensors, _timing(held, outcome)))

    def _sendable(self, outcome: WorkResult, held: Held) -> wire.Tensors:
        """The outputs as wire tensors (a group's cut back into its members), if the broker
        can take them."""
        try:
            if held.members == 1:
                tensors = wire.Tensors.of(outcome.outputs)
            else:
                dim = self._models[held.job.model].batching_dim or 0
                tensors = wire.Tensors.unstacked(outcome.outputs, held.members, dim)
        except IpuserveError as exc:
            raise InferenceError(f"unsendable outputs: {exc}") from exc
        nbytes = tensors.nbytes * tensors.members  # a group's frames hold every member's
        limit = self.max_payload_bytes
        if limit is not None and nbytes > limit:
            what = "request" if tensors.members == 1 else f"group of {tensors.members} requests"
            raise PayloadTooLargeError(
                f"the outputs of this {what} take {nbytes} bytes; the broker's "
                f"limit is {limit} (--max-payload-bytes)"
            )
        return tensors

    def take_results(self) -> wire.Results | None:
        """This turn's outcomes as one RESULTS message (None if there are none)."""
        if not self._results and not self._failures:
            return None
        message = wire.Results(tuple(self._results), tuple(self._failures))
        self._results.clear()
        self._failures.clear()
        return message


def _timing(held: Held, result: WorkResult) -> dict[str, float]:
    timing = {k: v for k, v in result.timing.items() if k != "queue_us"}
    waited = (held.submitted - held.received) * 1e6 + result.timing.get("queue_us", 0.0)
    timing["worker_queue_us"] = waited
    timing["worker_us"] = (time.monotonic() - held.received) * 1e6
    return timing
