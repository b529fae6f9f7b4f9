"""A job's life between admission and its answer: placed or queued, re-queued when its
worker is lost, expired at its deadline, refused when its model has no worker left.

Admission (:mod:`ipuserve.broker.clients`) creates a job and hands it to
:meth:`Lifecycle.admit`; from there it is placed (:mod:`ipuserve.broker.placement`)
or queued, and answered exactly once (:mod:`ipuserve.broker.answers`). What can
happen to it meanwhile lives here, with the state it needs: its deadline's timer,
the worker it loses (its live jobs go back to the front of their queues, up to
``max_attempts`` workers), the start-up grace (jobs queued for a model nobody serves
yet), a model whose last worker left (its queue refused after ``orphan_ms``), a
client that disappeared (its queued jobs dropped), and the broker's shutdown.

Versions: a job waits for one model version (its ``key``). When the last worker of a
version leaves (drained by an unload: its BYE hands back what it had not started; or
dead), the jobs queued for it that named no version move to the model's new default,
if it has one and their inputs fit it: a version switch fails nothing. Those that
named the version get the orphan's treatment (they wait ``orphan_ms`` for a worker).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ipuserve import protocol as wire
from ipuserve.broker.answers import Answers
from ipuserve.broker.config import BrokerConfig
from ipuserve.broker.dispatch import Dispatcher
from ipuserve.broker.jobs import JobEntry, JobTable, State
from ipuserve.broker.metrics import BrokerMetrics
from ipuserve.broker.placement import Placement
from ipuserve.broker.registry import Registry, Worker
from ipuserve.broker.timers import Timers
from ipuserve.errors import (
    DeadlineExceeded,
    InvalidInputError,
    IpuserveError,
    UnavailableError,
    WorkerFailedError,
)
from ipuserve.grouping import group_problem
from ipuserve.versions import Key

log = logging.getLogger(__name__)


class Lifecycle:
    """What happens to admitted jobs until they are answered, and to the workers and
    clients they depend on."""

    def __init__(
        self,
        config: BrokerConfig,
        registry: Registry,
        jobs: JobTable,
        dispatcher: Dispatcher,
        placement: Placement,
        answers: Answers,
        metrics: BrokerMetrics,
        timers: Timers,
    ) -> None:
        self._max_attempts = config.max_attempts
        self._registry = registry
        self._jobs = jobs
        self._dispatcher = dispatcher
        self._placement = placement
        self._answers = answers
        self._metrics = metrics
        self._timers = timers
        self._orphan_s = config.orphan_ms / 1000
        #: dropped as unreachable, not counted yet: connection -> worker id (see
        #: :meth:`_count_drop`); the BYE may still be on its way
        self._vanished: dict[bytes, str] = {}
        self._bye_wait_s = config.heartbeat_ms / 1000
        registry.orphan_s = self._orphan_s  # an orphan is kept that long, at least
        # a deadline of an answered job is moot: the heap sheds it (not days later)
        timers.lapses(self._expire, _answered)
        #: told of every worker dropped, with why (the repository re-places a dead host's
        #: versions); set by the broker
        self.worker_gone: Callable[[Worker, str], None] = _ignore
        #: whether a version is being unloaded (the repository's: a worker reported it
        #: UNLOADING, or this broker told it to unload it); none is until the broker says
        self.unloading: Callable[[Key], bool] = _never

    def admit(self, job: JobEntry, now: float) -> None:
        """Place or queue a new job (may raise OVERLOADED); a deadline arms its timer."""
        self._placement.place(job, now)
        if job.deadline is not None:
            self._timers.at(job.deadline, self._expire, job)

    def send_jobs(self) -> None:
        """Send the jobs placed this turn; a worker they cannot reach is dropped, and
        its jobs, placed again on others, leave in this same call."""
        while lost := self._placement.flush():
            for worker, handed_back in lost:
                self.drop_worker(worker, "unreachable", handed_back)

    def send_jobs_of(self, worker: Worker) -> None:
        """:meth:`send_jobs` for one worker, now (see :meth:`Placement.flush_worker`)."""
        lost = self._placement.flush_worker(worker)
        if lost is not None:
            self.drop_worker(worker, "unreachable", lost[1])

    # ------------------------------------------------------------ losing workers

    def drop_worker(
        self,
        worker: Worker,
        reason: str,
        handed_back: tuple[bytes, ...] = (),
        *,
        blameless: bool = False,
    ) -> None:
        """Forget a worker; its live jobs go back to the front of their queues, each
        counted as a failed attempt unless handed back or ``blameless`` (dropped by
        the broker, e.g. its key revoked, not failed)."""
        if worker.identity not in self._registry.workers:
            return
        orphaned = self._registry.orphaned
        left = self._registry.remove(worker)
        for key in left:  # its last worker: arm the orphan timer
            self._timers.at(orphaned[key] + self._orphan_s, self._orphan_due, key)
        self._count_drop(worker, reason)
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
                self._requeue(job, counts=not blameless and job.job_id not in returned)
        worker.in_flight.clear()
        for key in left:
            self.move_to_default(key)
            if self.unloading(key) and self._registry.versions(key[0]) != [key[1]]:
                self._retire(key)  # unloaded beside another version: not coming back
        for key in worker.models:
            for other in list(self._registry.serving.get(key, ())):
                self._placement.pump(other)
        self.worker_gone(worker, reason)

    def joined(self, worker: Worker) -> None:
        """A worker registered: requests that named no version and wait for a version
        of its models that has no worker go to the default now (it may be this one)."""
        names = {name for name, _version in worker.models}
        for key in [k for k in self._registry.orphaned if k[0] in names]:
            self.move_to_default(key)

    def rerouted(self, worker: Worker) -> None:
        """``worker`` started or stopped taking jobs (credit 0: draining): requests that
        named no version and wait for a version none of whose workers takes jobs now
        go to the default (another version, if one takes them)."""
        serving = self._registry.serving
        for key in worker.models:
            if not any(w.credit > 0 for w in serving.get(key, ())):
                self.move_to_default(key)

    def move_to_default(self, key: Key) -> None:
        """``key`` has no worker taking jobs: what waits for it and named no version goes
        to the model's default now (if another, served one), ahead of its queue."""
        target = self._registry.defaults.get(key[0])
        if target is None or target == key or not self._registry.serving.get(target):
            return
        spec = self._registry.specs[target]
        moved: list[JobEntry] = []
        stay: list[JobEntry] = []
        for job in self._dispatcher.take_all(key):
            (moved if job.asked is None and _refit(spec, job) is None else stay).append(job)
        for job in reversed(stay):
            self._dispatcher.requeue(job)
        for job in reversed(moved):
            job.key = target
            self._dispatcher.requeue(job)
        if moved:
            log.info(
                "model %r: %d queued request(s) moved from version %s to version %s (the "
                "default now)",
                key[0],
                sum(len(job.request_ids) for job in moved),
                key[1],
                target[1],
            )
            for worker in list(self._registry.serving.get(target, ())):
                self._placement.pump(worker)

    def _count_drop(self, worker: Worker, reason: str) -> None:
        """A BYE is a departure; anything else a loss. But a worker that leaves idle
        sends its last heartbeat (credit 0) and BYE and closes at once: a broker slower
        than that finds the connection gone when it echoes the heartbeat, before it
        reads the BYE behind it, and dropped it as unreachable. The drop stands (its
        jobs go back to the queues now); only the count waits a heartbeat interval for
        that BYE (:meth:`said_bye`)."""
        if reason == "left":
            self._metrics.departures.labels("bye").inc()
        elif reason == "unreachable":
            self._vanished[worker.identity] = worker.worker_id
            due = time.monotonic() + self._bye_wait_s
            self._timers.at(due, self._vanished_due, worker.identity)
        else:
            self._metrics.workers_lost.labels(reason).inc()

    def said_bye(self, identity: bytes) -> None:
        """A BYE from a connection no longer registered: if it was dropped as
        unreachable a moment ago, that was a departure."""
        worker_id = self._vanished.pop(identity, None)
        if worker_id is not None:
            self._metrics.departures.labels("bye").inc()
            log.info("worker %s said BYE after its connection closed: it left", worker_id)

    def _vanished_due(self, identity: bytes, _now: float) -> None:
        """No BYE came within a heartbeat interval of the drop: a loss after all."""
        if self._vanished.pop(identity, None) is not None:
            self._metrics.workers_lost.labels("unreachable").inc()

    def _requeue(self, job: JobEntry, counts: bool) -> None:
        if not counts:
            job.attempts -= 1
        if job.attempts >= self._max_attempts:
            self._answers.reject(
                job,
                WorkerFailedError(
                    f"{job.attempts} workers serving model {job.model!r} failed while holding "
                    "this request"
                ),
            )
            return
        job.enqueued_at = time.monotonic()
        self._dispatcher.requeue(job)
        self._metrics.requeued.inc()

    # ------------------------------------------------------------ timers

    def _expire(self, job: JobEntry, now: float) -> None:
        """A job's deadline passed (armed by :meth:`admit`): answer DEADLINE_EXCEEDED
        unless it was answered since."""
        if job.state is State.DONE:
            return
        where = "in the queue" if job.state is State.QUEUED else "at a worker"
        why = ""
        if job.state is State.QUEUED and not self._registry.serving.get(job.key):
            why = f"; no worker serves model {_named(job.key)} now (it waits for one to join)"
        self._answers.reject(
            job,
            DeadlineExceeded(
                f"no result within the request's timeout of {job.timeout_ms:g} ms "
                f"(waited {(now - job.received) * 1e3:.0f} ms {where}){why}"
            ),
        )

    def orphan_error(self, key: Key, now: float) -> UnavailableError | None:
        """UNAVAILABLE for a model version once its last worker left longer than
        ``orphan_ms`` ago (nobody is coming back, most likely), else None: requests may
        wait."""
        since = self._registry.orphaned.get(key)
        if since is None or now - since < self._orphan_s:
            return None
        return UnavailableError(
            f"no worker has served model {_named(key)} for {now - since:.0f} s (its last "
            "one left); start or load one, or wait for it to rejoin"
        )

    def _retire(self, key: Key) -> None:
        """A version's last worker went (drained away, or died draining) while it was
        being unloaded, and another version of the model is known: it is gone, not
        orphaned. What still waits for it named it (the rest went to the default): each
        is told at once, as every later request that names it, not after ``orphan_ms``.
        The model's only version, unloaded, stays an orphan: its requests wait
        ``orphan_ms`` for another version to be loaded (an unload, then a load)."""
        self._registry.retire(key)
        error = self._registry.unknown(*key)
        queue = self._dispatcher.queues.get(key)
        for job in queue.live_jobs() if queue else ():
            self._answers.reject(job, error)
        log.info("model %s was unloaded: requests that name it are refused", _named(key))

    def _orphan_due(self, model: Key, now: float) -> None:
        """``orphan_ms`` after a model's last worker left (armed by :meth:`drop_worker`):
        refuse what is queued for it, unless a worker joined since (or it was orphaned
        again later: that has a timer of its own)."""
        queue = self._dispatcher.queues.get(model)
        error = self.orphan_error(model, now) if queue else None
        if queue and error is not None:
            for job in queue.live_jobs():
                self._answers.reject(job, error)

    def abandon_client(self, client: bytes) -> None:
        """Drop the queued jobs of a client a reply could not reach for a liveness window
        (killed, most likely; the backlog's timer says when): nobody would read their
        results, and other clients' requests queue behind them. Jobs already at a worker
        run on; their replies are dropped as they come."""
        dropped = 0
        for queue in self._dispatcher.queues.values():
            for job in queue.live_jobs():
                if job.client == client:
                    self._answers.retire(job)
                    self._metrics.abandoned.labels(job.model).inc(len(job.request_ids))
                    dropped += len(job.request_ids)
        if dropped:
            log.info("dropped %d queued request(s) of a disconnected client", dropped)

    # ------------------------------------------------------------ models

    def model_registered(self, spec: wire.ModelSpec) -> None:
        """A model version nobody served before: check what was queued for it during the
        grace (its inputs, and a group's size, as admission would have) and count the
        samples of what passes (unknown until now). What was queued for the model
        naming no version (under :data:`GRACE_DEFAULT`) goes to its default now."""
        queue = self._dispatcher.queues.get(spec.key)
        for job in queue.live_jobs() if queue is not None else ():
            error = _refit(spec, job)
            if error is not None:
                self._answers.reject(job, error)
        target = self._registry.defaults.get(spec.name)
        waiting = (spec.name, GRACE_DEFAULT)
        if target is None or waiting not in self._dispatcher.queues:
            return
        target_spec = self._registry.specs[target]
        for job in self._dispatcher.queues[waiting].live_jobs():
            error = _refit(target_spec, job)
            if error is not None:
                self._answers.reject(job, error)
        for job in reversed(self._dispatcher.take_all(waiting)):  # older than the rest
            job.key = target
            self._dispatcher.requeue(job)
        del self._dispatcher.queues[waiting]

    def end_grace(self) -> None:
        """The start-up grace is over: requests for models still unknown get UNKNOWN_MODEL."""
        for key, queue in list(self._dispatcher.queues.items()):
            if key not in self._registry.specs:
                asked = key[1] or None
                for job in queue.live_jobs():
                    self._answers.reject(job, self._registry.unknown(key[0], asked))
                del self._dispatcher.queues[key]

    def shutdown(self, error: IpuserveError) -> int:
        """Answer every live job with ``error``; how many requests that answered."""
        answered = 0
        for job in self._jobs.live():
            answered += len(job.request_ids)
            self._answers.reject(job, error)
        return answered


#: The version of a job queued in the start-up grace for a model nobody serves yet,
#: naming no version: its default is not known until a worker registers.
GRACE_DEFAULT = ""


def _answered(job: JobEntry) -> bool:
    return job.state is State.DONE


def _ignore(_worker: Worker, _reason: str) -> None:
    """What :attr:`Lifecycle.worker_gone` does until the broker sets it."""


def _named(key: Key) -> str:
    return f"{key[0]!r} version {key[1]}" if key[1] else repr(key[0])


def _refit(spec: wire.ModelSpec, job: JobEntry) -> IpuserveError | None:
    """Check a queued job against ``spec`` as admission would (its inputs, a group's
    size) and count its samples under it; the error if it does not fit."""
    try:
        wire.check_inputs(spec, job.tensors.specs)
        member_samples = spec.samples(t.shape for t in job.tensors.specs)
        problem = group_problem(spec, len(job.request_ids), member_samples)
        if problem is not None:
            raise InvalidInputError(problem)
    except IpuserveError as exc:
        return exc
    job.samples = len(job.request_ids) * member_samples
    return None


def _never(_key: Key) -> bool:
    """What :attr:`Lifecycle.unloading` says until the broker sets it."""
    return False
