"""The asyncio driver of the client's core: the event loop, not a thread, owns the
sockets (:class:`~ipuserve.client.AsyncClient`).

Each link's socket is a plain ZeroMQ socket whose ``zmq.FD`` is registered with
``loop.add_reader``, beside its connection monitor's; discovery's re-resolutions run
on a thread of their own (:class:`~ipuserve.client.following.Following`) and ring a
:class:`~ipuserve.waker.Waker` whose descriptor is a reader too. Everything else runs
on the event loop's thread, so there is no lock: a request is sent from the calling
coroutine when nothing else was handed over in this pass of the loop (the lone
request, no hop), else it joins its link's turn batch and leaves with the others when
the turn scheduled for them runs (``call_soon``) -- the requests of coroutines that
the same replies woke leave together.

The rules of :mod:`ipuserve.client.thread_loop` hold here too. The descriptor is
edge-triggered and any operation on the socket may consume its signal, so every
operation on the sockets is followed by a turn that receives what waits and checks
``ZMQ_EVENTS`` last: with a message (or, with sends deferred, room) there, it runs
again at once instead of waiting for the descriptor. The next PING or deadline is a
``loop.call_at`` timer, moved earlier when a request is due sooner. Futures are
``asyncio`` futures, settled on the loop (their callbacks then run in a later pass).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

from ipuserve.client.config import ClientConfig
from ipuserve.client.driver import Connect, Driver
from ipuserve.client.pending import Pending, refuse_if_forked
from ipuserve.client.reply_router import settle
from ipuserve.client.sockets import LinkSocket
from ipuserve.discovery import EndpointSet
from ipuserve.errors import ClosedError, RuntimeUsageError
from ipuserve.waker import Waker

__all__ = ["AsyncLoop"]

log = logging.getLogger(__name__)

#: the longest timer: a deadline years away needs no timer now
MAX_WAIT_S = 60.0


class AsyncLoop(Driver):
    """Drives a :class:`Core` from one asyncio event loop (the first that uses it)."""

    def __init__(
        self, endpoints: EndpointSet, connect: Connect, config: ClientConfig, *, follow: bool
    ) -> None:
        self._waker = Waker()
        super().__init__(endpoints, connect, config, follow=follow, wake=self._waker.wake)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._closed = False
        self._pid = os.getpid()
        try:
            self._open_links()
        except BaseException:
            self.close()
            raise
        try:  # made in a coroutine: PING the brokers from now on
            asyncio.get_running_loop()
        except RuntimeError:  # not yet: at the first request
            return
        self._bind()

    # ------------------------------------------------------------ requests

    def submit(self, pending: Pending, to: str | None = None) -> None:
        """Send ``pending`` now if nothing was handed over in this pass of the event
        loop, else give it to its link's turn batch; a turn follows either way. Call on
        the event loop's thread (a coroutine of the client)."""
        refuse_if_forked(self._pid)
        if self._closed:
            raise ClosedError("the client is closed")
        self._bind()
        core, now = self.core, time.monotonic()
        link = None if self._scheduled or to is not None else core.place_direct(pending, now)
        if link is None:
            core.submit(pending, now, to)
        else:
            try:
                link.send(pending)
            except BaseException as exc:  # Ctrl-C between the frames of a message
                self._sockets[link.endpoint].end_torn_message()
                core.torn(pending, exc)
                raise
        self._schedule()

    def _bind(self) -> None:
        """Take the running event loop as this client's, at its first use."""
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        if self._loop is not None:
            raise RuntimeUsageError(
                "an AsyncClient serves the event loop it was first used on; create "
                "another AsyncClient for this one"
            )
        self._loop = loop
        loop.add_reader(self._waker.fileno(), self._on_waker)
        for endpoint, sockets in self._sockets.items():
            self._watch(endpoint, sockets)
        self.core.tick(now=time.monotonic(), now_ns=time.perf_counter_ns())  # the PINGs
        self._schedule()  # a turn after the sends, which plans the next

    def _watch(self, endpoint: str, sockets: LinkSocket) -> None:
        assert self._loop is not None
        self._loop.add_reader(sockets.fd, self._on_readable, endpoint, sockets)
        self._loop.add_reader(sockets.monitor_fd, self._schedule)

    def _unwatch(self, sockets: LinkSocket) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(sockets.fd)
            self._loop.remove_reader(sockets.monitor_fd)

    # ------------------------------------------------------------ links

    def _linked(self, endpoint: str, sockets: LinkSocket) -> None:
        if self._loop is not None:
            self._watch(endpoint, sockets)

    def _unlinked(self, sockets: LinkSocket) -> None:
        self._unwatch(sockets)

    def _on_readable(self, endpoint: str, sockets: LinkSocket) -> None:
        """A socket's descriptor fired. It may have fired before this pass's turn read
        what it announced (the selector ran first): a turn is due only if something is
        still there -- asking is itself the check that resets the descriptor, and a
        needless turn would make this pass's requests wait for it instead of leaving
        at once."""
        link = self.core.links.get(endpoint)
        if link is not None and sockets.ready(want_room=bool(link.unsent)):
            self._schedule()

    def _on_waker(self) -> None:
        self._waker.clear()
        self._schedule()

    # ------------------------------------------------------------ turns

    def _schedule(self) -> None:
        if not self._scheduled and not self._closed and self._loop is not None:
            self._scheduled = True
            self._loop.call_soon(self._turn)

    def _on_timer(self) -> None:
        self._timer = None
        self._turn()

    def _turn(self) -> None:
        """Receive, tick, send, settle; then plan the next turn."""
        self._scheduled = False
        if self._closed:
            return
        core, now = self.core, time.monotonic()
        for endpoint, sockets in list(self._sockets.items()):
            link = core.links[endpoint]
            for event, value in sockets.connection_events():
                core.on_connection_event(link, event, value, now)
            for frames in sockets.receive(self.config.recv_batch):
                core.on_frames(link, frames, now)
        core.send_unsent()
        self._follow_endpoints()
        core.tick(now, time.perf_counter_ns())
        core.flush()
        if core.due:
            settle(core.due)  # asyncio futures: their callbacks run in a later pass
            # The coroutines just woken run next, before this turn: what they send then
            # goes to the turn batch and leaves together in that turn, as the Client's
            # done-callbacks' requests do (one REQUESTS message, one job for a group),
            # rather than the first alone and the rest a turn later.
            self._schedule()
        self._plan()

    def _plan(self) -> None:
        """The last operation on each socket: run again at once if something is ready
        (the descriptors signal only what comes after this), else at the next PING or
        deadline."""
        if self._sockets_ready():
            self._schedule()
            return
        loop = self._loop
        assert loop is not None
        at = loop.time() + min(self._wait_s(), MAX_WAIT_S) + 0.001
        if self._timer is not None:
            if self._timer_at <= at:
                return  # an earlier turn is harmless: it plans again
            self._timer.cancel()
        self._timer_at = at
        self._timer = loop.call_at(at, self._on_timer)

    # ------------------------------------------------------------ closing

    def close(self) -> None:
        """Fail what is pending with :class:`ClosedError`, let the sockets go."""
        if self._closed:
            return
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._waker.fileno())
        for sockets in self._sockets.values():
            self._unwatch(sockets)
            if os.getpid() == self._pid:
                sockets.close()
        for pending in self.core.take_outstanding():
            with contextlib.suppress(RuntimeError):  # its event loop is closed already
                pending.fail(ClosedError("the client is closed"))
        self._waker.close()
