"""A worker node: the socket loop between the broker and a :class:`Backend`.

One thread (the caller of :meth:`WorkerNode.run`, normally the main thread) owns the
DEALER socket; nothing else touches it. Backend threads report outcomes through a
:class:`Mailbox` (a deque plus an eventfd the loop polls beside the socket).

Life of a connection: fresh DEALER -> HELLO -> WELCOME (epoch, heartbeat, liveness)
-> serve JOBS, heartbeat both ways. Outcomes (results and failures) collect during
a turn of the loop and leave at its end as one RESULTS message. The loop leaves a
connection when the broker is silent past its liveness window, asks us to RECONNECT
(it restarted and does not know us) or shows a new epoch; it then reconnects with
exponential backoff on a fresh socket. Results of jobs received under an older epoch
are dropped: that broker is gone and its successor never heard of those jobs. On
:meth:`request_stop` (SIGTERM) it drains: credit 0, finish what runs within the drain
timeout, send the results, hand the rest back in BYE, exit.
"""

from __future__ import annotations

import enum
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

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
from ipuserve.worker.backend import Backend, Job, Mailbox, Outcome, Result
from ipuserve.worker.config import WorkerConfig
from ipuserve.worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)

#: A worker still without a WELCOME this long after it began (re)joining its broker
#: says so at WARNING, then again every JOIN_WARNING_EVERY_S while it keeps retrying.
JOIN_WARNING_AFTER_S = 3.0
JOIN_WARNING_EVERY_S = 30.0


class Exit(enum.Enum):
    """Why the loop left a connection."""

    STOP = "stop requested"
    SILENT = "broker silent past its liveness window"
    RECONNECT = "broker asked us to reconnect (it does not know us)"
    NEW_EPOCH = "broker restarted (new epoch)"


@dataclass(slots=True)
class Held:
    """A job this worker holds, and which broker epoch gave it to us."""

    job: Job
    epoch: str
    received: float
    submitted: float = 0.0
    #: a group job: this many requests joined along the batching dimension
    members: int = 1


@dataclass(slots=True)
class Session:
    socket: zmq.Socket[Any]
    epoch: str
    heartbeat_s: float
    liveness_s: float
    last_heard: float
    #: the broker's payload limit (from WELCOME): bigger outputs are failed here, not sent
    max_payload_bytes: int
    next_heartbeat: float = 0.0


class WorkerNode:
    """Serves one backend to one broker until stopped; :meth:`run` returns the exit code."""

    def __init__(
        self,
        backend: Backend,
        config: WorkerConfig,
        context: zmq.Context[Any] | None = None,
        on_joined: Callable[[str], None] | None = None,
    ) -> None:
        self._backend = backend
        #: a backend written before room_for existed takes every job it is handed
        self._paced = hasattr(backend, "room_for")
        #: the backend's job metrics, if it keeps any (the ModelRunner backend does)
        self._metrics: WorkerMetrics | None = getattr(backend, "metrics", None)
        #: told (a one-line description) each time the broker lets this worker in
        self._on_joined = on_joined
        self._config = config
        self._context = context or zmq.Context.instance()
        self._models = {spec.name: spec for spec in backend.describe()}
        self._credit = config.credit or backend.capacity()
        self._limits = wire.Limits(max_payload_bytes=config.max_payload_bytes)
        self._mailbox = Mailbox()
        #: the books below and the socket: held by the serving loop except while it
        #: waits, and by a backend thread sending a result itself (:meth:`_on_done`)
        self._lock = threading.Lock()
        self._serving = False
        self._stopping = False
        self._session: Session | None = None
        self._epoch: str | None = None
        self._jobs: dict[bytes, Held] = {}
        self._waiting: deque[Held] = deque()
        #: no waiting job expires before this (monotonic seconds)
        self._next_expiry = math.inf
        self._running = 0
        self._unsent: list[Outcome] = []
        self._draining: list[bytes] | None = None
        #: outcomes of this turn of the loop, sent together by _flush
        self._results: list[wire.Result] = []
        self._failures: list[wire.Fail] = []
        #: while joining: when it began, when to warn next, what answered HELLO instead
        self._joining_since = 0.0
        self._join_warning_at = 0.0
        self._join_answer: str | None = None
        #: what run() returns when the loop ends without serving (1: refused)
        self._exit_code = 0

    # ------------------------------------------------------------ lifecycle

    def request_stop(self) -> None:
        """Ask the loop to drain and exit; safe from a signal handler or another thread."""
        self._stopping = True
        self._mailbox.wake()

    def run(self) -> int:
        log.info(
            "worker %s starting: models %s, credit %d, broker %s",
            self._config.worker_id,
            ", ".join(self._models),
            self._credit,
            self._config.broker,
        )
        try:
            return self._run()
        except Exception:
            log.exception("worker %s: the socket loop crashed", self._config.worker_id)
            return 1
        finally:
            self._close_session(linger=0)
            self._backend.close()
            self._mailbox.close()
            log.info("worker %s closed", self._config.worker_id)

    def _run(self) -> int:
        while not self._stopping:
            if not self._connect():
                break
            why = self._serve()
            level = logging.INFO if why is Exit.STOP else logging.WARNING  # asked, or not
            log.log(level, "worker %s leaves the broker: %s", self._config.worker_id, why.value)
            if why is Exit.STOP:
                self._drain()
                return 0
            self._close_session(linger=0)
        log.info("worker %s stopping while disconnected", self._config.worker_id)
        return self._exit_code

    # ------------------------------------------------------------ connecting

    def _connect(self) -> bool:
        """HELLO until WELCOME, backing off between attempts; False if asked to stop."""
        delay = self._config.reconnect_min_ms / 1000
        self._joining_since = time.monotonic()
        self._join_warning_at = self._joining_since + JOIN_WARNING_AFTER_S
        self._join_answer = None
        while not self._stopping:
            if self._handshake():
                return True
            if self._stopping:  # asked to, or refused: no retry to announce
                break
            log.info("no WELCOME from %s; retrying in %.0f ms", self._config.broker, delay * 1e3)
            self._wait(delay)
            delay = min(2 * delay, self._config.reconnect_max_ms / 1000)
        return False

    def _handshake(self) -> bool:
        sock = self._new_socket()
        hello = wire.Hello(self._config.worker_id, tuple(self._models.values()), self._credit)
        wire.send(sock, hello.encode())
        deadline = time.monotonic() + self._config.handshake_timeout_ms / 1000
        poller = self._poller(sock)
        while not self._stopping and (left := deadline - time.monotonic()) > 0:
            events = dict(poller.poll(self._join_poll_ms(left)))
            if self._mailbox.fd in events:
                self._unsent.extend(self._finish(self._mailbox.take()))
            if sock in events and self._welcomed(sock):
                return True
            self._warn_if_not_joined()
        sock.close(linger=0)
        return False

    def _join_poll_ms(self, left: float) -> int:
        """A poll timeout for ``left`` seconds that wakes in time for the next warning."""
        until_warning = max(0.0, self._join_warning_at - time.monotonic())
        return int(min(left, until_warning) * 1000) + 1

    def _warn_if_not_joined(self) -> None:
        """WARNING (now and then) that the broker has not let us in: silence would look
        like a working worker that gets no traffic."""
        now = time.monotonic()
        if now < self._join_warning_at:
            return
        self._join_warning_at = now + JOIN_WARNING_EVERY_S
        broker = self._config.broker
        if self._join_answer is not None:
            hint = (
                f"it answered HELLO with {self._join_answer}: that is no broker's backend, "
                "likely its frontend (client) endpoint; point --broker at the broker's "
                "backend (worker) endpoint, e.g. tcp://HOST:5556"
            )
        else:
            hint = (
                "check that the broker is running and that this is its backend (worker) "
                "endpoint, e.g. tcp://HOST:5556, not its frontend (client) one"
            )
        log.warning(
            "worker %s has not joined the broker at %s after %.0f s (no WELCOME to its "
            "HELLO); still retrying: %s",
            self._config.worker_id,
            broker,
            now - self._joining_since,
            hint,
        )

    def _welcomed(self, sock: zmq.Socket[Any]) -> bool:
        try:
            message = wire.decode(wire.recv(sock), self._limits)
        except IpuserveError as exc:
            log.warning("malformed message during the handshake: %s", exc)
            self._join_answer = f"a malformed message ({exc})"
            return False
        if isinstance(message, wire.ErrorReply):  # what a frontend says to a HELLO
            self._join_answer = f"ERROR {message.code} ({message.message})"
        if not isinstance(message, wire.Welcome):
            return False
        if self._refused_everything(sock, message):
            return False
        self._start_session(sock, message)
        return True

    def _refused_everything(self, sock: zmq.Socket[Any], welcome: wire.Welcome) -> bool:
        """Say which models the broker refused; if it refused them all, leave (BYE) and
        stop with exit code 1, so that an operator or a supervisor sees it and a restart
        tries again, rather than idle as a worker that gets no traffic."""
        for model, why in welcome.refused:
            log.error("the broker at %s refused model %r: %s", self._config.broker, model, why)
        refused = {model for model, _why in welcome.refused}
        if not refused or set(self._models) - refused:
            return False
        wire.send(sock, wire.Bye().encode())
        sock.close(linger=1000)  # let the BYE go: the broker then drops us at once
        log.error(
            "worker %s stops: the broker refused every model it serves",
            self._config.worker_id,
        )
        self._exit_code = 1
        self._stopping = True
        return True

    def _start_session(self, sock: zmq.Socket[Any], welcome: wire.Welcome) -> None:
        if welcome.epoch != self._epoch:
            self._forget_epoch(self._epoch)
        self._epoch = welcome.epoch
        heartbeat_s = min(self._config.heartbeat_ms, welcome.heartbeat_ms) / 1000
        now = time.monotonic()
        self._session = Session(
            sock,
            welcome.epoch,
            heartbeat_s,
            welcome.liveness_ms / 1000,
            now,
            welcome.max_payload_bytes,
        )
        log.info(
            "worker %s registered with %s (epoch %s, credit %d)",
            self._config.worker_id,
            self._config.broker,
            welcome.epoch,
            self._credit,
        )
        if self._on_joined is not None:
            self._on_joined(
                f"worker {self._config.worker_id} joined the broker at {self._config.broker}, "
                f"serving {', '.join(self._models)} (credit {self._credit})"
            )
        unsent, self._unsent = self._unsent, []
        for job, outcome in unsent:
            self._answer(job, outcome)
        self._flush()

    def _forget_epoch(self, epoch: str | None) -> None:
        """Drop what an older broker gave us: its waiting jobs and its unsent results."""
        if epoch is None:
            return
        dropped = len(self._unsent) + len(self._waiting)
        for job, _outcome in self._unsent:
            self._jobs.pop(job.job_id, None)
        for held in self._waiting:
            self._jobs.pop(held.job.job_id, None)
        self._unsent.clear()
        self._waiting.clear()
        self._failures.clear()  # refusals of its jobs, made while disconnected
        running = sum(1 for held in self._jobs.values() if held.epoch == epoch)
        log.warning(
            "a new broker (the old one restarted): dropped %d waiting job(s) and unsent "
            "result(s) of the old one; %d job(s) of it are already running and will be "
            "finished, their results dropped (the clients re-send them to the new broker)",
            dropped,
            running,
        )

    def _new_socket(self) -> zmq.Socket[Any]:
        sock: zmq.Socket[Any] = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.MAXMSGSIZE, wire.max_frame_bytes(self._config.max_payload_bytes))
        sock.connect(self._config.broker)
        return sock

    def _poller(self, sock: zmq.Socket[Any]) -> zmq.Poller:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._mailbox.fd, zmq.POLLIN)
        return poller

    def _wait(self, seconds: float) -> None:
        """Sleep, but wake at once for a stop request (the mailbox fd is its doorbell)."""
        deadline = time.monotonic() + seconds
        poller = zmq.Poller()
        poller.register(self._mailbox.fd, zmq.POLLIN)
        while not self._stopping and (left := deadline - time.monotonic()) > 0:
            if poller.poll(self._join_poll_ms(left)):
                self._unsent.extend(self._finish(self._mailbox.take()))
            self._warn_if_not_joined()

    def _close_session(self, linger: int) -> None:
        if self._session is not None:
            self._session.socket.close(linger=linger)
            self._session = None

    # ------------------------------------------------------------ serving

    def _serve(self) -> Exit:
        """Serve the broker until a reason to leave.

        The loop holds ``_lock`` -- the node's books and the socket -- for all of its
        work and releases it only while it waits. So a backend thread that finishes a
        job while the loop waits takes the lock and sends the result itself
        (:meth:`_on_done`): no hand-off back to this thread. The wait is on the socket's
        file descriptor (``zmq.FD``), not on the socket: polling the socket would use
        it, and the socket may only be used under the lock. That descriptor is
        edge-triggered, so the turn waits only while ``zmq.EVENTS`` says nothing is
        readable, and whoever used the socket under the lock checks it before letting
        go (:meth:`_on_done` wakes the loop if a message came in meanwhile)."""
        session = self._session
        assert session is not None
        sock = session.socket
        poller = zmq.Poller()
        poller.register(sock.getsockopt(zmq.FD), zmq.POLLIN)
        poller.register(self._mailbox.fd, zmq.POLLIN)
        with self._lock:
            self._serving = True
            try:
                while not self._stopping:
                    woken = False
                    if not self._mailbox.ready and not wire.readable(sock):
                        woken = self._wait_unlocked(poller, self._timeout_ms(session))
                    if (why := self._read(session)) is not None:
                        return why
                    if woken or self._mailbox.ready:
                        self._deliver()  # what finished while we read joins this RESULTS
                    self._expire_waiting(time.monotonic())
                    self._flush()
                    if (why := self._tick(session)) is not None:
                        return why
                return Exit.STOP
            finally:
                self._serving = False

    def _wait_unlocked(self, poller: zmq.Poller, timeout_ms: int) -> bool:
        """Wait without the lock; True if the mailbox's eventfd woke us."""
        self._lock.release()
        try:
            return any(fd == self._mailbox.fd for fd, _ in poller.poll(timeout_ms))
        finally:
            self._lock.acquire()

    def _on_done(self, job: Job, outcome: Result | IpuserveError) -> None:
        """A backend thread's outcome: sent from that thread when the loop is waiting and
        nothing else is due (a lone request's result takes no hand-off), else handed to
        the loop through the mailbox, where outcomes of one turn leave together."""
        if self._waiting or not self._lock.acquire(blocking=False):
            self._mailbox.put(job, outcome)
            return
        try:
            if not self._serving or self._waiting or self._mailbox.ready:
                self._mailbox.put(job, outcome)  # the loop's turn is due anyway: keep order
                return
            self._running -= 1
            held = self._jobs.get(job.job_id)
            if held is not None and held.job is job:
                self._answer(job, outcome)
            self._flush()
            session = self._session
            if session is not None and wire.readable(session.socket):
                self._mailbox.wake()  # our use of the socket may have eaten the loop's edge
        finally:
            self._lock.release()

    def _timeout_ms(self, session: Session) -> int:
        wake = min(
            session.next_heartbeat, session.last_heard + session.liveness_s, self._next_expiry
        )
        return max(0, int((wake - time.monotonic()) * 1000) + 1)

    def _read(self, session: Session) -> Exit | None:
        """Handle every message waiting on the socket."""
        while (frames := wire.try_recv(session.socket)) is not None:
            session.last_heard = time.monotonic()
            why = self._on_message(session, frames)
            if why is not None:
                return why
        return None

    def _on_message(self, session: Session, frames: list[Any]) -> Exit | None:
        try:
            message = wire.decode(frames, self._limits)
        except IpuserveError as exc:
            self._on_malformed(frames, exc)
            return None
        if isinstance(message, wire.Jobs):
            self._on_jobs(message)
        elif isinstance(message, wire.Reconnect):
            return Exit.RECONNECT
        elif isinstance(message, wire.Welcome) and message.epoch != session.epoch:
            return Exit.NEW_EPOCH
        return None

    def _on_malformed(self, frames: list[Any], error: IpuserveError) -> None:
        """Nobody to answer but the jobs a JOBS we cannot read names: they fail."""
        log.warning("malformed message from the broker: %s", error)
        self._failures += [wire.Fail.of(job_id, error) for job_id in wire.peek_ids(frames)]

    def _on_jobs(self, message: wire.Jobs) -> None:
        self._failures += message.rejected
        if self._draining is not None:
            self._draining += [job.job_id for job in message.jobs]
            return
        for job in message.jobs:
            if job.job_id in self._jobs:
                continue  # a re-sent job we already hold
            try:
                held = self._accept(job)
            except IpuserveError as exc:
                self._refuse(job.job_id, job.model, exc)
                continue
            self._jobs[job.job_id] = held
            self._waiting.append(held)
            if held.job.deadline is not None:
                self._next_expiry = min(self._next_expiry, held.job.deadline)
        self._submit_waiting()

    def _accept(self, message: wire.Job) -> Held:
        """Stamp a job's deadline and count its samples, once.

        The broker checked its tensors against the model's schema before forwarding it
        (it owns that check: docs/architecture.md §2); the worker checks only what the
        broker cannot know -- that this worker serves the model, its own load, and how
        much of the job's budget is left on arrival."""
        spec = self._models.get(message.model)
        if spec is None:
            raise UnknownModelError(f"this worker does not serve model {message.model!r}")
        members = message.tensors.members
        if members > 1 and not spec.groupable:
            raise InvalidInputError(
                f"model {spec.name!r} cannot take a group of requests: not every tensor has "
                f"its batching dimension ({spec.batching_dim})"
            )
        if len(self._jobs) >= 2 * self._credit:
            raise OverloadedError(
                f"worker holds {len(self._jobs)} jobs; its credit is {self._credit}"
            )
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
        samples = members * spec.samples(t.shape for t in message.tensors.specs)
        job = Job(message.job_id, message.model, inputs, deadline, samples)
        assert self._epoch is not None
        return Held(job, self._epoch, now, members=members)

    def _submit_waiting(self) -> None:
        """Hand waiting jobs to the backend while fewer than credit run and it has room:
        all that may start now in one call, so the backend can run them together. A
        job whose deadline passed while it waited here is answered, not started.
        Jobs the backend refused at once free their room: the next waiting ones go
        then, not at the next JOBS or result (after a device fault there may be none)."""
        while self._start_waiting():
            pass

    def _start_waiting(self) -> bool:
        """One hand-over; True if the backend refused some and others still wait."""
        candidates: list[Held] = []
        now = time.monotonic()
        while self._waiting and self._running + len(candidates) < self._credit:
            held = self._waiting.popleft()
            if held.job.expired(now):
                self._expired(held)
                continue
            candidates.append(held)
        if not candidates:
            return False
        room = (
            self._backend.room_for([held.job for held in candidates])
            if self._paced
            else len(candidates)
        )
        self._waiting.extendleft(reversed(candidates[room:]))
        starting = [held.job for held in candidates[:room]]
        for held in candidates[:room]:
            held.submitted = now
        self._running += len(starting)
        if not starting:
            return False
        refused = self._backend.submit_all(starting, self._on_done)
        for job, error in refused:
            self._running -= 1
            self._jobs.pop(job.job_id, None)
            self._refuse(job.job_id, job.model, error)
        return bool(refused) and bool(self._waiting)

    def _expired(self, held: Held) -> None:
        self._jobs.pop(held.job.job_id, None)
        waited = "the job's deadline passed while it waited at the worker"
        self._refuse(held.job.job_id, held.job.model, DeadlineExceeded(waited))

    def _expire_waiting(self, now: float) -> None:
        """Answer waiting jobs at their deadline, not at the next event that starts jobs
        (the broker has answered their clients; they must not hold credit meanwhile)."""
        if now < self._next_expiry:
            return
        keep: deque[Held] = deque()
        for held in self._waiting:
            if held.job.expired(now):
                self._expired(held)
            else:
                keep.append(held)
        self._waiting = keep
        deadlines = [h.job.deadline for h in keep if h.job.deadline is not None]
        self._next_expiry = min(deadlines, default=math.inf)

    def _refuse(self, job_id: bytes, model: str, error: IpuserveError) -> None:
        """Answer a job the backend never ran, and count it among the jobs answered (the
        backend counts those it ran)."""
        self._failures.append(wire.Fail.of(job_id, error))
        if self._metrics is not None:
            self._metrics.refused(model, error.code)

    def _deliver(self) -> None:
        for job, outcome in self._finish(self._mailbox.take()):
            self._answer(job, outcome)

    def _finish(self, outcomes: deque[Outcome]) -> list[Outcome]:
        """Account for finished jobs; keep the outcomes still worth sending."""
        keep = []
        for job, outcome in outcomes:
            self._running -= 1
            held = self._jobs.get(job.job_id)
            if held is not None and held.job is job:
                keep.append((job, outcome))
        self._submit_waiting()
        return keep

    def _answer(self, job: Job, outcome: Result | IpuserveError) -> None:
        held = self._jobs.pop(job.job_id)
        if held.epoch != self._epoch:
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
        self._results.append(wire.Result(job.job_id, tensors, self._timing(held, outcome)))

    def _sendable(self, outcome: Result, held: Held) -> wire.Tensors:
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
        if self._session is not None and nbytes > self._session.max_payload_bytes:
            what = "request" if tensors.members == 1 else f"group of {tensors.members} requests"
            raise PayloadTooLargeError(
                f"the outputs of this {what} take {nbytes} bytes; the broker's "
                f"limit is {self._session.max_payload_bytes} (--max-payload-bytes)"
            )
        return tensors

    def _flush(self) -> None:
        """Send this turn's outcomes as RESULTS (several if one would be too big)."""
        if not self._results and not self._failures:
            return
        message = wire.Results(tuple(self._results), tuple(self._failures))
        self._results.clear()
        self._failures.clear()
        for frames in wire.encode_batch(message, self._limits):
            self._send_frames(frames, "RESULTS")

    @staticmethod
    def _timing(held: Held, result: Result) -> dict[str, float]:
        timing = {k: v for k, v in result.timing.items() if k != "queue_us"}
        waited = (held.submitted - held.received) * 1e6 + result.timing.get("queue_us", 0.0)
        timing["worker_queue_us"] = waited
        timing["worker_us"] = (time.monotonic() - held.received) * 1e6
        return timing

    def _tick(self, session: Session) -> Exit | None:
        now = time.monotonic()
        if now - session.last_heard > session.liveness_s:
            return Exit.SILENT
        if now >= session.next_heartbeat:
            self._send(wire.Heartbeat(in_flight=self._held()))
            session.next_heartbeat = now + session.heartbeat_s
        return None

    def _held(self) -> int:
        """Jobs this worker holds: running, waiting, or set aside while draining."""
        return len(self._jobs) + len(self._draining or ())

    def _send(self, message: wire.Message) -> None:
        self._send_frames(message.encode(), message.COMMAND.name)

    def _send_frames(self, frames: list[wire.Frame], what: str) -> None:
        """Send without ever blocking the loop; a message the broker cannot take is dropped."""
        if self._session is None:
            return
        try:
            wire.send(self._session.socket, frames, nonblock=True)
        except zmq.Again:
            log.warning("broker not accepting messages; dropped %s", what)

    # ------------------------------------------------------------ draining

    def _drain(self) -> None:
        """Credit 0, finish what runs (within the drain timeout), hand back the rest."""
        session = self._session
        assert session is not None
        self._draining = [held.job.job_id for held in self._waiting]
        for job_id in self._draining:
            self._jobs.pop(job_id, None)
        self._waiting.clear()
        running = len(self._jobs)
        self._send(wire.Heartbeat(in_flight=self._held(), credit=0))
        self._finish_running(session)
        self._read(session)  # JOBS that arrived meanwhile are handed back too
        self._flush()
        handed_back = self._draining + list(self._jobs)
        self._send(wire.Bye(tuple(handed_back)))
        log.log(
            logging.WARNING if handed_back else logging.INFO,
            "worker %s drained: finished %d job(s), handed back %d",
            self._config.worker_id,
            running - len(self._jobs),
            len(handed_back),
        )
        self._close_session(linger=self._config.bye_linger_ms)

    def _finish_running(self, session: Session) -> None:
        deadline = time.monotonic() + self._config.drain_timeout_ms / 1000
        poller = self._poller(session.socket)
        while self._jobs and (left := deadline - time.monotonic()) > 0:
            wait = min(left, max(0.0, session.next_heartbeat - time.monotonic()))
            events = dict(poller.poll(int(wait * 1000) + 1))
            if session.socket in events and self._read(session) is not None:
                return  # the broker forgot us: nobody to send results to
            if self._mailbox.fd in events:
                self._deliver()
            self._flush()
            if time.monotonic() >= session.next_heartbeat:
                self._send(wire.Heartbeat(in_flight=self._held(), credit=0))
                session.next_heartbeat = time.monotonic() + session.heartbeat_s
