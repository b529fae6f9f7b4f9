"""A worker node: the socket loop between the broker and a :class:`Backend`.

Life of a connection: fresh DEALER -> HELLO -> WELCOME (:mod:`ipuserve.worker.joining`)
-> serve JOBS, heartbeat both ways (the connection's clock and non-blocking sends are
its :class:`~ipuserve.worker.connection.Connection`'s). The jobs themselves --
admission, waiting, expiry, outcomes -- are the :class:`~ipuserve.worker.jobbook.
JobBook`'s. Outcomes collect during a turn of the loop and leave at its end as one
RESULTS message. The loop leaves a connection when the broker is silent past its
liveness window, asks us to RECONNECT (it restarted and does not know us) or shows a
new epoch; it then reconnects with exponential backoff on a fresh socket. Results of
jobs received under an older epoch are dropped: that broker is gone and its successor
never heard of those jobs. On :meth:`request_stop` (SIGTERM) it drains: credit 0,
finish what runs within the drain timeout, send the results, hand the rest back in
BYE, exit.

A worker serving several brokers runs one node per broker, each on its own thread,
over one backend (:mod:`ipuserve.worker.brokers`); each node's credit is its
:class:`~ipuserve.worker.credit.Share` of the worker's capacity, which it announces
in HELLO and changes by HEARTBEAT as the pool rebalances. A node alone has a pool of
its own, which always gives it the whole capacity.

Threads: the caller of :meth:`WorkerNode.run` runs the
loop; backend threads report outcomes. The loop holds ``_lock`` -- the book and the
socket -- for all its work and lets go only while it waits, so a backend thread that
finishes a job while the loop waits sends the result itself (:meth:`_on_done`): a
lone request's result takes no thread hand-off. Otherwise the outcome goes through a
:class:`Mailbox` (an :class:`~ipuserve.inbox.Inbox`: a deque plus an eventfd the loop
polls beside the socket, the same hand-off as the client's).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import zmq

from ipuserve import protocol as wire
from ipuserve import transport
from ipuserve.errors import IpuserveError
from ipuserve.worker.backend import Backend, Mailbox, Outcome, WorkItem, WorkResult
from ipuserve.worker.config import WorkerConfig
from ipuserve.worker.connection import Connection, Exit
from ipuserve.worker.control import Control
from ipuserve.worker.credit import CreditPool, Share
from ipuserve.worker.jobbook import JobBook
from ipuserve.worker.joining import Joined, Joiner

log = logging.getLogger(__name__)


class WorkerNode:
    """Serves one backend to one broker until stopped; :meth:`run` returns the exit code."""

    def __init__(
        self,
        backend: Backend,
        config: WorkerConfig,
        context: zmq.Context[Any] | None = None,
        on_joined: Callable[[str], None] | None = None,
        *,
        share: Share | None = None,
        on_lost: Callable[[], None] | None = None,
        owns_backend: bool = True,
        control: Control | None = None,
    ) -> None:
        """``share``: this connection's part of a worker's capacity (default: a pool of
        its own); ``on_lost`` is told when a connection to the broker is lost;
        ``control``: a host node's LOAD/UNLOAD handler and HOST reports (:class:`Control`);
        ``owns_backend``: :meth:`run` closes the backend and the mailbox when it ends
        (the :class:`~ipuserve.worker.brokers.BrokerNodes` of a worker serving several
        brokers closes them itself, once every node has ended)."""
        self._backend = backend
        self._owns_backend = owns_backend
        self._on_lost = on_lost
        #: told (a one-line description) each time the broker lets this worker in
        self._on_joined = on_joined
        self._config = config
        self._models = {spec.name: spec for spec in backend.describe()}
        self._credit = config.credit or backend.capacity()
        self._limits = wire.Limits(max_payload_bytes=config.max_payload_bytes)
        self._mailbox = Mailbox()
        self._share = share or CreditPool(self._credit).share(config.broker)
        self._book = JobBook(backend, self._models, self._credit, self._share.start_lock)
        self._share.notify = self._mailbox.wake
        #: the credit HELLO announced, and the last credit change sent (its number)
        self._announced = self._credit
        self._sent_seq = self._share.pending_seq
        hello = wire.Hello(config.worker_id, tuple(self._models.values()), self._credit)
        self._joiner = Joiner(
            config,
            context or zmq.Context.instance(),
            hello,
            self._mailbox.fd,
            stopping=lambda: self._stopping,
            idle=self._collect_unsent,
            credit=self._hello_credit,
        )
        #: the book and the socket: held by the serving loop except while it waits,
        #: and by a backend thread sending a result itself (:meth:`_on_done`)
        self._lock = threading.Lock()
        self._serving = False
        self._stopping = False
        #: stopping because this broker is no longer served (not the worker's SIGTERM)
        self._leaving = False
        self._connection: Connection | None = None
        #: outcomes that finished while no broker was joined: answered on the next WELCOME
        self._unsent: list[Outcome] = []
        #: while draining: ids of jobs set aside to hand back in BYE
        self._draining: list[bytes] | None = None
        #: a host node's reports, and the number of the last one sent (-1: none yet)
        self._control = control
        self._control_sent = -1
        if control is not None:
            control.watch(self._mailbox.wake)

    # ------------------------------------------------------------ lifecycle

    def request_stop(self) -> None:
        """Ask the loop to drain and exit; safe from a signal handler or another thread."""
        self._stopping = True
        self._mailbox.wake()

    def request_leave(self) -> None:
        """Stop serving this broker (it left the endpoints): hand back at once what it
        gave us, then wait for what already runs; the worker goes on with the others."""
        self._leaving = True
        self.request_stop()

    def retarget(self, endpoint: str) -> None:
        """The same broker is now named ``endpoint`` (a name that resolves to its one
        address, or that address): the connection goes on; the next join uses it."""
        self._config = dataclasses.replace(self._config, broker=endpoint)
        self._joiner.retarget(self._config)

    @property
    def mailbox(self) -> Mailbox:
        return self._mailbox

    @property
    def joined(self) -> bool:
        """Registered with its broker now (read from other threads: one reference)."""
        return self._connection is not None

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
            self._close_connection(linger=0)
            if self._control is not None:
                self._control.unwatch(self._mailbox.wake)
            if self._owns_backend:
                self._backend.close()
                self._mailbox.close()
            log.info("worker %s closed", self._config.worker_id)

    def _run(self) -> int:
        while not self._stopping:
            joined = self._joiner.join()
            if joined is None:
                break
            self._start_connection(joined)
            why = self._serve()
            level = logging.INFO if why is Exit.STOP else logging.WARNING  # asked, or not
            reason = "gone from the endpoints" if self._leaving else why.value
            log.log(level, "worker %s leaves the broker: %s", self._config.worker_id, reason)
            if why is Exit.STOP:
                self._drain()
                self._share.lost()
                self._settle()
                return 0
            self._close_connection(linger=0)
            self._share.lost()
            if self._on_lost is not None:
                self._on_lost()
        if self._joiner.refused:
            return 1
        log.info("worker %s stopping while disconnected", self._config.worker_id)
        self._settle()
        return 0

    def _settle(self) -> None:
        """Leaving one broker of several: wait for the jobs already running (a backend
        cannot recall them), so that the pool counts them until they are done."""
        if not self._leaving:
            return
        self._share.leave()
        book = self._book
        for held in list(book.waiting):
            book.drop(held.job.job_id)  # never started: nothing to wait for
        book.waiting.clear()
        poller = zmq.Poller()
        poller.register(self._mailbox.fd, zmq.POLLIN)
        while book.running > 0:
            poller.poll(1000)
            for job, _outcome in book.finished(self._mailbox.take()):
                book.drop(job.job_id)
            self._share.update(len(book.jobs), book.held_current)
        for job_id in list(book.jobs):  # answered while we were away: not running
            book.drop(job_id)
        self._share.update(0, 0)

    def _hello_credit(self) -> int:
        """Before each HELLO: a new connection begins; the credit to announce."""
        self._book.new_connection()
        self._announced = self._share.hello(len(self._book.jobs))
        return self._announced

    # ------------------------------------------------------------ connections

    def _start_connection(self, joined: Joined) -> None:
        welcome = joined.welcome
        if welcome.epoch != self._book.epoch:
            self._book.forget_epoch(self._book.epoch, self._unsent)
        self._book.epoch = welcome.epoch
        self._book.max_payload_bytes = welcome.max_payload_bytes
        self._connection = Connection.welcomed(joined, self._config.heartbeat_ms)
        log.info(
            "worker %s registered with %s (epoch %s, credit %d)",
            self._config.worker_id,
            self._config.broker,
            welcome.epoch,
            self._announced,
        )
        if self._on_joined is not None:
            self._on_joined(
                f"worker {self._config.worker_id} joined the broker at {self._config.broker}, "
                f"serving {', '.join(self._models)} (credit {self._announced})"
            )
        unsent, self._unsent = self._unsent, []
        for job, outcome in unsent:
            self._book.answer(job, outcome)
        self._flush()
        self._control_sent = -1  # a broker (new, or restarted) hears the report at once
        self._send_control()

    def _collect_unsent(self) -> None:
        """While joining: keep what finished, to answer once a broker lets us in."""
        self._unsent.extend(self._finished(self._mailbox.take()))

    def _close_connection(self, linger: int) -> None:
        if self._connection is not None:
            self._connection.close(linger)
            self._connection = None
            self._book.max_payload_bytes = None

    # ------------------------------------------------------------ serving

    def _serve(self) -> Exit:
        """Serve the broker until a reason to leave.

        The wait is on the socket's file descriptor (``zmq.FD``), not on the socket:
        polling the socket would use it, and the socket may only be used under the
        lock, which a backend thread may hold meanwhile. That descriptor is
        edge-triggered, so the loop waits only while ``zmq.EVENTS`` says nothing is
        readable, and whoever used the socket under the lock checks it before letting
        go (:meth:`_on_done` wakes the loop if a message came in meanwhile)."""
        connection = self._connection
        assert connection is not None
        sock = connection.socket
        poller = zmq.Poller()
        poller.register(sock.getsockopt(zmq.FD), zmq.POLLIN)
        poller.register(self._mailbox.fd, zmq.POLLIN)
        with self._lock:
            self._serving = True
            try:
                while not self._stopping:
                    woken = False
                    if not self._mailbox.ready and not transport.readable(sock):
                        wait_ms = connection.timeout_ms(self._book.next_expiry)
                        woken = self._wait_unlocked(poller, wait_ms)
                    if (why := self._read(connection)) is not None:
                        return why
                    if woken or self._mailbox.ready:
                        self._deliver()  # what finished while we read joins this RESULTS
                    self._book.expire_waiting(time.monotonic())
                    self._flush()
                    self._report()
                    self._send_control()
                    if (why := self._tick(connection)) is not None:
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

    def _on_done(self, job: WorkItem, outcome: WorkResult | IpuserveError) -> None:
        """A backend thread's outcome: sent from that thread when the loop is waiting and
        nothing else is due (a lone request's result takes no hand-off), else handed to
        the loop through the mailbox, where outcomes of one turn leave together. Jobs
        waiting to start are the loop's to start: never from a backend thread."""
        self._share.wake_waiting()  # other brokers' jobs may wait for the room it freed
        if self._book.waiting or not self._lock.acquire(blocking=False):
            self._mailbox.put((job, outcome))
            return
        try:
            if not self._serving or self._book.waiting or self._mailbox.ready:
                self._mailbox.put((job, outcome))  # the loop's turn is due anyway: keep order
                return
            for kept, kept_outcome in self._book.finished([(job, outcome)]):
                self._book.answer(kept, kept_outcome)
            self._flush()
            self._report()
            connection = self._connection
            if connection is not None and transport.readable(connection.socket):
                self._mailbox.wake()  # our use of the socket may have eaten the loop's edge
        finally:
            self._lock.release()

    def _read(self, connection: Connection) -> Exit | None:
        """Handle every message waiting on the socket."""
        while (frames := connection.receive()) is not None:
            why = self._on_message(connection, frames)
            if why is not None:
                return why
        return None

    def _on_message(self, connection: Connection, frames: list[Any]) -> Exit | None:
        try:
            message = wire.decode(frames, self._limits)
        except IpuserveError as exc:
            # nobody to answer but the jobs a JOBS we cannot read names: they fail
            log.warning("malformed message from the broker: %s", exc)
            self._book.fail(wire.Fail.of(job_id, exc) for job_id in wire.peek_ids(frames))
            return None
        if isinstance(message, wire.Jobs):
            self._on_jobs(message)
        elif isinstance(message, wire.Reconnect):
            return Exit.RECONNECT
        elif isinstance(message, wire.Welcome) and message.epoch != connection.epoch:
            return Exit.NEW_EPOCH
        elif isinstance(message, wire.Heartbeat) and message.credit is not None:
            self._report()  # every JOBS sent before this echo is in the book by now
            self._share.confirm(message.credit)
        elif isinstance(message, wire.Load | wire.Unload):
            if self._control is None:
                log.warning(
                    "worker %s is no repository worker: %s ignored",
                    self._config.worker_id,
                    message.COMMAND.name,
                )
            else:
                self._control.handle(message)
        return None

    def _on_jobs(self, message: wire.Jobs) -> None:
        if self._draining is not None:
            self._book.fail(message.rejected)
            self._draining += [job.job_id for job in message.jobs]
            return
        share = self._share
        self._book.connection_limit = None if share.solo else share.exposure
        self._book.admit(message.jobs, message.rejected)
        self._book.start_waiting(self._on_done)

    def _deliver(self) -> None:
        for job, outcome in self._finished(self._mailbox.take()):
            self._book.answer(job, outcome)

    def _finished(self, outcomes: Iterable[Outcome]) -> list[Outcome]:
        """Account for finished jobs, start what waits, keep the outcomes worth sending."""
        keep = self._book.finished(outcomes)
        self._book.start_waiting(self._on_done)
        return keep

    def _flush(self) -> None:
        """Send this turn's outcomes as RESULTS (several if one would be too big)."""
        message = self._book.take_results()
        if message is None:
            return
        connection = self._connection
        if connection is None:
            return
        for frames in wire.encode_batch(message, self._limits):
            connection.send_frames(frames, "RESULTS")

    def _report(self) -> None:
        """Tell the pool what this connection holds; send a credit it changed."""
        share = self._share
        share.waiting = bool(self._book.waiting)
        share.update(self._held(), self._book.held_current)
        seq, pending = share.pending_seq, share.pending
        if pending is not None and seq != self._sent_seq and self._draining is None:
            self._sent_seq = seq
            self._send(wire.Heartbeat(in_flight=self._held(), credit=pending))

    def _tick(self, connection: Connection) -> Exit | None:
        now = time.monotonic()
        if connection.silent(now):
            return Exit.SILENT
        if connection.heartbeat_due(now):
            self._send(wire.Heartbeat(in_flight=self._held()))
        return None

    def _send_control(self) -> None:
        """A host node: send the report if it changed since the last one sent."""
        control = self._control
        if control is None or control.seq == self._control_sent:
            return
        self._control_sent = control.seq  # before building it: a change meanwhile resends
        self._send(control.report())

    def _held(self) -> int:
        """Jobs this worker holds: running, waiting, or set aside while draining."""
        return len(self._book.jobs) + len(self._draining or ())

    def _send(self, message: wire.Message) -> None:
        """Send to the broker joined now; nothing while none is (a thread's late result)."""
        if self._connection is not None:
            self._connection.send(message)

    # ------------------------------------------------------------ draining

    def _drain(self) -> None:
        """Credit 0, finish what runs (within the drain timeout), hand back the rest."""
        connection = self._connection
        assert connection is not None
        book = self._book
        self._draining = book.set_aside_waiting()
        running = len(book.jobs)
        self._send(wire.Heartbeat(in_flight=self._held(), credit=0))
        if not self._leaving:  # a broker no longer served gets its jobs back at once
            self._finish_running(connection)
        self._read(connection)  # JOBS that arrived meanwhile are handed back too
        self._flush()
        self._send_control()  # a host's last report (its versions drained) before BYE
        handed_back = self._draining + list(book.jobs)
        self._send(wire.Bye(tuple(handed_back)))
        log.log(
            logging.WARNING if handed_back else logging.INFO,
            "worker %s drained: finished %d job(s), handed back %d",
            self._config.worker_id,
            running - len(book.jobs),
            len(handed_back),
        )
        self._close_connection(linger=self._config.bye_linger_ms)

    def _finish_running(self, connection: Connection) -> None:
        deadline = time.monotonic() + self._config.drain_timeout_ms / 1000
        poller = zmq.Poller()
        poller.register(connection.socket, zmq.POLLIN)
        poller.register(self._mailbox.fd, zmq.POLLIN)
        while self._book.jobs and (left := deadline - time.monotonic()) > 0:
            wait = min(left, max(0.0, connection.next_heartbeat - time.monotonic()))
            events = dict(poller.poll(int(wait * 1000) + 1))
            if connection.socket in events and self._read(connection) is not None:
                return  # the broker forgot us: nobody to send results to
            if self._mailbox.fd in events:
                self._deliver()
            self._flush()
            if connection.heartbeat_due(time.monotonic()):
                self._send(wire.Heartbeat(in_flight=self._held(), credit=0))
