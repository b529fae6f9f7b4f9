"""What the broker does with each worker command, and how it judges worker liveness.

Its collaborators come in explicitly: results go to :class:`Answers`, freed credit
is filled by :class:`Placement`, and a worker lost, registered or restarted is the
job life's business (:class:`Lifecycle`)."""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from ipuserve import protocol as wire
from ipuserve.broker.answers import Answers
from ipuserve.broker.backlog import Backlog
from ipuserve.broker.lifecycle import Lifecycle
from ipuserve.broker.metrics import BrokerMetrics
from ipuserve.broker.placement import Placement
from ipuserve.broker.registry import Registry, Worker
from ipuserve.broker.repository import RepositoryControl
from ipuserve.errors import IpuserveError, WorkerFailedError

log = logging.getLogger(__name__)


class WorkerHandlers:
    def __init__(
        self,
        welcome: wire.Welcome,
        *,
        registry: Registry,
        backlog: Backlog,
        metrics: BrokerMetrics,
        placement: Placement,
        answers: Answers,
        life: Lifecycle,
        repository: RepositoryControl,
    ) -> None:
        self._registry = registry
        self._backlog = backlog
        self._metrics = metrics
        self._placement = placement
        self._answers = answers
        self._life = life
        self._repository = repository
        self._welcome = welcome
        self._welcome_frames = welcome.encode()
        self._heartbeat = wire.Heartbeat().encode()
        self._reconnect = wire.Reconnect().encode()
        self._liveness_s = welcome.liveness_ms / 1000

    def handle(
        self, identity: bytes, worker: Worker | None, message: wire.Message, now: float
    ) -> None:
        if isinstance(message, wire.Results):  # the hot one first
            self._answers.on_results(identity, worker, message)
            if worker is not None:
                self._placement.fill(worker)  # once, for all it answered
        elif isinstance(message, wire.Hello):
            self.on_hello(identity, message, now)
        elif worker is not None and isinstance(message, wire.Heartbeat):
            self.on_heartbeat(worker, message)
        elif isinstance(message, wire.Bye):
            if worker is not None:
                self._life.drop_worker(worker, "left", message.handed_back)
            else:  # dropped already, as unreachable: its count says "departure" now
                self._life.said_bye(identity)
        elif worker is not None and isinstance(message, wire.Host):
            self._repository.on_host(worker, message)
        elif worker is not None:
            log.warning("worker %s sent %s; ignored", worker.worker_id, message.COMMAND.name)
        if worker is None and not isinstance(message, wire.Hello | wire.Bye):
            self._backlog.to_worker(identity, self._reconnect)

    def on_hello(self, identity: bytes, hello: wire.Hello, now: float) -> None:
        old = self._registry.get(identity)
        if old is not None:  # this very connection registers again
            self._life.drop_worker(old, "re-registered")
        else:
            self._forget_namesake(hello.worker_id)
        new_specs = [s for s in hello.models if s.key not in self._registry.specs]
        worker, refused = self._registry.add(identity, hello, now)
        log.info(
            "worker %s registered: models %s, credit %d",
            worker.worker_id,
            ", ".join(f"{name} v{version}" for name, version in worker.models) or "none",
            worker.credit,
        )
        for spec in new_specs:
            if spec.key in worker.models:  # not one refused
                self._life.model_registered(spec)
        welcome = self._welcome_frames
        if refused:  # the worker hears it: its own log would otherwise say it joined
            welcome = msgspec.structs.replace(self._welcome, refused=refused).encode()
        if not self._backlog.to_worker(identity, welcome):
            self._life.drop_worker(worker, "unreachable")
            return
        self._life.joined(worker)
        self._placement.pump(worker)

    def _forget_namesake(self, worker_id: str) -> None:
        """A worker restarted under its old id (a container's hostname) takes over at
        once: its predecessor's jobs go back to the queues now, not after the liveness
        window. But only if that predecessor's connection is gone (a send to it fails):
        two live workers given one --worker-id once dropped each other for ever, each
        re-registering when told it was unknown, and most requests failed."""
        namesake = self._registry.by_worker_id(worker_id)
        if namesake is None:
            return
        if self._backlog.worker_connected(namesake.identity, self._heartbeat):
            log.warning(
                "two connected workers call themselves %r; both serve, but give each its "
                "own --worker-id so that logs and `ipuserve models` tell them apart",
                worker_id,
            )
        else:
            self._life.drop_worker(namesake, "restarted")

    def on_heartbeat(self, worker: Worker, heartbeat: wire.Heartbeat) -> None:
        """A heartbeat carrying ``credit`` changes the worker's credit, and is answered by
        one carrying the credit counted from now on, after every job placed under the
        old one: a worker serving several brokers hands the room a lowered credit frees
        to another broker only then (docs/protocol.md, "Several brokers")."""
        if heartbeat.credit is None:
            return
        if heartbeat.credit != worker.credit:
            log.info(
                "worker %s changes its credit %d -> %d",
                worker.worker_id,
                worker.credit,
                heartbeat.credit,
            )
        self._life.send_jobs_of(worker)
        if self._registry.get(worker.identity) is not worker:
            return  # unreachable: dropped
        before, worker.credit = worker.credit, heartbeat.credit
        if self._registry.credit_changed(worker, before):
            self._life.rerouted(worker)
        echo = wire.Heartbeat(credit=worker.credit).encode()
        if not self._backlog.to_worker(worker.identity, echo):
            self._life.drop_worker(worker, "unreachable")
            return
        self._placement.pump(worker)

    def on_revoked(self, identity: bytes, reason: str) -> None:
        """A message from a worker whose key no list admits any more: refused unread.
        Registered, it is dropped and its jobs go to the others, none counted as a
        failed attempt (the revocation is nobody's fault); either way it is told
        RECONNECT, and its new handshake is then refused at ZAP. A worker leaves on
        the first RECONNECT, so the few messages it had on the way get one each."""
        worker = self._registry.get(identity)
        if worker is not None:
            log.warning("worker %s: %s", worker.worker_id, reason)
            self._life.drop_worker(worker, "revoked", blameless=True)
        self._backlog.to_worker(identity, self._reconnect)

    def on_malformed(self, worker: Worker | None, frames: list[Any], error: IpuserveError) -> None:
        """Nobody to answer: count it; RESULTS we cannot read fail the jobs they name."""
        self._metrics.dropped.labels("malformed_from_worker").inc()
        name = worker.worker_id if worker is not None else "an unregistered peer"
        log.warning("malformed message from %s: %s", name, error)
        if worker is not None:
            named = [job_id for job_id in wire.peek_ids(frames) if job_id in worker.in_flight]
            # the client's request was fine: say whose message was not
            failed = WorkerFailedError(f"worker {name} sent an unreadable result: {error}")
            for job_id in named:
                self._answers.on_outcome(worker.identity, worker, job_id, failed)
            self._placement.pump(worker)

    def beat(self, now: float) -> None:
        """Heartbeat every worker; drop the ones silent past the liveness window."""
        for worker in list(self._registry.workers.values()):
            if now - worker.last_seen > self._liveness_s:
                self._life.drop_worker(worker, "silent")
            elif not self._backlog.to_worker(worker.identity, self._heartbeat):
                self._life.drop_worker(worker, "unreachable")
