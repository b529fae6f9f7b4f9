"""The sync driver of the client's core: one I/O thread polling every link's socket,
and the send from the caller's thread when a socket is free.

The short path. A request leaves from its caller's thread when the core's lock, the
*work lock*, is free: the caller takes it only if it is (``acquire(blocking=False)``),
asks the core for the link the request would go to (:meth:`Core.place_direct`: a
usable link, or the lone one; nothing parked or deferred before it; within the
broker's limit and not held), and sends on that link's socket. ZeroMQ sockets are not
thread-safe but may be used from several threads with a full memory barrier between
uses: the work lock guards every operation on every socket and the whole core. The
I/O thread holds it for each turn, letting go only to wait in ``poll`` and to settle
futures (so the caller a reply wakes finds the sockets free). Otherwise the request
goes through the :class:`~ipuserve.inbox.Inbox` and callers never wait for the I/O
thread. Future callbacks (on the I/O thread) give their requests to the core
directly; the links' turn batches hold what a turn hands over.

Why no reply goes missing. The I/O thread waits on each socket's ``zmq.FD``, not on
the socket (``poll`` on the socket itself would be an operation on it, racing a
caller's send). That descriptor is edge-triggered: it signals commands waiting in
the socket's mailbox, and *any* operation on the socket may consume them, a caller's
send included; a reply that arrived then is in the socket with the descriptor quiet.
So whoever held the lock checks ``ZMQ_EVENTS`` as the last operation before letting
go: the I/O thread does not wait if a message (or, with requests deferred, room) is
there on any link; a caller that finds a message on the socket it sent on, or leaves
something deferred, wakes the I/O thread through the inbox's waker. After that check
with nothing ready, whatever arrives next signals the descriptor again.

Why no deadline or PING is late. A caller's request may be due before the I/O
thread's poll ends: the I/O thread records when that is (``_wake_at_ns``, under the
lock) and a caller wakes it when its deadline comes earlier. Every link is PINGed
every ``ping_interval_s``, so the I/O thread looks again within an interval at the
latest.

Ctrl-C. On the main thread Python raises KeyboardInterrupt between bytecodes and
right after each ZeroMQ call, so a caller's send can stop between the frames of a
message; the frames queued would be glued to the next message. The caller's send
then ends the message with an empty frame, which the broker refuses as malformed
(:meth:`ThreadLoop._after_torn_send`). :meth:`Client.infer_async` on the main thread
hands over instead of sending (see there).

Replies stay on the I/O thread, which settles the futures: a caller waiting in
:meth:`Client.infer` could receive its own reply (leader/follower), but then
done-callbacks would run on callers' threads and every waiter would depend on
another's progress; the one hop back is kept for that simplicity.

Discovery: :class:`~ipuserve.client.following.Following` re-resolves names on a
thread of its own and rings the inbox's waker; links are added and dropped on the
I/O thread, as :class:`~ipuserve.client.driver.Driver` (shared with the asyncio driver)
does it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import zmq

from ipuserve.client.config import ClientConfig
from ipuserve.client.driver import Connect, Driver
from ipuserve.client.lifecycle import IoThread
from ipuserve.client.link import Link
from ipuserve.client.pending import Pending, refuse_if_forked
from ipuserve.client.reply_router import settle
from ipuserve.client.sockets import LinkSocket
from ipuserve.discovery import EndpointSet
from ipuserve.errors import ClosedError, IpuserveError, UnavailableError
from ipuserve.inbox import Inbox

__all__ = ["ThreadLoop"]

log = logging.getLogger(__name__)

#: The longest poll: a deadline years away must not overflow poll's int milliseconds.
MAX_POLL_MS = 60_000


class ThreadLoop(IoThread, Driver):
    """Drives a :class:`Core` from one I/O thread (its start and end:
    :class:`~ipuserve.client.lifecycle.IoThread`)."""

    def __init__(
        self, endpoints: EndpointSet, connect: Connect, config: ClientConfig, *, follow: bool
    ) -> None:
        """``follow``: as :class:`~ipuserve.client.driver.Driver` takes it."""
        self._inbox: Inbox[tuple[Pending, str | None]] = Inbox()
        super().__init__(endpoints, connect, config, follow=follow, wake=self._inbox.wake)
        self._waker = self._inbox.waker
        self._lock = self._inbox.lock  # the inbox and _closed
        self._work_lock = threading.Lock()  # the core and every socket (module docstring)
        #: when the I/O thread's poll ends at the latest (perf_counter ns)
        self._wake_at_ns = 0
        self._poller_stale = True
        self._closed = False
        #: a forked child inherits this object but not its thread: it must not use it
        self._pid = os.getpid()
        self._crash: Exception | None = None
        try:
            self._open_links()
        except BaseException:
            self._release()
            self._inbox.close()
            raise
        self.thread = threading.Thread(target=self._run, name="ipuserve-client-io", daemon=True)

    # ------------------------------------------------------------ any thread

    def submit(self, pending: Pending, *, direct: bool = True, to: str | None = None) -> None:
        """Send a request now when the sockets are free (or on the I/O thread, at the
        end of its turn); else, or when not ``direct``, hand it to the I/O thread.
        ``to``: only that link's broker. Never waits for the I/O thread."""
        refuse_if_forked(self._pid)
        if threading.current_thread() is self.thread:  # a done-callback: batched
            with self._work_lock:
                if self._closed:
                    raise self._closed_error()
                self.core.submit(pending, time.monotonic(), to)
            return
        if direct and to is None and self._work_lock.acquire(blocking=False):
            try:
                if self._send_from_caller(pending):
                    return
            finally:
                self._work_lock.release()
        with self._lock:
            if self._closed:
                raise self._closed_error()
            self._inbox.put_locked((pending, to))

    def _send_from_caller(self, pending: Pending) -> bool:
        """Hold the work lock, on a caller's thread. Send ``pending`` if nothing in the
        loop's hands must go first or decide for it; False: hand it over instead."""
        with self._lock:
            if self._closed:
                raise self._closed_error()
            if self._inbox.ready:
                return False  # those were handed over first
        link = self.core.place_direct(pending, time.monotonic())
        if link is None:
            return False
        try:
            link.send(pending)
            # the last operation on the socket before letting go (module docstring)
            if (
                link.unsent
                or self._sockets[link.endpoint].ready(want_room=False)
                or (pending.deadline_ns is not None and pending.deadline_ns < self._wake_at_ns)
            ):
                self._waker.wake()
        except BaseException as exc:
            self._after_torn_send(link, pending, exc)
            raise
        return True

    def _after_torn_send(self, link: Link, pending: Pending, exc: BaseException) -> None:
        """Hold the work lock. A caller's send ended by an exception: on the main
        thread Ctrl-C's KeyboardInterrupt is raised between the frames of a message, or
        right after one is queued, so the socket may hold a message cut short, to which
        the next one would be glued. End it with an empty last frame: the broker refuses
        what it ends (or, when nothing was cut, a stray empty message) with an error to
        its id, which is dropped here. The request is forgotten (its caller never got
        its future), and the I/O thread runs a turn, to miss no reply."""
        self._sockets[link.endpoint].end_torn_message()
        self.core.torn(pending, exc)
        self._waker.wake()

    def _outstanding(self) -> list[Pending]:
        """Hold the lock. Every request not yet settled: in the core, or in the inbox."""
        return [*self.core.outstanding(), *(p for p, _ in self._inbox.peek_locked())]

    def _take_outstanding(self) -> list[Pending]:
        """Hold the lock. :meth:`_outstanding`, now no longer this loop's."""
        outstanding = self._outstanding()
        self.core.take_outstanding()
        self._inbox.take_locked()
        return outstanding

    def _closed_error(self) -> IpuserveError:
        if self._crash is not None:  # not closed by the user: say what happened
            return UnavailableError(
                f"the client's I/O thread failed ({self._crash!r}; see the log); "
                "create a new Client"
            )
        return ClosedError("the client is closed")

    # ------------------------------------------------------------ links

    def _linked(self, endpoint: str, sockets: LinkSocket) -> None:
        self._poller_stale = True

    def _unlinked(self, sockets: LinkSocket) -> None:
        self._poller_stale = True

    # ------------------------------------------------------------ I/O thread

    def _release(self) -> None:
        for sockets in self._sockets.values():
            sockets.close()

    def _loop(self) -> None:
        poller = zmq.Poller()
        with self._work_lock:
            self.core.tick(time.monotonic(), time.perf_counter_ns())  # the first PINGs
            timeout_ms = self._end_turn()
        while not self._closed:
            if self._poller_stale:
                poller = self._poller()
            events = dict(poller.poll(timeout_ms))
            with self._work_lock:
                self._turn(events)
                if not self.core.due:
                    timeout_ms = self._end_turn()
                    continue
            settle(self.core.due)  # callers woken here find the sockets free
            with self._work_lock:
                timeout_ms = self._end_turn()  # send what the callbacks asked for

    def _poller(self) -> zmq.Poller:
        self._poller_stale = False
        poller = zmq.Poller()
        poller.register(self._inbox.fd, zmq.POLLIN)
        for sockets in self._sockets.values():
            poller.register(sockets.fd, zmq.POLLIN)  # the socket's edge-triggered descriptor
            poller.register(sockets.monitor, zmq.POLLIN)
        return poller

    def _turn(self, events: dict[Any, int]) -> None:
        """One turn, holding the work lock."""
        self._wake_at_ns = 0  # awake: it plans again before it waits (_end_turn)
        core, now = self.core, time.monotonic()
        if self._inbox.fd in events:
            for pending, to in self._inbox.take():
                core.submit(pending, now, to)
        for endpoint, sockets in list(self._sockets.items()):
            link = core.links[endpoint]
            if sockets.monitor in events:  # first: a new connection's re-send precedes
                for event, value in sockets.connection_events():  # the PONG it brings
                    core.on_connection_event(link, event, value, now)
            # whatever woke us: a caller's send may have taken the descriptor's signal
            for frames in sockets.receive(self.config.recv_batch):
                core.on_frames(link, frames, now)
        core.send_unsent()
        if not self._closed:
            self._follow_endpoints()
            core.tick(now, time.perf_counter_ns())

    def _end_turn(self) -> int:
        """Hold the work lock. Send what waits; the poll timeout for the next wait."""
        if self._closed:  # close() gave up on a callback that blocked the I/O thread
            return 0
        self.core.flush()
        return self._plan()

    def _plan(self) -> int:
        """The last operation on each socket before the lock is let go: wait only if
        nothing is ready (the descriptors signal only what comes after this)."""
        if self._inbox.ready or self._sockets_ready():
            timeout_ms = 0
        else:
            timeout_ms = min(max(int(self._wait_s() * 1e3) + 1, 0), MAX_POLL_MS)
        self._wake_at_ns = time.perf_counter_ns() + timeout_ms * 1_000_000
        return timeout_ms
