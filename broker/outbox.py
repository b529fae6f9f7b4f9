"""Sending on the broker's two ROUTER sockets without ever blocking the loop.

Both ROUTERs set ROUTER_MANDATORY, so a send to a peer that is gone raises
EHOSTUNREACH and a send to a peer whose pipe is full raises EAGAIN instead of
silently dropping or blocking. A reply that does not fit waits in that client's
backlog (in order, frames by reference) and is retried by :meth:`Outbox.flush`;
only a client whose backlog is full — one that stopped reading — loses replies
(counted). A worker we cannot reach is reported to the caller, which drops it and
re-queues its jobs.
"""

from __future__ import annotations

import errno
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import zmq

from ipuserve import protocol as wire
from ipuserve.broker.metrics import BrokerMetrics
from ipuserve.protocol import Frame

log = logging.getLogger(__name__)

Frames = Sequence[Frame]


class Outbox:
    def __init__(
        self,
        frontend: zmq.Socket[Any],
        backend: zmq.Socket[Any],
        metrics: BrokerMetrics,
        backlog_limit: int,
    ) -> None:
        self._frontend = frontend
        self._backend = backend
        self._dropped = metrics.dropped
        self._backlog_limit = backlog_limit
        self._backlogs: dict[bytes, deque[Frames]] = {}
        #: clients a reply could not reach (disconnected), and since when; forgotten
        #: when they are heard from again (reconnected) or their queue is dropped
        self.unreachable: dict[bytes, float] = {}

    @property
    def pending(self) -> bool:
        """Replies wait for a slow client: call :meth:`flush` again soon."""
        return bool(self._backlogs)

    def to_client(self, identity: bytes, frames: Frames) -> bool:
        """Send, or keep for later; False only if the reply is lost (and counted)."""
        backlog = self._backlogs.get(identity)
        if backlog is not None:
            return self._defer(backlog, frames)
        reason = _send(self._frontend, identity, frames)
        if reason == "unwritable":
            return self._defer(self._backlogs.setdefault(identity, deque()), frames)
        if reason == "gone":
            self._dropped.inc(reason="client_gone")
            self.unreachable.setdefault(identity, time.monotonic())
        return reason is None

    def _defer(self, backlog: deque[Frames], frames: Frames) -> bool:
        if len(backlog) >= self._backlog_limit:
            self._dropped.inc(reason="client_backlog_full")
            return False
        backlog.append(frames)
        return True

    def flush(self) -> None:
        """Retry the backlogs, oldest reply first, until each client's pipe is full again."""
        for identity, backlog in list(self._backlogs.items()):
            while backlog:
                reason = _send(self._frontend, identity, backlog[0])
                if reason == "unwritable":
                    break
                if reason == "gone":
                    self._dropped.inc(len(backlog), reason="client_gone")
                    self.unreachable.setdefault(identity, time.monotonic())
                    backlog.clear()
                    break
                backlog.popleft()
            if not backlog:
                del self._backlogs[identity]

    def to_worker(self, identity: bytes, frames: Frames) -> bool:
        reason = _send(self._backend, identity, frames)
        if reason is not None:
            self._dropped.inc(reason=f"worker_{reason}")
        return reason is None

    def heard_from(self, client: bytes) -> None:
        """A client sent something: it is reachable again, and keeps its queue."""
        if self.unreachable:
            self.unreachable.pop(client, None)

    def worker_connected(self, identity: bytes, heartbeat: Frames) -> bool:
        """Whether a worker's connection is still up, by sending it a heartbeat: ZeroMQ
        forgets a peer whose connection closed (a process that died), and a send to it
        fails at once. A full pipe still means connected."""
        return _send(self._backend, identity, heartbeat) != "gone"


def _send(sock: zmq.Socket[Any], identity: bytes, frames: Frames) -> str | None:
    """Send one message; None when sent, else why not ("unwritable" or "gone")."""
    try:
        wire.send(sock, frames, identity=identity, nonblock=True)
    except zmq.Again:
        return "unwritable"
    except zmq.ZMQError as exc:
        if exc.errno == errno.EHOSTUNREACH:
            return "gone"
        raise
    return None
