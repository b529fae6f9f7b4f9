"""One link per broker frontend: a DEALER socket with its own liveness, for a client
that talks to several brokers (:mod:`ipuserve.client.links_loop`).

A :class:`Link` is what the single-broker :class:`~ipuserve.client.io_loop.IoLoop`
keeps about its one socket -- the broker's liveness (PING/PONG, epoch, silence), its
payload limit, what is held for that limit or unsent for the HWM, a turn's
:class:`~ipuserve.client.outbox.Outbox` -- and the ids of the pending requests sent
on it. The requests themselves stay in the loop's one :class:`PendingTable`, shared
by every link: a reply settles its request whichever broker sends it, and only the
first settles it (a second, from the broker that had it before a failover, finds the
id gone and is dropped and counted).

Only the loop's I/O thread touches a link. :func:`open_socket` is also how the
single-broker client opens its socket, so both connect alike.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from ipuserve import protocol as wire
from ipuserve.client.config import ClientConfig, ClientStats
from ipuserve.client.liveness import Liveness, connection_monitor
from ipuserve.client.outbox import Outbox
from ipuserve.client.pending import Pending, PendingTable
from ipuserve.client.replies import Replies
from ipuserve.errors import ConfigError, PayloadTooLargeError, UnknownModelError
from ipuserve.security import ClientKeys

log = logging.getLogger(__name__)

#: silence since a link opened after which "is the broker running?" is a fair question
_SUSPECT_SILENCE_S = 0.05


def open_socket(
    context: zmq.Context[Any],
    endpoint: str,
    routing_id: bytes,
    config: ClientConfig,
    keys: ClientKeys | None,
) -> tuple[zmq.Socket[Any], zmq.Socket[Any]]:
    """A DEALER (CURVE with ``keys``) connecting to ``endpoint``, and its connection
    monitor (attached first); :class:`ConfigError` when ZeroMQ refuses the endpoint."""
    sock: zmq.Socket[Any] = context.socket(zmq.DEALER)
    monitor: zmq.Socket[Any] | None = None
    try:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, config.send_hwm)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, int(config.reconnect_max_s * 1000))
        if keys is not None:
            keys.apply(sock)
        monitor = connection_monitor(sock)
        sock.connect(endpoint)
    except zmq.ZMQError as exc:
        if monitor is not None:
            sock.disable_monitor()
            monitor.close(linger=0)
        sock.close(linger=0)
        raise ConfigError(f"cannot connect to {endpoint!r}: {exc.strerror}") from None
    return sock, monitor


def least_loaded(loads: Sequence[int], turn: int) -> int:
    """The index of the smallest load; among equal ones, the first at or after
    ``turn % len(loads)`` (round-robin), so one request at a time still visits every
    link instead of always the first. ``loads`` must not be empty."""
    count = len(loads)
    start = turn % count
    order: list[int] = [*range(start, count), *range(start)]
    best = order[0]
    for index in order:
        if loads[index] < loads[best]:
            best = index
    return best


class LinkReplies(Replies):
    """A link's replies: the shared table's, plus three changes for several brokers.

    A settled request leaves its link's list too (``forget``). A link pointed at a
    broker's backend (worker) port is only marked unusable: the requests it had go
    to the other links, instead of all of the client's failing as with one broker.
    UNKNOWN_MODEL from one broker is not the fleet's answer: a broker just restarted
    (its workers not back yet) or one the model's workers never joined says it while
    another serves the model, so the request tries the brokers it has not tried
    (``elsewhere``) before it fails.
    """

    def __init__(
        self,
        table: PendingTable,
        stats: ClientStats,
        liveness: Liveness,
        on_pong: Callable[[wire.Pong], None],
        forget: Callable[[bytes], None],
        elsewhere: Callable[[bytes], bool],
    ) -> None:
        super().__init__(table, stats, liveness, on_pong)
        self._forget = forget
        self._elsewhere = elsewhere

    def _on_error(self, error: wire.ErrorReply | wire.Fail) -> None:
        request_id = error.request_id if isinstance(error, wire.ErrorReply) else error.job_id
        if error.code == UnknownModelError.code and self._elsewhere(request_id):
            return
        super()._on_error(error)

    def finish(self, request_id: bytes, settle: Callable[[Pending], None]) -> None:
        super().finish(request_id, settle)
        self._forget(request_id)

    def _on_backend_port(self) -> None:
        if not self._liveness.backend_port:
            log.error("%s", self._liveness.silence_hint().removeprefix(": "))
        self._liveness.backend_port = True


class Link:
    """One broker frontend: its socket, its liveness and the requests sent there."""

    def __init__(
        self,
        endpoint: str,
        sockets: tuple[zmq.Socket[Any], zmq.Socket[Any]],
        config: ClientConfig,
        table: PendingTable,
        shared: ClientStats,
        forget: Callable[[bytes], None],
        elsewhere: Callable[[Link, bytes], bool],
    ) -> None:
        """``shared``: the client's counters (sent, replies, re-sent...); this link's
        own (its broker's epoch and payload limit, reconnects, batches) are
        :attr:`stats`. ``forget`` drops a settled request from the loop's books;
        ``elsewhere`` gives a request this broker does not serve to another broker
        (False: there is none left to try)."""
        self.endpoint = endpoint
        self.sock, self.monitor = sockets
        self.config = config
        self.stats = ClientStats()
        self.liveness = Liveness(config, endpoint, _SUSPECT_SILENCE_S)
        self._table = table
        self._shared = shared
        #: the pending requests sent (or to be sent) on this link, in order
        self.ids: dict[bytes, None] = {}
        #: ids too big to send before this broker's limit is known (its first PONG)
        self.held: dict[bytes, None] = {}
        #: ids that found the socket's pipe full, to send once it has room
        self.unsent: dict[bytes, None] = {}
        self.outbox = Outbox(config, self.stats, self, self._current)
        self.replies = LinkReplies(
            table, shared, self.liveness, self._on_pong, forget, lambda rid: elsewhere(self, rid)
        )
        #: a PONG arrived this turn: the loop may have requests for this link now
        self.answered = False

    def __repr__(self) -> str:
        return f"Link({self.endpoint!r}, pending={len(self.ids)})"

    def _current(self, request_id: bytes) -> Pending | None:
        return self._table.get(request_id) if request_id in self.ids else None

    # ------------------------------------------------------------ state

    def usable(self, now: float) -> bool:
        """New requests may go here: connected, heard within the liveness window (a
        PONG a second on an idle link), not shutting down, not a backend port."""
        live = self.liveness
        return (
            live.connected
            and not live.broker_shut_down
            and not live.backend_port
            and now - live.last_heard <= self.config.liveness_s
        )

    def why_unusable(self, now: float) -> str:
        live = self.liveness
        if live.backend_port:
            return "a backend (worker) port"
        if live.broker_shut_down:
            return "shutting down"
        if not live.connected:
            return "disconnected"
        return f"silent for {now - live.last_heard:.1f} s"

    # ------------------------------------------------------------ sending

    def send(self, pending: Pending) -> None:
        """Send one request under the per-request rules (limit, hold, HWM)."""
        size, limit = pending.payload_bytes, self.stats.max_payload_bytes
        if limit is not None and size > limit:
            error = PayloadTooLargeError(
                f"the request's tensors take {size} bytes; the limit of the broker at "
                f"{self.endpoint} is {limit}"
            )
            self.replies.finish(pending.request_id, lambda p: p.fail(error))
        elif size > wire.FRAME_SLACK_BYTES and (limit is None or not self.liveness.connected):
            self.held[pending.request_id] = None  # sent by _on_pong (see IoLoop._send)
        elif not self.send_frames(pending.frames(time.perf_counter_ns())):
            self.unsent[pending.request_id] = None

    def send_frames(self, frames: list[wire.Frame]) -> bool:
        """Send without blocking and without copying tensors; False: the pipe was full."""
        try:
            wire.send(self.sock, frames, nonblock=True)
        except zmq.Again:
            return False
        return True

    def defer(self, request_ids: list[bytes]) -> None:
        self.unsent.update(dict.fromkeys(request_ids))

    def send_unsent(self) -> None:
        """Send, in order, what found the pipe full, while it has room."""
        for request_id in list(self.unsent):
            del self.unsent[request_id]
            pending = self._current(request_id)
            if pending is not None:
                self.send(pending)
                if request_id in self.unsent:
                    return

    def resend_all(self) -> None:
        """Every request of this link again, with its id (a reconnection, a new epoch)."""
        for request_id in list(self.ids):
            pending = self._table.get(request_id)
            if pending is not None:
                self.send(pending)
                self._shared.resent += 1

    def ping(self, now: float) -> None:
        self.liveness.pinged(now)
        self.send_frames(wire.Ping().encode())

    # ------------------------------------------------------------ receiving

    def receive(self, now: float) -> None:
        for _ in range(self.config.recv_batch):
            frames = wire.try_recv(self.sock)
            if frames is None:
                return
            self.liveness.heard(now)
            self.replies.on_frames(frames)

    def on_connection_events(self, now: float) -> bool:
        """Handle the monitor's events; True when the connection was lost."""
        lost = False
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            lost = lost or event["event"] == zmq.EVENT_DISCONNECTED
            if self.liveness.on_connection_event(
                event["event"], self.stats, len(self.ids), event["value"]
            ):
                self.ping(now)
                self.resend_all()
        return lost

    def _on_pong(self, pong: wire.Pong) -> None:
        held, self.held = self.held, {}
        self.answered = True
        if self.liveness.on_pong(pong, self.stats, len(self.ids)):
            self.resend_all()
            return
        for request_id in held:
            pending = self._current(request_id)
            if pending is not None:
                self.send(pending)

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)
