"""The client's socket: who may touch it, when, and the I/O thread that owns what
nobody else does (receiving, deadlines, liveness, re-sending).

The short path. A request leaves from its caller's thread when the socket is
idle: no hand-off on the way out. ZeroMQ sockets are not thread-safe, but may be
used from several threads with a full memory barrier between uses, so one lock,
the *socket lock*, guards every operation on the socket and all the state the
loop keeps about it (pending table, deadlines, liveness, counters, what waits to
be sent). The I/O thread holds it for each turn of its loop, letting go only to
wait in ``poll`` and to settle futures (so the caller a reply wakes finds the
socket free); a caller takes it only if it is free (``acquire(blocking=False)``),
and sends a request that needs nothing from the loop: nothing in the inbox before
it, nothing left unsent (HWM), not held for the broker's payload limit, not over
it. Otherwise the request goes through the inbox -- a deque plus a :class:`Waker`
written only on the empty -> non-empty transition, cleared by the I/O thread
*before* it swaps the deque, so no wake-up is lost -- and callers never wait for
the I/O thread. Future callbacks (on the I/O thread) hand requests to the turn's
:class:`~ipuserve.client.outbox.Outbox`, which batches them.

Why no reply goes missing. The I/O thread waits on the socket's ``zmq.FD``, not
on the socket (``poll`` on the socket itself would be an operation on it, racing
a caller's send). That descriptor is edge-triggered: it signals commands waiting
in the socket's mailbox, and *any* operation on the socket may consume them, a
caller's send included; a reply that arrived then is in the socket with the
descriptor quiet. So whoever held the lock checks ``ZMQ_EVENTS`` as the last
operation before letting go: the I/O thread does not wait if a message (or, with
requests left unsent, room) is there; a caller that finds a message, or leaves
something unsent, wakes the I/O thread through the waker. After that check with
nothing ready, whatever arrives next signals the descriptor again.

Why no deadline or PING is late. A caller's request may be due before the I/O
thread's poll ends: the I/O thread records when that is (``_wake_at_ns``, under
the lock) and a caller wakes it when its deadline comes earlier. While nothing is
pending the I/O thread looks again every ``ping_interval_s`` at the latest, so
the first PING after an idle spell is at most one interval late and a caller need
not wake it for that.

Ctrl-C. On the main thread Python raises KeyboardInterrupt between bytecodes and
right after each ZeroMQ call, so a caller's send can stop between the frames of a
message; the frames queued would be glued to the next message. The caller's send
then ends the message with an empty frame, which the broker refuses as malformed
(:meth:`IoLoop._after_torn_send`). :meth:`Client.infer_async` on the main thread
hands over instead of sending (see there).

Replies stay on the I/O thread, which settles the futures: a caller waiting in
:meth:`Client.infer` could receive its own reply (leader/follower), but then
done-callbacks would run on callers' threads and every waiter would depend on
another's progress; the one hop back is kept for that simplicity.

The payload limit (from PONG): a request above it fails with PayloadTooLargeError
unsent; one beyond ``protocol.FRAME_SLACK_BYTES`` waits for the first PONG (the
broker's ZeroMQ would drop the connection, and nobody could answer). Liveness and
re-sending: :mod:`~ipuserve.client.liveness`; settling the requests (and a
backend port's answers): :mod:`~ipuserve.client.replies`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from functools import partial
from typing import Any, cast

import zmq
from zmq.utils.monitor import recv_monitor_message

from ipuserve import protocol as wire
from ipuserve.client.config import ClientConfig, ClientStats
from ipuserve.client.lifecycle import IoThread
from ipuserve.client.liveness import Liveness, connection_monitor
from ipuserve.client.outbox import Outbox
from ipuserve.client.pending import Pending, PendingTable, refuse_if_forked
from ipuserve.client.replies import Replies
from ipuserve.errors import (
    ClosedError,
    DeadlineExceeded,
    IpuserveError,
    PayloadTooLargeError,
    UnavailableError,
)
from ipuserve.waker import Waker

__all__ = ["ClientConfig", "ClientStats", "IoLoop", "connection_monitor"]

log = logging.getLogger(__name__)

#: The longest poll: a deadline years away must not overflow poll's int milliseconds.
_MAX_POLL_MS = 60_000
#: Silence since the client started after which "is the broker running?" is a fair
#: question: a PONG on a working connection takes milliseconds.
_SUSPECT_SILENCE_S = 0.05
_EVENTS, _POLLIN, _POLLOUT = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.POLLOUT)
_NEVER = 1 << 62


class IoLoop(IoThread):
    """Owns the socket, the pending table, the deadlines and the broker's liveness
    (its thread's start and end: :class:`~ipuserve.client.lifecycle.IoThread`)."""

    def __init__(
        self,
        sock: zmq.Socket[Any],
        monitor: zmq.Socket[Any],
        config: ClientConfig,
        *,
        endpoint: str = "",
    ) -> None:
        """``monitor`` (:func:`connection_monitor`) must watch ``sock`` from before it
        connects: a first handshake it missed left the client thinking it never
        connected, so it re-sent nothing when silent or after its first reconnection."""
        self.config = config
        self.endpoint = endpoint
        self.stats = ClientStats()
        self._sock = sock
        self._fd = cast(int, sock.get(zmq.FD))
        self._monitor = monitor
        self._liveness = Liveness(config, endpoint, _SUSPECT_SILENCE_S)
        #: guards the socket and everything below it (see the module's docstring)
        self._sock_lock = threading.Lock()
        self._work_lock = self._sock_lock  # the lifecycle's name for it
        self._table = PendingTable()
        self._outbox = Outbox(config, self.stats, self, self._table.get)
        self._replies = Replies(self._table, self.stats, self._liveness, self._on_pong)
        #: ids of pending requests too big to send before the broker's limit is known
        self._held: dict[bytes, None] = {}
        #: requests that found the socket's pipe full, to send once it has room
        self._unsent: dict[bytes, None] = {}
        #: when the I/O thread's poll ends at the latest (perf_counter ns)
        self._wake_at_ns = 0
        # the inbox, guarded by _lock (taken inside the socket lock, never around it)
        self._waker = Waker()
        self._inbox: deque[Pending] = deque()
        self._lock = threading.Lock()
        self._closed = False
        #: a forked child inherits this object but not its thread: it must not use it
        self._pid = os.getpid()
        #: what ended the I/O thread, if it failed (then calls say so, not "closed")
        self._crash: Exception | None = None
        self.thread = threading.Thread(target=self._run, name="ipuserve-client-io", daemon=True)

    # tests and diagnostics look at these
    @property
    def _connected(self) -> bool:
        return self._liveness.connected

    @property
    def _last_heard(self) -> float:
        return self._liveness.last_heard

    @property
    def _deadlines(self) -> list[tuple[int, int, bytes]]:
        return self._table.deadlines

    # ------------------------------------------------------------ any thread

    def submit(self, pending: Pending, *, direct: bool = True) -> None:
        """Send a request now when the socket is idle (or on the I/O thread, at the end
        of its turn); else, or when not ``direct``, hand it to the I/O thread. Never
        waits for the I/O thread."""
        refuse_if_forked(self._pid)
        if threading.current_thread() is self.thread:  # a done-callback: batched
            with self._sock_lock:
                if self._closed:
                    raise self._closed_error()
                self._register(pending)
                self._outbox.add(pending)
            return
        if direct and self._sock_lock.acquire(blocking=False):
            try:
                if self._send_from_caller(pending):
                    return
            finally:
                self._sock_lock.release()
        with self._lock:
            if self._closed:
                raise self._closed_error()
            was_empty = not self._inbox
            self._inbox.append(pending)
        if was_empty:
            self._waker.wake()

    def _send_from_caller(self, pending: Pending) -> bool:
        """Hold the socket lock, on a caller's thread. Send ``pending`` if nothing in the
        loop's hands must go first or decide for it; False: hand it over instead."""
        with self._lock:
            if self._closed:
                raise self._closed_error()
            if self._inbox:
                return False  # those were handed over first
        if self._unsent or not self._sendable(pending):
            return False
        try:
            self._register(pending)
            self.stats.direct += 1
            if not self.send_frames(pending.frames(time.perf_counter_ns())):
                self._unsent[pending.request_id] = None
            # the last operation on the socket before letting go (module docstring)
            if (
                self._unsent
                or wire.readable(self._sock)
                or (pending.deadline_ns is not None and pending.deadline_ns < self._wake_at_ns)
            ):
                self._waker.wake()
        except BaseException as exc:
            self._after_torn_send(pending, exc)
            raise
        return True

    def _after_torn_send(self, pending: Pending, exc: BaseException) -> None:
        """Hold the socket lock. A caller's send ended by an exception: on the main
        thread Ctrl-C's KeyboardInterrupt is raised between the frames of a message, or
        right after one is queued, so the socket may hold a message cut short, to which
        the next one would be glued. End it with an empty last frame: the broker refuses
        what it ends (or, when nothing was cut, a stray empty message) with an error to
        its id, which is dropped here. The request is forgotten (its caller never got
        its future), and the I/O thread runs a turn, to miss no reply."""
        with contextlib.suppress(zmq.ZMQError):
            self._sock.send(b"", zmq.NOBLOCK)
        if self._table.pop(pending.request_id) is pending:
            pending.fail(exc)
        self._waker.wake()

    def _outstanding(self) -> list[Pending]:
        """Hold the lock. Every request not yet settled: sent, answered but not settled
        yet, or still in the inbox."""
        return [*self._table.values(), *(p for p, _ in self._replies.due), *self._inbox]

    def _take_outstanding(self) -> list[Pending]:
        """Hold the lock. :meth:`_outstanding`, now no longer this loop's."""
        outstanding = self._outstanding()
        self._table.take_all()
        self._replies.due.clear()
        self._inbox.clear()
        return outstanding

    def _closed_error(self) -> IpuserveError:
        if self._crash is not None:  # not closed by the user: say what happened
            return UnavailableError(
                f"the client's I/O thread failed ({self._crash!r}; see the log); "
                "create a new Client"
            )
        return ClosedError("the client is closed")

    def silence_hint(self) -> str:
        """``": nothing has answered at ENDPOINT ..."`` while nothing ever has (and what is
        wrong when the backend port answered), else ``""``."""
        return self._liveness.silence_hint()

    # ------------------------------------------------------------ sending (socket lock)

    def _register(self, pending: Pending) -> None:
        """Into the pending table, before it is sent: its reply finds it there."""
        now = time.monotonic()
        if not self._table and self._liveness.woken(now):
            self._ping(now)
        self._table.add(pending)
        self.stats.sent += 1

    def _sendable(self, pending: Pending) -> bool:
        """:meth:`send` would send it now: within the limit, not held for the PONG."""
        size, limit = pending.payload_bytes, self.stats.max_payload_bytes
        if limit is not None and size > limit:
            return False
        return size <= wire.FRAME_SLACK_BYTES or (limit is not None and self._liveness.connected)

    def _send(self, pending: Pending) -> None:
        size, limit = pending.payload_bytes, self.stats.max_payload_bytes
        if limit is not None and size > limit:
            error = PayloadTooLargeError(
                f"the request's tensors take {size} bytes; the broker's limit is {limit}"
            )
            self._replies.finish(pending.request_id, lambda p: p.fail(error))
        elif not self._sendable(pending):
            # sent by _on_pong; while disconnected too: the broker back may have a smaller
            # limit, and a frame waiting in ZeroMQ's pipe could no longer be taken back
            self._held[pending.request_id] = None
        elif not self.send_frames(pending.frames(time.perf_counter_ns())):
            self._unsent[pending.request_id] = None

    send = _send  # the Outbox's Sender

    def send_frames(self, frames: list[wire.Frame]) -> bool:
        """Send without blocking and without copying tensors; False: the pipe was full."""
        try:
            wire.send(self._sock, frames, nonblock=True)
        except zmq.Again:
            return False
        return True

    def defer(self, request_ids: list[bytes]) -> None:
        self._unsent.update(dict.fromkeys(request_ids))

    def _send_unsent(self) -> None:
        """Send, in order, what found the socket's pipe full (send_hwm). Nothing else
        would: the re-send after a silence never comes while the broker answers the
        rest, and such requests once waited out their timeout (or for ever)."""
        for request_id in list(self._unsent):
            del self._unsent[request_id]
            pending = self._table.get(request_id)
            if pending is not None:  # not answered or expired meanwhile
                self._send(pending)
                if request_id in self._unsent:
                    return  # full again

    def _ping(self, now: float) -> None:
        self._liveness.pinged(now)
        self.send_frames(wire.Ping().encode())

    def _resend_all(self) -> None:
        for pending in self._table.values():
            self._send(pending)
            self.stats.resent += 1

    # ------------------------------------------------------------ I/O thread

    def _release(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._fd, zmq.POLLIN)  # the socket's edge-triggered descriptor
        poller.register(self._waker.fileno(), zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        with self._sock_lock:
            self._ping(time.monotonic())
            timeout_ms = self._plan()
        while not self._closed:
            events = dict(poller.poll(timeout_ms))
            with self._sock_lock:
                self._turn(events)
                if not self._replies.due:
                    timeout_ms = self._end_turn()
                    continue
            self._replies.settle_due()  # callers woken here find the socket free
            with self._sock_lock:
                timeout_ms = self._end_turn()  # send what the callbacks asked for

    def _turn(self, events: dict[Any, int]) -> None:
        """One turn, holding the socket lock."""
        self._wake_at_ns = 0  # awake: it plans again before it waits (_end_turn)
        if self._waker.fileno() in events:
            self._take_inbox()
        if self._monitor in events:  # first: a new connection's re-send precedes the
            self._on_connection_events()  # PONG it brings, which then re-sends nothing
        self._receive()  # whatever woke us: a caller's send may have taken the signal
        if self._unsent:
            self._send_unsent()
        if not self._closed:
            self._tick()
            self._outbox.flush()

    def _end_turn(self) -> int:
        """Hold the socket lock. Send what waits; the poll timeout for the next wait."""
        if self._closed:  # close() gave up on a callback that blocked the I/O thread
            return 0
        self._outbox.flush()
        return self._plan()

    def _plan(self) -> int:
        """The last operation on the socket before the lock is let go: wait only if
        nothing is ready (the descriptor signals only what comes after this)."""
        ready: int = self._sock.get(_EVENTS)  # type: ignore[assignment]
        if ready & _POLLIN or (self._unsent and ready & _POLLOUT):
            timeout_ms = 0
        else:
            timeout_ms = self._poll_timeout_ms()
        self._wake_at_ns = time.perf_counter_ns() + timeout_ms * 1_000_000
        return timeout_ms

    def _poll_timeout_ms(self) -> int:
        if self._inbox or self._outbox:
            return 0
        now = time.monotonic()
        # idle, it looks again within an interval: a caller that makes it busy need
        # not wake it for the PING that is then due (see the module docstring)
        ping_s = self._liveness.seconds_to_ping(now) if self._table else None
        waits = [self.config.ping_interval_s if ping_s is None else ping_s]
        due_ns = self._table.next_deadline_ns()
        if due_ns is not None:
            waits.append((due_ns - time.perf_counter_ns()) / 1e9)
        return min(max(int(min(waits) * 1e3) + 1, 0), _MAX_POLL_MS)

    def _take_inbox(self) -> None:
        self._waker.clear()
        with self._lock:
            items, self._inbox = self._inbox, deque()
        for pending in items:
            self._register(pending)
            self._outbox.add(pending)

    def _on_connection_events(self) -> None:
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)
            if self._liveness.on_connection_event(
                event["event"], self.stats, len(self._table), event["value"]
            ):
                self._ping(time.monotonic())
                if self._table:
                    self._resend_all()

    def _receive(self) -> None:
        for _ in range(self.config.recv_batch):
            frames = wire.try_recv(self._sock)
            if frames is None:
                return
            self._liveness.heard(time.monotonic())
            self._replies.on_frames(frames)

    def _on_pong(self, pong: wire.Pong) -> None:
        held, self._held = self._held, {}
        if self._liveness.on_pong(pong, self.stats, len(self._table)):
            self._resend_all()  # what was held too: the limit is known now
            return
        for request_id in held:
            pending = self._table.get(request_id)
            if pending is not None:  # not expired meanwhile
                self._send(pending)

    def _tick(self) -> None:
        self._expire(time.perf_counter_ns())
        if not self._table:
            return
        now = time.monotonic()
        if self._liveness.silence(now, len(self._table)):
            self._resend_all()
        if self._liveness.ping_due(now):
            self._ping(now)

    def _expire(self, now_ns: int) -> None:
        due_ns = self._table.next_deadline_ns()
        if due_ns is None or due_ns > now_ns:
            return
        grace_ns = None
        if self._liveness.broker_answers():
            grace_ns = int(self.config.deadline_grace_s * 1e9)
        for pending in self._table.expired(now_ns, grace_ns):
            self.stats.expired += 1
            error = DeadlineExceeded(
                f"no reply within {pending.timeout_s} s (request {pending.request_id.hex()})"
                + self.silence_hint()
            )
            self._replies.due.append((pending, partial(Pending.fail, error=error)))
