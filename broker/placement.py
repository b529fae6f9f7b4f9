"""Placement: which worker runs a job, and the JOBS messages that carry it there.

Placing a job on a worker does not send it: the jobs placed on each worker wait in
its outgoing batch until :meth:`Placement.flush`, which the loop calls after each
batch of messages it reads, and go out as one JOBS message. One message per worker
per turn instead of one per job is most of what the broker saves under load.

A job is the worker's from :meth:`Placement.start` on: it sits in the worker's
``in_flight`` (using credit) until that worker answers or is dropped. This module
owns the outgoing batches and nothing else; what to do with a worker that cannot be
reached (drop it, re-queue its jobs) is the job life's decision
(:mod:`ipuserve.broker.lifecycle`), so :meth:`flush` reports such workers instead.
"""

from __future__ import annotations

import time

from ipuserve import protocol as wire
from ipuserve.broker.backlog import Backlog
from ipuserve.broker.dispatch import Dispatcher
from ipuserve.broker.jobs import JobEntry, State
from ipuserve.broker.metrics import BrokerMetrics
from ipuserve.broker.registry import Registry, Worker

#: A worker a JOBS message could not reach, with the ids of the jobs that message held.
Unreachable = tuple[Worker, tuple[bytes, ...]]


class Placement:
    """Puts jobs on workers with spare credit and sends each worker its jobs per turn."""

    def __init__(
        self,
        registry: Registry,
        dispatcher: Dispatcher,
        backlog: Backlog,
        metrics: BrokerMetrics,
        limits: wire.Limits,
    ) -> None:
        self._workers = registry.workers
        self._dispatcher = dispatcher
        self._queued = dispatcher.total
        self._backlog = backlog
        self._metrics = metrics
        self._limits = limits
        #: jobs placed on each worker since the last flush (a worker's jobs stay in order)
        self._outgoing: dict[Worker, list[JobEntry]] = {}
        #: jobs waiting for :meth:`flush`
        self.unsent = 0

    def place(self, job: JobEntry, now: float) -> None:
        """On the least-loaded worker of its model version with spare credit, else in its queue
        (which may refuse it OVERLOADED)."""
        worker = self._dispatcher.choose(job.key)
        if worker is None:
            self._dispatcher.enqueue(job)
        else:
            self.start(worker, job, now)

    def pump(self, worker: Worker) -> None:
        """Fill a worker's spare credit from the queues of the models it serves."""
        if self._workers.get(worker.identity) is worker:
            self.fill(worker)

    def fill(self, worker: Worker) -> None:
        """:meth:`pump` for a worker known to be registered."""
        if len(worker.in_flight) >= worker.credit or not self._queued.jobs:
            return
        now = time.monotonic()
        while len(worker.in_flight) < worker.credit:
            job = self._dispatcher.next_for(worker)
            if job is None:
                return
            self.start(worker, job, now)

    def start(self, worker: Worker, job: JobEntry, now: float) -> None:
        """The job is the worker's from now on (it uses credit); it leaves at the next flush."""
        job.state, job.worker, job.dispatched = State.RUNNING, worker, now
        job.queued_s += now - job.enqueued_at
        job.attempts += 1
        job.holders.append((worker.identity, worker.worker_id))
        worker.in_flight[job.job_id] = job
        batch = self._outgoing.get(worker)
        if batch is None:
            self._outgoing[worker] = [job]
        else:
            batch.append(job)
        self.unsent += 1
        if len(job.holders) == 1:  # once per request: a re-queued job's wait is in its timing
            series = self._metrics.of(*job.key)  # the version it is placed on
            series.queue_seconds.observe_many(now - job.received, len(job.request_ids))

    def flush(self) -> list[Unreachable]:
        """Send every worker the jobs placed on it since the last flush, as JOBS; the
        workers that could not be reached, for the caller to drop (their jobs, these
        included, then go back to the queues and may be placed on others: call again)."""
        lost: list[Unreachable] = []
        outgoing = self._outgoing
        while outgoing:
            worker, batch = outgoing.popitem()
            if self._workers.get(worker.identity) is not worker:
                continue  # dropped since: its jobs were re-queued
            jobs = batch
            for job in batch:
                if job.state is not State.RUNNING:
                    jobs = self._live(worker, batch)
                    break
            if jobs and not self._send(worker, jobs):
                lost.append((worker, tuple(job.job_id for job in batch)))
        self.unsent = 0
        return lost

    def flush_worker(self, worker: Worker) -> Unreachable | None:
        """Send now the jobs placed on ``worker`` since the last flush: what must reach it
        before a message sent next (a credit's echo: they were placed under the old one).
        The worker and its jobs' ids if it could not be reached."""
        batch = self._outgoing.pop(worker, None)
        if batch is None:
            return None
        jobs = self._live(worker, batch)
        self.unsent = max(0, self.unsent - len(batch))
        if jobs and not self._send(worker, jobs):
            return worker, tuple(job.job_id for job in batch)
        return None

    def _live(self, worker: Worker, batch: list[JobEntry]) -> list[JobEntry]:
        """The batch without jobs answered since they were placed (expired in the same
        turn): never sent, so the worker will not answer them, so they free its credit."""
        for job in batch:
            if job.state is not State.RUNNING:
                worker.in_flight.pop(job.job_id, None)
        return [job for job in batch if job.state is State.RUNNING]

    def _send(self, worker: Worker, jobs: list[JobEntry]) -> bool:
        now = time.monotonic()
        message = wire.Jobs(
            tuple(
                wire.Job(
                    j.job_id,
                    j.model,
                    j.tensors,
                    None if j.deadline is None else (j.deadline - now) * 1000,
                    j.samples,
                    j.key[1],
                )
                for j in jobs
            )
        )
        for frames in wire.encode_batch(message, self._limits):
            if not self._backlog.to_worker(worker.identity, frames):
                return False
        return True
