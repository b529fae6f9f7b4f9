"""One link of the client's core: what it keeps about one broker frontend (one
endpoint, or one address of a name), without the socket.

A :class:`Link` holds the broker's liveness (PING/PONG, epoch, silence), its payload
limit, what is held for that limit or deferred for the socket's high-water mark, a
turn's :class:`~ipuserve.client.turn_batch.TurnBatch` (``batch``), the
:class:`~ipuserve.client.reply_router.ReplyRouter` that settles what its broker sends
(``router``), and the ids of the pending requests given to it. The requests themselves
stay in the core's one :class:`~ipuserve.client.pending.PendingTable`, shared by every
link: a reply settles its request whichever broker sends it, and only the first
settles it (a second, from the broker that had it before a failover, finds the id gone
and is dropped and counted).

A link does no I/O of its own: it sends through the :class:`Port` its driver gives it
(a non-blocking ``send_frames``), and is told what the socket received and what its
connection monitor saw (:mod:`ipuserve.client.core`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import zmq

from ipuserve import protocol as wire
from ipuserve import transport
from ipuserve.client.config import ClientConfig, ClientStats
from ipuserve.client.groups import MODELS_PROBE, GroupRules
from ipuserve.client.lacking import Lacking
from ipuserve.client.liveness import Liveness
from ipuserve.client.pending import Pending, PendingTable
from ipuserve.client.reply_router import Due, ReplyRouter
from ipuserve.client.turn_batch import TurnBatch
from ipuserve.errors import PayloadTooLargeError

#: silence since a link opened after which "is the broker running?" is a fair question:
#: a PONG on a working connection takes milliseconds
SUSPECT_SILENCE_S = 0.05


class Port(Protocol):
    """How a link sends: what its driver gives it for its socket."""

    def send_frames(self, frames: list[wire.Frame]) -> bool:
        """Send one encoded message without blocking and without copying tensors;
        False: the socket's pipe was full (nothing was queued)."""


class Link:
    """One broker frontend: its liveness and the requests sent there (no socket)."""

    def __init__(
        self,
        endpoint: str,
        port: Port,
        config: ClientConfig,
        table: PendingTable,
        shared: ClientStats,
        due: Due,
        forget: Callable[[bytes], None],
        elsewhere: Callable[[Link, bytes], bool],
        lacking: Lacking,
    ) -> None:
        """``shared``: the client's counters (sent, replies, re-sent...); this link's
        own (its broker's epoch and payload limit, reconnects, batches) are
        :attr:`stats`. ``due``: where settled requests wait for the driver.
        ``forget`` drops a settled request from the core's books; ``elsewhere`` gives
        a request this broker does not serve to another broker (False: there is none
        left to try); ``lacking`` is told the models this broker lists."""
        self.endpoint = endpoint
        self.port = port
        self.config = config
        self.stats = ClientStats()
        self.liveness = Liveness(config, endpoint, SUSPECT_SILENCE_S)
        self._table = table
        self._shared = shared
        #: the pending requests sent (or to be sent) on this link, in order
        self.ids: dict[bytes, None] = {}
        #: ids too big to send before this broker's limit is known (its first PONG)
        self.held: dict[bytes, None] = {}
        #: ids that found the socket's pipe full, to send once it has room
        self.unsent: dict[bytes, None] = {}
        #: what this broker said about its models' groups
        self.groups = GroupRules()
        self.batch = TurnBatch(config, self.stats, self, self._current, self.groups)
        self.router = ReplyRouter(
            table,
            shared,
            self.liveness,
            due,
            self._on_pong,
            forget,
            lambda rid: elsewhere(self, rid),
            self.groups,
            lambda models: lacking.serves(endpoint, models),
        )

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
        if live.refused is not None and not live.connected:
            return "refusing the handshake"
        if not live.connected:
            return "disconnected"
        return f"silent for {now - live.last_heard:.1f} s"

    def sendable(self, pending: Pending) -> bool:
        """:meth:`send` would send it now: within the limit, not held for the PONG."""
        size, limit = pending.payload_bytes, self.stats.max_payload_bytes
        if limit is not None and size > limit:
            return False
        return size <= transport.FRAME_SLACK_BYTES or (
            limit is not None and self.liveness.connected
        )

    # ------------------------------------------------------------ sending

    def send(self, pending: Pending) -> None:
        """Send one request under the per-request rules (limit, hold, HWM).

        Held until the first PONG: a request beyond ``transport.FRAME_SLACK_BYTES``
        while the broker's limit is unknown (its ZeroMQ would drop the connection, and
        nobody could answer), and while disconnected too: the broker back may have a
        smaller limit, and a frame waiting in ZeroMQ's pipe could not be taken back."""
        size, limit = pending.payload_bytes, self.stats.max_payload_bytes
        if limit is not None and size > limit:
            error = PayloadTooLargeError(
                f"the request's tensors take {size} bytes; the limit of the broker at "
                f"{self.endpoint} is {limit}"
            )
            self.router.finish(pending.request_id, lambda p: p.fail(error))
        elif not self.sendable(pending):
            self.held[pending.request_id] = None  # sent by _on_pong
        elif not self.port.send_frames(pending.frames(time.perf_counter_ns())):
            self.unsent[pending.request_id] = None

    def send_frames(self, frames: list[wire.Frame]) -> bool:
        """The turn batch's way to the socket."""
        return self.port.send_frames(frames)

    def defer(self, request_ids: list[bytes]) -> None:
        self.unsent.update(dict.fromkeys(request_ids))

    def ask_models(self) -> None:
        """A MODELS of the link's own: its reply tells the turn batch how to group."""
        self.port.send_frames(wire.ListModels(MODELS_PROBE).encode())

    def send_unsent(self) -> None:
        """Send, in order, what found the pipe full, while it has room. Nothing else
        would: the re-send after a silence never comes while the broker answers the
        rest, and such requests once waited out their timeout (or for ever)."""
        for request_id in list(self.unsent):
            del self.unsent[request_id]
            pending = self._current(request_id)
            if pending is not None:
                self.send(pending)
                if request_id in self.unsent:
                    return  # full again

    def resend_all(self) -> None:
        """Every request of this link again, with its id (a reconnection, a new epoch)."""
        for request_id in list(self.ids):
            pending = self._table.get(request_id)
            if pending is not None:
                self.send(pending)
                self._shared.resent += 1

    def ping(self, now: float) -> None:
        self.liveness.pinged(now)
        self.port.send_frames(wire.Ping().encode())

    # ------------------------------------------------------------ receiving

    def on_frames(self, frames: list[zmq.Frame], now: float) -> None:
        """One message the socket received."""
        self.liveness.heard(now)
        self.router.on_frames(frames)

    def on_connection_event(self, event: int, value: int, now: float) -> None:
        """One event of the socket's connection monitor; a new connection re-sends."""
        if self.liveness.on_connection_event(event, self.stats, len(self.ids), value):
            self.ping(now)
            self.resend_all()

    def _on_pong(self, pong: wire.Pong) -> None:
        self.ask_models()  # a new connection or epoch: its models may have changed
        held, self.held = self.held, {}
        if self.liveness.on_pong(pong, self.stats, len(self.ids)):
            self.resend_all()  # what was held too: the limit is known now
            return
        for request_id in held:
            pending = self._current(request_id)
            if pending is not None:  # not expired meanwhile
                self.send(pending)
