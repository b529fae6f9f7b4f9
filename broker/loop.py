"""The broker: one thread, one poll loop over the client and worker ROUTERs.

Each turn polls until a message or the first timer is due, reads what the sockets
hold (worker messages first: their results free credit) and sends what that placed,
then fires the timers that are due, if any: every timer (deadlines, heartbeats and
liveness, the start-up grace, orphaned models, unreachable and slow clients, the
shedding report) sits on one heap (:mod:`ipuserve.broker.timers`), so a turn that
only moved messages does one comparison of timer work and scans nothing. Nothing
here blocks: a reply a client's pipe cannot take yet waits in that client's backlog,
and only what a full backlog or a vanished peer cannot take is dropped and counted
(:mod:`ipuserve.broker.backlog`). :meth:`Broker.stop` may be called from any thread
or a signal handler.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

import zmq

from ipuserve import probes, transport
from ipuserve import protocol as wire
from ipuserve.broker.answers import Answers
from ipuserve.broker.backlog import Backlog
from ipuserve.broker.clients import ClientHandlers
from ipuserve.broker.config import BrokerConfig
from ipuserve.broker.dispatch import Dispatcher
from ipuserve.broker.faults import Faults
from ipuserve.broker.jobs import JobTable
from ipuserve.broker.lifecycle import Lifecycle
from ipuserve.broker.metrics import BrokerMetrics, MetricsServer
from ipuserve.broker.placement import Placement
from ipuserve.broker.registry import Registry
from ipuserve.broker.repository import RepositoryControl
from ipuserve.broker.timers import Timers
from ipuserve.broker.workers import WorkerHandlers
from ipuserve.errors import (
    BrokerShutdownError,
    IpuserveError,
    ProtocolError,
    UnauthenticatedError,
    WorkerFailedError,
)
from ipuserve.grouping import GroupSizer
from ipuserve.security import (
    BACKEND_DOMAIN,
    FRONTEND_DOMAIN,
    KeyPair,
    Role,
    ZapHandler,
    load_secret_key,
    server_socket,
)
from ipuserve.waker import Waker

log = logging.getLogger(__name__)

#: Messages read from one socket per turn before the other socket and the timers get theirs.
BATCH = 256
#: Jobs and replies that leave at once, before the turn ends: the next stage (a worker,
#: a client) starts on them while the broker reads on. Small enough to keep the
#: fabric's stages working at the same time, big enough to keep messages few.
FLUSH_ROWS = 16
#: /healthz fails when the loop has not beaten for this long (or 10 heartbeats, if
#: longer): generous, as a busy host may starve the loop for a while without harm.
LIVE_AFTER_S = 10.0


class Broker:
    """Binds on construction (so the endpoints are known), serves in :meth:`run`."""

    def __init__(self, config: BrokerConfig, context: zmq.Context[Any] | None = None) -> None:
        self.config = config
        self.epoch = secrets.token_hex(8)
        self.metrics = BrokerMetrics()
        #: the loop's state, for the probes (read from the metrics thread)
        self._running = False
        self._stopping = False
        self._beat_at = 0.0
        # first: a metrics port that cannot be bound (ConfigError) then leaves nothing open
        self.metrics_server: MetricsServer | None = None
        if config.metrics_port is not None:
            self.metrics_server = MetricsServer(
                self.metrics.registry,
                config.metrics_host,
                config.metrics_port,
                {probes.LIVE: self._live, probes.READY: self._ready},
            )
        # A context of its own unless given one: its ZAP handler (always started) binds
        # the context's one ZAP endpoint, so two brokers in one process (tests, an
        # embedding application) cannot share the process-wide instance.
        self._own_context = context is None
        self._context = context or zmq.Context()
        self._limits = wire.Limits(max_payload_bytes=config.max_payload_bytes)
        #: with keys: the broker's pair and the ZAP handler judging every handshake
        self._server_key: KeyPair | None = None
        self.zap: ZapHandler | None = None
        with contextlib.ExitStack() as undo:  # if a bind fails, close what is open
            if self.metrics_server is not None:
                undo.callback(self.metrics_server.close)
            if self._own_context:
                undo.callback(self._context.term)  # last out: after every socket closed
            if config.curve_secret_key is not None:
                self._server_key = load_secret_key(config.curve_secret_key)
            # always: without keys it admits loopback peers only (protected mode) or,
            # with config.insecure, every address; it logs which mode is in force
            self.zap = ZapHandler.from_dirs(
                self._context,
                client_keys=config.client_keys,
                worker_keys=config.worker_keys,
                admin_keys=config.admin_keys,
                insecure=config.insecure,
            )
            self.zap.start()  # before any bind: libzmq admits every peer without it
            undo.callback(self.zap.stop)
            #: the role of a message's sender now (per message: a reload revokes keys
            #: on open connections too); what an "admin only" command checks
            self.role_of = self.zap.role_of
            self._refuse_message = self.zap.refuse_message  # counts, logs, says why
            self.metrics.watch_security(self.zap)
            self._frontend = self._router(
                config.frontend, FRONTEND_DOMAIN, sndhwm=config.client_hwm, handover=True
            )
            undo.callback(self._frontend.close, linger=0)
            self._backend = self._router(
                config.backend, BACKEND_DOMAIN, sndhwm=100_000, handover=False
            )
            undo.pop_all()
        self.frontend_endpoint = _endpoint(self._frontend)
        self.backend_endpoint = _endpoint(self._backend)
        self.registry = Registry()
        self.timers = Timers()
        self._backlog = Backlog(
            self._frontend,
            self._backend,
            self.metrics,
            config.client_backlog,
            self.timers,
            config.liveness_ms / 1000,
        )
        self.jobs = JobTable()
        self.dispatcher = Dispatcher(self.registry, config.queue_limit)
        self.group_sizer = GroupSizer()
        self.placement = Placement(
            self.registry, self.dispatcher, self._backlog, self.metrics, self._limits
        )
        self.answers = Answers(
            self.registry,
            self.jobs,
            self.dispatcher,
            self._backlog,
            self.metrics,
            self.timers,
            self.group_sizer,
            config.queue_limit,
        )
        self.life = Lifecycle(
            config,
            self.registry,
            self.jobs,
            self.dispatcher,
            self.placement,
            self.answers,
            self.metrics,
            self.timers,
        )
        self._backlog.abandon = self.life.abandon_client
        self.repository = RepositoryControl(self.registry, self._backlog, self.metrics)
        self.life.worker_gone = self.repository.worker_gone
        self.life.unloading = self.repository.unloading
        now = time.monotonic()
        self._clients = ClientHandlers(
            self.epoch,
            now + config.startup_grace_s,
            config.max_payload_bytes,
            registry=self.registry,
            jobs=self.jobs,
            dispatcher=self.dispatcher,
            backlog=self._backlog,
            metrics=self.metrics,
            answers=self.answers,
            life=self.life,
            group_sizer=self.group_sizer,
        )
        welcome = wire.Welcome(
            self.epoch, config.heartbeat_ms, config.liveness_ms, config.max_payload_bytes
        )
        self._workers = WorkerHandlers(
            welcome,
            registry=self.registry,
            backlog=self._backlog,
            metrics=self.metrics,
            placement=self.placement,
            answers=self.answers,
            life=self.life,
            repository=self.repository,
        )
        self.timers.at(now, self._beat)
        self.timers.at(now + config.startup_grace_s, self._end_grace)
        self._wake = Waker()
        self._faults = Faults(log)

    def _router(
        self, endpoint: str, domain: str, *, sndhwm: int, handover: bool
    ) -> zmq.Socket[Any]:
        """A ROUTER bound to ``endpoint``; with keys, a CURVE server whose peers the ZAP
        handler judges under ``domain`` (the socket's role)."""
        sock: zmq.Socket[Any] = self._context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.ROUTER_HANDOVER, int(handover))
        sock.setsockopt(zmq.SNDHWM, sndhwm)
        sock.setsockopt(zmq.RCVHWM, 10_000)
        sock.setsockopt(zmq.MAXMSGSIZE, transport.max_frame_bytes(self.config.max_payload_bytes))
        try:
            if self.zap is not None:
                server_socket(sock, domain, self._server_key)
                self.zap.watch(sock, domain)  # counts peers that fail before ZAP too
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise OSError(f"cannot bind {endpoint}: {exc}") from exc
        except BaseException:
            sock.close(linger=0)
            raise
        return sock

    # ------------------------------------------------------------ lifecycle

    def stop(self) -> None:
        """Ask the loop to finish; safe from any thread and from a signal handler."""
        self._stopping = True
        self._wake.wake()

    def run(self) -> None:
        log.info(
            "broker listening: frontend=%s backend=%s epoch=%s metrics-port=%s",
            self.frontend_endpoint,
            self.backend_endpoint,
            self.epoch,
            self.metrics_server.port if self.metrics_server else "off",
        )
        self._beat_at, self._running = time.monotonic(), True
        try:
            self._loop()
            log.info("broker stopping: stop requested")
        except Exception:
            log.exception("broker loop crashed")
            raise
        finally:
            self._running = False
            self._shutdown()

    # ------------------------------------------------------------ probes (metrics thread)

    def _live(self) -> tuple[bool, str]:
        """Live while the loop turns: its heartbeat timer fired lately. A loop wedged in
        a handler stops beating; its workers will be dropped, and a restart is due."""
        if not self._running:
            return False, "the broker's loop is not running"
        late = time.monotonic() - self._beat_at
        if late > max(LIVE_AFTER_S, 10 * self.config.heartbeat_ms / 1000):
            return False, f"the broker's loop has not turned for {late:.0f} s"
        return probes.OK

    def _ready(self) -> tuple[bool, str]:
        """Ready while it serves: bound (since construction), loop running, not stopping."""
        if self._stopping:
            return False, "the broker is stopping"
        if not self._running:
            return False, "the broker's loop has not started"
        return probes.OK

    def _shutdown(self) -> None:
        self.answers.report_shedding(time.monotonic(), final=True)  # none left unsaid
        answered = self.life.shutdown(BrokerShutdownError("the broker is shutting down"))
        if answered:  # their clients keep them pending for the next broker
            log.info("answered %d pending request(s) BROKER_SHUTDOWN", answered)
        self._frontend.close(linger=self.config.shutdown_linger_ms)
        self._backend.close(linger=0)
        self._wake.close()
        if self.zap is not None:
            self.zap.stop()  # after its sockets: the thread holds their monitors
        if self._own_context:
            self._context.term()
        if self.metrics_server is not None:
            self.metrics_server.close()
        log.info("broker closed")

    # ------------------------------------------------------------ the loop

    def _loop(self) -> None:
        backend, frontend = self._backend, self._frontend
        # zmq_poll itself, on one list of items made once: pyzmq's Poller.poll would
        # rebuild its arguments every turn (answers come in this order: backend first)
        items: list[tuple[Any, int]] = [
            (backend, zmq.POLLIN),
            (frontend, zmq.POLLIN),
            (self._wake.fileno(), zmq.POLLIN),  # a stop request: never cleared, we leave
        ]
        heap = self.timers.heap
        monotonic, poll = time.monotonic, zmq.zmq_poll
        now = monotonic()
        while not self._stopping:
            wait = heap[0][0] - now  # until the first timer is due (+inf: none is armed)
            timeout = max(0, int(wait * 1000) + 1) if wait < 3.6e6 else -1
            for sock, _event in poll(items, timeout):
                if sock is backend:
                    self._drain(backend, self._on_worker)
                elif sock is frontend:
                    self._drain(frontend, self._on_client)
            now = monotonic()
            if heap[0][0] <= now:
                self._on_timers(now)
                now = monotonic()

    def _drain(self, sock: zmq.Socket[Any], handle: Callable[[list[Any]], None]) -> None:
        """Handle up to BATCH waiting messages (the poll said one waits), then send the jobs
        they placed: one JOBS message per worker for all of them."""
        placement, answers = self.placement, self.answers
        self._handle(handle, transport.recv(sock))
        for _ in range(BATCH - 1):
            if placement.unsent + answers.unsent >= FLUSH_ROWS:
                self.flush()
            if not transport.readable(sock):
                break
            self._handle(handle, transport.recv(sock))
        self.flush()

    def _handle(self, handle: Callable[[list[Any]], None], frames: list[Any]) -> None:
        """One message, whatever it holds: a handler answers what it cannot handle
        (INTERNAL); what escapes even that is dropped here, never the loop."""
        try:
            handle(frames)
        except Exception as exc:
            self._faults.log(exc, "the broker dropped a message it failed to answer")
            self.metrics.dropped.labels("handler_failed").inc()

    def flush(self) -> None:
        """Send what this turn placed and answered: one JOBS message per worker, one
        REPLIES per batching client (jobs first: a worker starts on them sooner)."""
        self.life.send_jobs()
        self.answers.flush()

    def _on_client(self, frames: list[Any]) -> None:
        client, body = frames[0].bytes, frames[1:]
        role = self.role_of(frames[0], FRONTEND_DOMAIN)
        if role is None:  # its key was removed from the lists since it connected
            self._refuse_revoked(client, frames[0], body)
            return
        if self._backlog.unreachable:
            self._backlog.heard_from(client)  # reachable again: it keeps its queue
        message: wire.Message | None = None
        try:
            message = wire.decode(body, self._limits)
            if type(message) is wire.Request:  # the hot one, straight to admission
                self._clients.on_request(client, message)
            elif type(message) is wire.RepositoryCommand:
                reply = self.repository.command(message, role is Role.ADMIN)
                self._backlog.to_client(client, reply.encode())
            else:
                self._clients.handle(client, message, role)
        except IpuserveError as exc:
            self._refuse(client, body, exc, getattr(message, "model", ""))
        except Exception as exc:
            self._faults.log(exc, "failed to handle a client message")
            error = IpuserveError("internal broker error; see its log")
            self._refuse(client, body, error, getattr(message, "model", ""))

    def _refuse(self, client: bytes, body: list[Any], error: IpuserveError, model: str) -> None:
        """Answer what can be addressed: each readable row of a batch, else the id."""
        for request_id in wire.peek_ids(body) or [wire.peek_id(body)]:
            self.answers.refuse(client, request_id, error, model)

    def _refuse_revoked(self, client: bytes, frame: Any, body: list[Any]) -> None:
        """A client whose key no list admits any more: every request it names is
        answered UNAUTHENTICATED (counted with the errors, and by the ZAP handler);
        the message is not decoded (a revoked peer gets no more of the parser)."""
        error = UnauthenticatedError(self._refuse_message(frame, FRONTEND_DOMAIN))
        self._refuse(client, body, error, "")

    def _on_worker(self, frames: list[Any]) -> None:
        identity, body = frames[0].bytes, frames[1:]
        if self.role_of(frames[0], BACKEND_DOMAIN) is None:  # its key was removed
            self._workers.on_revoked(identity, self._refuse_message(frames[0], BACKEND_DOMAIN))
            return
        now = time.monotonic()
        worker = self.registry.workers.get(identity)
        if worker is not None:
            worker.last_seen = now
        try:
            message = wire.decode(body, self._limits)
        except IpuserveError as exc:
            self._workers.on_malformed(worker, body, exc)
            return
        except Exception as exc:  # a decoder bug: unreadable all the same
            self._faults.log(exc, "failed to decode a message from a worker")
            self._workers.on_malformed(worker, body, ProtocolError(f"unreadable: {exc!r}"))
            return
        try:
            self._workers.handle(identity, worker, message, now)
        except Exception as exc:  # one peer's message must not stop the broker for everyone
            self._faults.log(exc, f"failed to handle a {message.COMMAND.name} from a worker")
            self.metrics.dropped.labels("worker_message_failed").inc()
            # the jobs it named may have left the worker's books: answer them, or
            # they would wait for ever (without a timeout)
            error = WorkerFailedError("internal broker error handling the worker's result")
            self.answers.fail_live(wire.peek_ids(body), error)

    # ------------------------------------------------------------ timers

    def _on_timers(self, now: float) -> None:
        """Fire what is due, then send what that placed or answered (a dropped worker's
        jobs re-queued onto others)."""
        self.timers.run(now)
        self.flush()

    def _beat(self, _arg: None, now: float) -> None:
        """Every heartbeat_ms: heartbeat the workers, drop the silent, refresh the gauges."""
        self._beat_at = now
        self._workers.beat(now)
        self._update_gauges()
        self.timers.at(now + self.config.heartbeat_ms / 1000, self._beat)

    def _end_grace(self, _arg: None, _now: float) -> None:
        self._clients.grace_until = None
        self.life.end_grace()

    def _update_gauges(self) -> None:
        self.metrics.workers.set(len(self.registry.workers))
        workers = self.registry.workers.values()
        self.metrics.in_flight.set(sum(len(w.in_flight) for w in workers))
        self.metrics.requests_in_flight.set(sum(w.requests_in_flight for w in workers))
        queues = self.dispatcher.queues
        # registered models only (0 before the first wait): during the start-up grace
        # any client may queue requests for made-up names, a label each for ever
        for key in self.registry.specs:
            queue = queues.get(key)
            queued = len(queue) if queue is not None else 0
            self.metrics.queued.labels(*key).set(queued)


def _endpoint(sock: zmq.Socket[Any]) -> str:
    return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))
