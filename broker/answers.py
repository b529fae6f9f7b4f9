"""Answering: every reply and error a client gets for its requests leaves from here.

A job is answered exactly once, by the first result for it (:meth:`Answers.answer`)
or an error (:meth:`Answers.reject`); both retire it (:meth:`Answers.retire`), so a
late result for it finds nothing and is counted a duplicate. A request the broker
never admitted is refused with :meth:`Answers.refuse`.

A lone request's reply leaves at once, from :meth:`answer`. The replies to requests
that came in a REQUESTS batch wait for :meth:`flush` at the end of the loop's turn
and leave together, as one REPLIES message per client. Errors are counted here too
(by code, and by model only when one is registered), and a model whose requests are
refused OVERLOADED is reported in the log, at most every ``SHED_REPORT_S``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import TypeAlias

from ipuserve import protocol as wire
from ipuserve.broker.backlog import Backlog
from ipuserve.broker.dispatch import Dispatcher
from ipuserve.broker.jobs import JobEntry, JobTable, State
from ipuserve.broker.metrics import BrokerMetrics, ModelSeries
from ipuserve.broker.registry import Registry, Worker
from ipuserve.broker.timers import Timers
from ipuserve.errors import InferenceError, IpuserveError, OverloadedError, WorkerFailedError
from ipuserve.grouping import GroupSizer

log = logging.getLogger(__name__)

#: What a worker said about one job: its result, or the error it failed with.
JobOutcome: TypeAlias = "wire.Result | IpuserveError"
#: Shortest time between two WARNINGs that requests are being refused OVERLOADED.
SHED_REPORT_S = 10.0


class Answers:
    """Answers jobs and refuses requests; owns the batched replies and the shed report."""

    def __init__(
        self,
        registry: Registry,
        jobs: JobTable,
        dispatcher: Dispatcher,
        backlog: Backlog,
        metrics: BrokerMetrics,
        timers: Timers,
        group_sizer: GroupSizer,
        queue_limit: int,
    ) -> None:
        self._specs = registry.specs
        self._registry = registry
        self._jobs = jobs
        self._dispatcher = dispatcher
        self._backlog = backlog
        self._metrics = metrics
        self._timers = timers
        self._group_sizer = group_sizer
        self._queue_limit = queue_limit
        #: replies to batched requests since the last flush, by client, with their model
        #: version's series (what counts them once sent)
        self._replies: dict[bytes, list[tuple[wire.Reply, ModelSeries]]] = {}
        #: replies waiting for :meth:`flush`
        self.unsent = 0
        #: OVERLOADED answers by model since the last report, from when, the next report
        self._shed: Counter[str] = Counter()
        self._shed_since = 0.0
        self._next_shed_report = 0.0

    # ------------------------------------------------------------ what workers said

    def on_results(self, sender: bytes, worker: Worker | None, message: wire.Results) -> None:
        """RESULTS arrived from connection ``sender`` (a registered worker, or one we
        dropped): answer each job. The caller refills the worker's credit."""
        for result in message.results:
            self.on_outcome(sender, worker, result.job_id, result)
        for fail in message.failures:
            self.on_outcome(sender, worker, fail.job_id, fail.worker_exception())

    def on_outcome(
        self, sender: bytes, worker: Worker | None, job_id: bytes, outcome: JobOutcome
    ) -> None:
        """One job's result or error, from ``sender``: answered unless the job is gone,
        the sender never held it, or it is an error from a worker the job left."""
        if worker is not None:
            worker.in_flight.pop(job_id, None)
        job = self._jobs.get(job_id)
        if job is None:
            self._metrics.duplicates.inc()  # answered already
        elif not job.placed_on(sender, worker):
            # Any peer on the backend could once answer any job whose id it guessed,
            # without even a HELLO, and its outputs went to the client.
            self._metrics.dropped.labels("result_from_stranger").inc()
        elif type(outcome) is wire.Result:
            self.answer(job, outcome)
        elif job.worker is not worker:
            # an error from a worker the job no longer counts on (it was re-queued):
            # only a result may win from there
            self._metrics.duplicates.inc()
        else:
            assert isinstance(outcome, IpuserveError)
            self.reject(job, outcome)

    def fail_live(self, job_ids: Sequence[bytes], error: IpuserveError) -> None:
        """Answer ``error`` to those of ``job_ids`` still live, freeing their workers'
        credit: what a broker bug handling their result leaves behind."""
        for job_id in job_ids:
            job = self._jobs.get(job_id)
            if job is None:
                continue
            if job.worker is not None:
                job.worker.in_flight.pop(job_id, None)
            self.reject(job, error)

    # ------------------------------------------------------------ answering

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
        spec = self._specs.get(job.key)
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
            self._group_sizer.observe(model, device_us, job.samples)
        # time queued only: not the time a worker that left held it before the re-queue
        reply = result.reply(
            job.request_id, job.group, "broker_queue_us", job.queued_s * 1e6, job.key[1]
        )
        self.retire(job)  # queued: a late result for a job queued again
        series = self._metrics.of(*job.key)  # the version it was placed on
        if job.batched:
            self._replies.setdefault(job.client, []).append((reply, series))
            self.unsent += 1
        elif self._backlog.to_client(job.client, reply.encode()):
            series.replies.inc()
        now = time.monotonic()
        series.request_seconds.observe_many(now - job.received, requests)
        series.worker_seconds.observe_many(now - job.dispatched, requests)

    def flush(self) -> None:
        """Send every batching client its replies since the last flush, as REPLIES (a
        lone reply to a single request as a REPLY)."""
        replies = self._replies
        while replies:
            self._send_replies(*replies.popitem())
        self.unsent = 0

    def _send_replies(self, client: bytes, replies: list[tuple[wire.Reply, ModelSeries]]) -> None:
        if len(replies) == 1 and not replies[0][0].group:
            reply, series = replies[0]
            if self._backlog.to_client(client, reply.encode()):
                series.replies.inc()
            return
        counted = {id(reply): series for reply, series in replies}
        batch = wire.Replies(tuple(reply for reply, _series in replies))
        for part, frames in wire.split_batch(batch):  # the client decodes with the defaults
            if self._backlog.to_client(client, frames):
                for reply in part.replies:
                    counted[id(reply)].replies.inc(len(reply.group) or 1)

    def retire(self, job: JobEntry) -> None:
        """The job is done: out of its queue (if queued) and out of the live jobs."""
        if job.state is State.QUEUED:
            self._dispatcher.forget(job)
        self._jobs.finish(job)

    # ------------------------------------------------------------ errors

    def refuse(self, client: bytes, request_id: bytes, error: IpuserveError, model: str) -> None:
        """Answer a request the broker did not accept with ``error`` (counted under its
        model: "" when the request could not be read that far)."""
        self._count_error(error, model)
        self._backlog.to_client(client, wire.error_frames(request_id, error))

    def reject(self, job: JobEntry, error: IpuserveError) -> None:
        """Answer every request of an admitted job with ``error``, and retire it."""
        self.retire(job)
        for request_id in job.request_ids:
            self._count_error(error, job.model)
            self._backlog.to_client(job.client, wire.error_frames(request_id, error))

    def _count_error(self, error: IpuserveError, model: str) -> None:
        """Counted under the model only if one is registered: any client may name any
        model, and a label per made-up name would grow the metrics without bound."""
        known = self._registry.known_name(model)
        self._metrics.errors.labels(error.code, model if known else "").inc()
        if error.code == OverloadedError.code:
            if not self._shed:  # the first since the last report: arm the next one
                self._shed_since = now = time.monotonic()
                self._timers.at(max(now, self._next_shed_report), self._report_shedding)
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
                self._queue_limit,
            )
        self._shed.clear()
        self._next_shed_report = now + SHED_REPORT_S
