"""One joined connection to a broker: its clock and its socket, apart from what is served.

A :class:`~ipuserve.worker.node.WorkerNode` decides what to send and what a message
means; a :class:`Connection` keeps the timekeeping both ends agreed on in WELCOME (when
the next heartbeat is due, when the broker has been silent too long) and sends without
ever blocking the loop. It lives from WELCOME until the loop leaves it (:class:`Exit`
says why); a reconnect makes a new one on a fresh socket. Named apart from the
runtime's ``Session``.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass
from typing import Any

import zmq

from ipuserve import protocol as wire
from ipuserve import transport
from ipuserve.worker.joining import Joined

log = logging.getLogger(__name__)


class Exit(enum.Enum):
    """Why the loop left a connection."""

    STOP = "stop requested"
    SILENT = "broker silent past its liveness window"
    RECONNECT = "broker asked us to reconnect (it does not know us)"
    NEW_EPOCH = "broker restarted (new epoch)"


@dataclass(slots=True)
class Connection:
    """One joined socket to the broker and its heartbeat schedule."""

    socket: zmq.Socket[Any]
    epoch: str
    heartbeat_s: float
    liveness_s: float
    last_heard: float
    next_heartbeat: float = 0.0

    @classmethod
    def welcomed(cls, joined: Joined, heartbeat_ms: float) -> Connection:
        """The connection a WELCOME opens: heartbeats at the shorter of our interval
        and the broker's, so that neither side thinks the other silent."""
        welcome = joined.welcome
        heartbeat_s = min(heartbeat_ms, welcome.heartbeat_ms) / 1000
        liveness_s = welcome.liveness_ms / 1000
        return cls(joined.socket, welcome.epoch, heartbeat_s, liveness_s, time.monotonic())

    def timeout_ms(self, next_expiry: float) -> int:
        """How long the loop may wait: until a heartbeat is due, the broker's liveness
        window closes or ``next_expiry`` (a monotonic time) comes, whichever is first."""
        wake = min(self.next_heartbeat, self.last_heard + self.liveness_s, next_expiry)
        return max(0, int((wake - time.monotonic()) * 1000) + 1)

    def receive(self) -> list[Any] | None:
        """The next message's frames if one is waiting (the broker heard from), else None."""
        frames = transport.try_recv(self.socket)
        if frames is not None:
            self.last_heard = time.monotonic()
        return frames

    def silent(self, now: float) -> bool:
        """Whether the broker said nothing for longer than its liveness window."""
        return now - self.last_heard > self.liveness_s

    def heartbeat_due(self, now: float) -> bool:
        """Whether a heartbeat is due at ``now``; if so the next is scheduled, so the
        caller must send one."""
        if now < self.next_heartbeat:
            return False
        self.next_heartbeat = now + self.heartbeat_s
        return True

    def send(self, message: wire.Message) -> None:
        self.send_frames(message.encode(), message.COMMAND.name)

    def send_frames(self, frames: list[wire.Frame], what: str) -> None:
        """Send without ever blocking the loop; a message the broker cannot take is dropped."""
        try:
            transport.send(self.socket, frames, nonblock=True)
        except zmq.Again:
            log.warning("broker not accepting messages; dropped %s", what)

    def close(self, linger: int) -> None:
        self.socket.close(linger=linger)
