"""The life of a job: placed on a worker or queued, re-queued when its worker is lost,
answered exactly once (first result wins), expired at its deadline.

Every path that answers a client goes through :meth:`Scheduler.answer` /
:meth:`Scheduler.reject`, which retire the job; a job's worker keeps it in its
``in_flight`` (using credit) from the moment it is placed there until that worker
answers or is dropped.

Placing a job on a worker does not send it: the jobs placed on each worker wait in
its outgoing batch until :meth:`Scheduler.flush`, which the loop calls after each
batch of messages it reads, and go out as one JOBS message. One message per worker
per turn instead of one per job is most of what the broker saves under load. The
same holds towards clients that batch their requests (REQUESTS): their replies of
one turn go out together, as one REPLIES message per client.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import TypeAlias

from ipuserve import protocol as wire
from ipuserve.broker.config import BrokerConfig
from ipuserve.broker.dispatch import Dispatcher
from ipuserve.broker.jobs import JobEntry, JobTable, State
from ipuserve.broker.metrics import BrokerMetrics
from ipuserve.broker.outbox import Outbox
from ipuserve.broker.registry import Registry, Worker
from ipuserve.broker.timers import Timers
from ipuserve.errors import (
    DeadlineExceeded,
    InferenceError,
    IpuserveError,
    OverloadedError,
    UnavailableError,
    WorkerFailedError,
)
from ipuserve.grouping import GroupSizer

log = logging.getLogger(__name__)

#: What a worker said about one job: its result, or the error it failed with.
JobOutcome: TypeAlias = "wire.Result | IpuserveError"
#: Shortest time between two WARNINGs that requests are being refused OVERLOADED.
SHED_REPORT_S = 10.0


class Scheduler:
    def __init__(
        self,
        config: BrokerConfig,
        registry: Registry,
        outbox: Outbox,
        metrics: BrokerMetrics,
        timers: Timers,
    ) -> None:
        self.config = config
        self.registry = registry
        self.dispatcher = Dispatcher(registry, config.queue_limit)
        self._queued = self.dispatcher.total
        self.jobs = JobTable()
        self.timers = timers
        self.outbox = outbox
        self.metrics = metrics
        self.group_sizer = GroupSizer()
        self._limits = wire.Limits(max_payload_bytes=config.max_payload_bytes)
        self._orphan_s = config.orphan_ms / 1000
        registry.orphan_s = self._orphan_s  # an orphan is kept that long, at least
        #: jobs placed on each worker since the last flush (a worker's jobs stay in order)
        self._outgoing: dict[Worker, list[JobEntry]] = {}
        #: replies to batched requests since the last flush, by client, with their model
        self._replies: dict[bytes, list[tuple[wire.Reply, str]]] = {}
        #: jobs and replies waiting for :meth:`flush`
        self.unsent = 0
        #: OVERLOADED answers by model since the last report, from when, the next report
        self._shed: Counter[str] = Counter()
        self._shed_since = 0.0
        self._next_shed_report = 0.0
        outbox.abandon = self.abandon_client

    # ------------------------------------------------------------ placing

    def place(self, job: JobEntry, now: float) -> None:
        """Place on the least-loaded worker with spare credit, else queue (may raise
        OVERLOADED); a job with a deadline arms its timer."""
        worker = self.dispatcher.choose(job.model)
        if worker is None:
            self.dispatcher.enqueue(job)
        else:
            self._start(worker, job, now)
        if job.deadline is not None:
            self.timers.at(job.deadline, self._expire, job)

    def pump(self, worker: Worker) -> None:
        """Fill a worker's spare credit from the queues of the models it serves."""
        if self.registry.workers.get(worker.identity) is not worker:
            return
        self._fill(worker)

    def _fill(self, worker: Worker) -> None:
        """:meth:`pump` for a worker known to be registered."""
        if len(worker.in_flight) >= worker.credit or not self._queued.jobs:
            return
        now = time.monotonic()
        while len(worker.in_flight) < worker.credit:
            job = self.dispatcher.next_for(worker)
            if job is None:
                return
            self._start(worker, job, now)

    def _start(self, worker: Worker, job: JobEntry, now: float) -> None:
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
            self.metrics.queue_seconds.observe(now - job.received, len(job.request_ids))

    def flush(self) -> None:
        """Send every worker the jobs placed on it since the last flush, as JOBS messages,
        and every batching client its replies since then, as REPLIES.

        A worker we cannot reach is dropped: its jobs, these included, go back to the
        queues (these without counting an attempt: they never reached it) and may be
        placed on other workers, whose batches this same call sends.
        """
        outgoing = self._outgoing
        while outgoing:
            worker, batch = outgoing.popitem()
            if self.registry.workers.get(worker.identity) is not worker:
                continue  # dropped since: drop_worker re-queued its jobs
            jobs = batch
            for job in batch:
                if job.state is not State.RUNNING:
                    jobs = self._live(worker, batch)
                    break
            if jobs and not self._send_jobs(worker, jobs):
                handed_back = tuple(job.job_id for job in batch)
                self.drop_worker(worker, "unreachable", handed_back)
        while self._replies:
            self._send_replies(*self._replies.popitem())
        self.unsent = 0

    def flush_worker(self, worker: Worker) -> None:
        """Send now the jobs placed on ``worker`` since the last flush: what must reach it
        before a message sent next (a credit's echo: they were placed under the old one)."""
        batch = self._outgoing.pop(worker, None)
        if batch is None:
            return
        jobs = self._live(worker, batch)
        self.unsent = max(0, self.unsent - len(batch))
        if jobs and not self._send_jobs(worker, jobs):
            self.drop_worker(worker, "unreachable", tuple(job.job_id for job in batch))

    def _live(self, worker: Worker, batch: list[JobEntry]) -> list[JobEntry]:
        """The batch without jobs answered since they were placed (expired in the same
        turn): never sent, so the worker will not answer them, so they free its credit."""
        for job in batch:
            if job.state is not State.RUNNING:
                worker.in_flight.pop(job.job_id, None)
        return [job for job in batch if job.state is State.RUNNING]

    def _send_jobs(self, worker: Worker, jobs: list[JobEntry]) -> bool:
        now = time.monotonic()
        message = wire.Jobs(
            tuple(
                wire.Job(
                    j.job_id,
                    j.model,
                    j.tensors,
                    None if j.deadline is None else (j.deadline - now) * 1000,
                    j.samples,
                )
                for j in jobs
            )
        )
        for frames in wire.encode_batch(message, self._limits):
            if not self.outbox.to_worker(worker.identity, frames):
                return False
        return True

    # ------------------------------------------------------------ answering

    def on_results(self, sender: bytes, worker: Worker | None, message: wire.Results) -> None:
        """RESULTS arrived from connection ``sender`` (a registered worker, or one we
        dropped): answer each job, then refill the worker's credit once."""
        for result in message.results:
            self._on_outcome(sender, worker, result.job_id, result)
        for fail in message.failures:
            self._on_outcome(sender, worker, fail.job_id, fail.worker_exception())
        if worker is not None:
            self._fill(worker)

    def on_outcomes(
        self,
        sender: bytes,
        worker: Worker | None,
        outcomes: Sequence[tuple[bytes, JobOutcome]],
    ) -> None:
        """:meth:`on_results` for outcomes not read from a RESULTS (what an unreadable
        one named, failed)."""
        for job_id, outcome in outcomes:
            self._on_outcome(sender, worker, job_id, outcome)
        if worker is not None:
            self.pump(worker)

    def _on_outcome(
        self, sender: bytes, worker: Worker | None, job_id: bytes, outcome: JobOutcome
    ) -> None:
        if worker is not None:
            worker.in_flight.pop(job_id, None)
        job = self.jobs.get(job_id)
        if job is None:
            self.metrics.duplicates.inc()  # answered already
        elif not job.placed_on(sender, worker):
            # Any peer on the backend could once answer any job whose id it guessed,
            # without even a HELLO, and its outputs went to the client.
            self.metrics.dropped.inc(reason="result_from_stranger")
        elif type(outcome) is wire.Result:
            self.answer(job, outcome)
        elif job.worker is not worker:
            # an error from a worker the job no longer counts on (it was re-queued):
            # only a result may win from there
            self.metrics.duplicates.inc()
        else:
            assert isinstance(outcome, IpuserveError)
            self.reject(job, outcome)

    def answer(self, job: JobEntry, result: wire.Result) -> None:
        """Deliver a worker's result to the client (the first result for a live job);
        a batched request's reply waits for the flush at the end of this turn."""
        requests = len(job.request_ids)
        tensors = result.tensors
        if tensors.members != requests:
            error = InferenceError(
                f"the worker answered {tensors.members} member(s) for a job of "
                f"{requests} request(s)"
            )
            self.reject(job, error)
            return
        model = job.model
        spec = self.registry.specs.get(model)
        if spec is not None:
            problem = wire.outputs_problem(spec, tensors.specs)
            if problem is None and job.samples:
                problem = wire.batch_problem(spec, tensors.specs, job.samples // requests)
            if problem is not None:  # never forward what the model cannot have produced
                who = job.worker.worker_id if job.worker is not None else "a worker"
                self.reject(
                    job, WorkerFailedError(f"{who} answered model {model!r} with {problem}")
                )
                return
        device_us = result.timing.get("device_us")
        if device_us is not None and job.samples:
            self.group_sizer.observe(model, device_us, job.samples)
        # time queued only: not the time a worker that left held it before the re-queue
        reply = result.reply(job.request_id, job.group, "broker_queue_us", job.queued_s * 1e6)
        if job.state is State.QUEUED:  # a late result for a job queued again
            self.dispatcher.forget(job)
        self.jobs.finish(job)
        if job.batched:
            self._replies.setdefault(job.client, []).append((reply, model))
            self.unsent += 1
        elif self.outbox.to_client(job.client, reply.encode()):
            self.metrics.replies.inc(model=model)
        now = time.monotonic()
        self.metrics.request_seconds.observe(now - job.received, requests)
        self.metrics.worker_seconds.observe(now - job.dispatched, requests)

    def _send_replies(self, client: bytes, replies: list[tuple[wire.Reply, str]]) -> None:
        if len(replies) == 1 and not replies[0][0].group:
            reply, model = replies[0]
            if self.outbox.to_client(client, reply.encode()):
                self.metrics.replies.inc(model=model)
            return
        models = {id(reply): model for reply, model in replies}
        batch = wire.Replies(tuple(reply for reply, _model in replies))
        for part, frames in wire.split_batch(batch):  # the client decodes with the defaults
            if self.outbox.to_client(client, frames):
                for reply in part.replies:
                    self.metrics.replies.inc(len(reply.group) or 1, model=models[id(reply)])

    def refuse(self, client: bytes, request_id: bytes, error: IpuserveError, model: str) -> None:
        """Answer a request the broker did not accept with ``error`` (counted under its
        model: "" when the request could not be read that far)."""
        self._count_error(error, model)
        self.outbox.to_client(client, wire.error_frames(request_id, error))

    def reject(self, job: JobEntry, error: IpuserveError) -> None:
        self._retire(job)
        for request_id in job.request_ids:
            self._count_error(error, job.model)
            self.outbox.to_client(job.client, wire.error_frames(request_id, error))

    def _count_error(self, error: IpuserveError, model: str) -> None:
        """Counted under the model only if one is registered: any client may name any
        model, and a label per made-up name would grow the metrics without bound."""
        self.metrics.errors.inc(
            code=error.code, model=model if model in self.registry.specs else ""
        )
        if error.code == OverloadedError.code:
            if not self._shed:  # the first since the last report: arm the next one
                self._shed_since = now = time.monotonic()
                self.timers.at(max(now, self._next_shed_report), self._report_shedding)
            self._shed[model] += 1

    def _report_shedding(self, _arg: None, now: float) -> None:
        self.report_shedding(now)

    def report_shedding(self, now: float, *, final: bool = False) -> None:
        """A WARNING (at most every SHED_REPORT_S, and a ``final`` one at shutdown) per
        model whose requests were refused OVERLOADED: a broker turning work away must
        not do it silently."""
        if not self._shed or (now < self._next_shed_report and not final):
            return
        span = now - self._shed_since
        when = f" in the last {span:.1f} s" if span >= 0.1 else ""  # the first: just now
        for model, refused in self._shed.items():
            log.warning(
                "model %r: %d request(s) refused OVERLOADED%s: its queue is full "
                "(--queue-limit %d); more workers or a higher limit would take them",
                model,
                refused,
                when,
                self.config.queue_limit,
            )
        self._shed.clear()
        self._next_shed_report = now + SHED_REPORT_S

    def fail_live(self, job_ids: Sequence[bytes], error: IpuserveError) -> None:
        """Answer ``error`` to those of ``job_ids`` still live, freeing their workers'
        credit: what a broker bug handling their result leaves behind."""
        for job_id in job_ids:
            job = self.jobs.get(job_id)
            if job is None:
                continue
            if job.worker is not None:
                job.worker.in_flight.pop(job_id, None)
            self.reject(job, error)

    def _retire(self, job: JobEntry) -> None:
        if job.state is State.QUEUED:
            self.dispatcher.forget(job)
        self.jobs.finish(job)

    # ------------------------------------------------------------ losing workers

    def drop_worker(self, worker: Worker, reason: str, handed_back: tuple[bytes, ...] = ()) -> None:
        """Forget a worker; its live jobs go back to the front of their queues."""
        if worker.identity not in self.registry.workers:
            return
        orphaned = self.registry.orphaned
        for model in self.registry.remove(worker):  # its last worker: arm the orphan timer
            self.timers.at(orphaned[model] + self._orphan_s, self._orphan_due, model)
        self.metrics.workers_lost.inc(reason=reason)
        log.log(
            logging.INFO if reason == "left" else logging.WARNING,  # leaving is no trouble
            "worker %s dropped (%s); re-queueing the %d job(s) it did not answer "
            "(%d of them handed back by the worker)",
            worker.worker_id,
            reason,
            len(worker.in_flight),
            len(handed_back),
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
        job.enqueued_at = time.monotonic()
        self.dispatcher.requeue(job)
        self.metrics.requeued.inc()

    def _pump_models(self, models: tuple[str, ...]) -> None:
        for model in models:
            for worker in list(self.registry.serving.get(model, ())):
                self.pump(worker)

    # ------------------------------------------------------------ timers

    def _expire(self, job: JobEntry, now: float) -> None:
        """A job's deadline passed (armed by :meth:`place`): answer DEADLINE_EXCEEDED
        unless it was answered since."""
        if job.state is State.DONE:
            return
        where = "in the queue" if job.state is State.QUEUED else "at a worker"
        why = ""
        if job.state is State.QUEUED and not self.registry.serving.get(job.model):
            why = f"; no worker serves model {job.model!r} now (it waits for one to join)"
        self.reject(
            job,
            DeadlineExceeded(
                f"no result within the request's timeout of {job.timeout_ms:g} ms "
                f"(waited {(now - job.received) * 1e3:.0f} ms {where}){why}"
            ),
        )

    def orphan_error(self, model: str, now: float) -> UnavailableError | None:
        """UNAVAILABLE for ``model`` once its last worker left longer than ``orphan_ms``
        ago (nobody is coming back, most likely), else None: requests may wait."""
        since = self.registry.orphaned.get(model)
        if since is None or now - since < self._orphan_s:
            return None
        return UnavailableError(
            f"no worker has served model {model!r} for {now - since:.0f} s (its last one "
            "left); start one, or wait for it to rejoin"
        )

    def _orphan_due(self, model: str, now: float) -> None:
        """``orphan_ms`` after a model's last worker left (armed by :meth:`drop_worker`):
        refuse what is queued for it, unless a worker joined since (or it was orphaned
        again later: that has a timer of its own)."""
        queue = self.dispatcher.queues.get(model)
        error = self.orphan_error(model, now) if queue else None
        if queue and error is not None:
            for job in queue.live_jobs():
                self.reject(job, error)

    def abandon_client(self, client: bytes) -> None:
        """Drop the queued jobs of a client a reply could not reach for a liveness window
        (killed, most likely; the outbox's timer says when): nobody would read their
        results, and other clients' requests queue behind them. Jobs already at a worker
        run on; their replies are dropped as they come."""
        dropped = 0
        for queue in self.dispatcher.queues.values():
            for job in queue.live_jobs():
                if job.client == client:
                    self._retire(job)
                    self.metrics.abandoned.inc(len(job.request_ids), model=job.model)
                    dropped += len(job.request_ids)
        if dropped:
            log.info("dropped %d queued request(s) of a disconnected client", dropped)

    # ------------------------------------------------------------ models

    def model_registered(self, spec: wire.ModelSpec) -> None:
        """A model nobody served before: check what was queued for it during the grace,
        and count the samples of what passes (unknown until now)."""
        queue = self.dispatcher.queues.get(spec.name)
        for job in queue.live_jobs() if queue is not None else ():
            try:
                wire.check_inputs(spec, job.tensors.specs)
            except IpuserveError as exc:
                self.reject(job, exc)
                continue
            job.samples = len(job.request_ids) * spec.samples(t.shape for t in job.tensors.specs)

    def end_grace(self) -> None:
        """The start-up grace is over: requests for models still unknown get UNKNOWN_MODEL."""
        for model, queue in list(self.dispatcher.queues.items()):
            if model not in self.registry.specs:
                for job in queue.live_jobs():
                    self.reject(job, self.registry.unknown(model))
                del self.dispatcher.queues[model]

    def shutdown(self, error: IpuserveError) -> int:
        """Answer every live job with ``error``; how many requests that answered."""
        answered = 0
        for job in self.jobs.live():
            answered += len(job.request_ids)
            self.reject(job, error)
        return answered
