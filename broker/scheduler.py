"""The life of a job: placed on a worker or queued, re-queued when its worker is lost,
answered exactly once (first result wins), expired at its deadline.

Every path that answers a client goes through :meth:`Scheduler.answer` /
:meth:`Scheduler.reject`, which retire the job; a job's worker keeps it in its
``in_flight`` (using credit) until that worker answers or is dropped.
"""

from __future__ import annotations

import logging
import time

from ipuserve import protocol as wire
from ipuserve.broker.config import BrokerConfig
from ipuserve.broker.dispatch import Dispatcher
from ipuserve.broker.jobs import Deadlines, JobEntry, JobTable, State
from ipuserve.broker.metrics import BrokerMetrics
from ipuserve.broker.outbox import Outbox
from ipuserve.broker.registry import Registry, Worker
from ipuserve.errors import (
    DeadlineExceeded,
    IpuserveError,
    UnknownModelError,
    WorkerFailedError,
)

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        config: BrokerConfig,
        registry: Registry,
        outbox: Outbox,
        metrics: BrokerMetrics,
    ) -> None:
        self.config = config
        self.registry = registry
        self.dispatcher = Dispatcher(registry, config.queue_limit)
        self.jobs = JobTable()
        self.deadlines = Deadlines()
        self.outbox = outbox
        self.metrics = metrics

    # ------------------------------------------------------------ placing

    def place(self, job: JobEntry) -> None:
        """Send to the least-loaded worker with spare credit, else queue (may raise OVERLOADED)."""
        while (worker := self.dispatcher.choose(job.model)) is not None:
            if self._start(worker, job):
                return
            self.drop_worker(worker, "unreachable")
        self.dispatcher.enqueue(job)

    def pump(self, worker: Worker) -> None:
        """Fill a worker's spare credit from the queues of the models it serves."""
        while worker.spare > 0 and worker.identity in self.registry.workers:
            job = self.dispatcher.next_for(worker)
            if job is None:
                return
            if not self._start(worker, job):
                self.dispatcher.requeue(job)
                self.drop_worker(worker, "unreachable")

    def _start(self, worker: Worker, job: JobEntry) -> bool:
        now = time.monotonic()
        message = wire.Job(job.job_id, job.model, job.tensors, job.budget_ms(now))
        if not self.outbox.to_worker(worker.identity, message.encode()):
            return False
        job.state, job.worker, job.dispatched = State.RUNNING, worker, now
        job.attempts += 1
        worker.in_flight[job.job_id] = job
        self.metrics.queue_seconds.observe(now - job.received)
        return True

    # ------------------------------------------------------------ answering

    def answer(self, job: JobEntry, result: wire.Result) -> None:
        """Deliver a worker's result to the client (the first result for a live job)."""
        now = time.monotonic()
        timing = dict(result.timing)
        timing["broker_queue_us"] = (job.dispatched - job.received) * 1e6
        reply = wire.Reply(job.request_id, result.tensors, timing)
        self._retire(job)
        if self.outbox.to_client(job.client, reply.encode()):
            self.metrics.replies.inc(model=job.model)
        self.metrics.request_seconds.observe(now - job.received)
        self.metrics.worker_seconds.observe(now - job.dispatched)

    def reject(self, job: JobEntry, error: IpuserveError) -> None:
        self._retire(job)
        self.metrics.errors.inc(code=error.code)
        self.outbox.to_client(job.client, wire.error_frames(job.request_id, error))

    def _retire(self, job: JobEntry) -> None:
        if job.state is State.QUEUED:
            self.dispatcher.forget(job)
        self.jobs.finish(job)

    def on_outcome(
        self, worker: Worker | None, job_id: bytes, outcome: wire.Result | IpuserveError
    ) -> None:
        """A RESULT or FAIL arrived (from a registered worker, or one we dropped)."""
        if worker is not None:
            worker.in_flight.pop(job_id, None)
        job = self.jobs.get(job_id)
        if job is None or (not isinstance(outcome, wire.Result) and job.worker is not worker):
            # Answered already; or an error from a worker the job no longer counts on
            # (it was re-queued): only a result may win from there.
            self.metrics.duplicates.inc()
        elif isinstance(outcome, wire.Result):
            self.answer(job, outcome)
        else:
            self.reject(job, outcome)
        if worker is not None:
            self.pump(worker)

    # ------------------------------------------------------------ losing workers

    def drop_worker(self, worker: Worker, reason: str, handed_back: tuple[bytes, ...] = ()) -> None:
        """Forget a worker; its live jobs go back to the front of their queues."""
        if worker.identity not in self.registry.workers:
            return
        self.registry.remove(worker)
        self.metrics.workers_lost.inc(reason=reason)
        log.warning(
            "worker %s dropped (%s); re-queueing %d job(s)",
            worker.worker_id,
            reason,
            len(worker.in_flight),
        )
        returned = set(handed_back)
        for job in reversed(list(worker.in_flight.values())):
            if job.state is State.RUNNING and job.worker is worker:
                self._requeue(job, counts=job.job_id not in returned)
        worker.in_flight.clear()
        self._pump_models(worker.models)

    def _requeue(self, job: JobEntry, counts: bool) -> None:
        if not counts:
            job.attempts -= 1
        if job.attempts >= self.config.max_attempts:
            self.reject(
                job,
                WorkerFailedError(
                    f"{job.attempts} workers serving model {job.model!r} failed while holding "
                    "this request"
                ),
            )
            return
        self.dispatcher.requeue(job)
        self.metrics.requeued.inc()

    def _pump_models(self, models: tuple[str, ...]) -> None:
        for model in models:
            for worker in list(self.registry.serving.get(model, ())):
                self.pump(worker)

    # ------------------------------------------------------------ timers and models

    def expire(self, now: float) -> None:
        for job in self.deadlines.expired(now):
            where = "in the queue" if job.state is State.QUEUED else "at a worker"
            self.reject(
                job,
                DeadlineExceeded(
                    f"no result within the request's timeout of {job.timeout_ms:g} ms "
                    f"(waited {(now - job.received) * 1e3:.0f} ms {where})"
                ),
            )

    def model_registered(self, spec: wire.ModelSpec) -> None:
        """A model nobody served before: check what was queued for it during the grace."""
        queue = self.dispatcher.queues.get(spec.name)
        for job in queue.live_jobs() if queue is not None else ():
            try:
                wire.check_inputs(spec, job.tensors.specs)
            except IpuserveError as exc:
                self.reject(job, exc)

    def end_grace(self) -> None:
        """The start-up grace is over: requests for models still unknown get UNKNOWN_MODEL."""
        for model, queue in list(self.dispatcher.queues.items()):
            if model not in self.registry.specs:
                for job in queue.live_jobs():
                    self.reject(job, UnknownModelError(f"no worker serves model {model!r}"))
                del self.dispatcher.queues[model]

    def shutdown(self, error: IpuserveError) -> None:
        for job in self.jobs.live():
            self.reject(job, error)
