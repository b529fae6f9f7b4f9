"""Sending on the broker's two ROUTER sockets without ever blocking the loop.

Both ROUTERs set ROUTER_MANDATORY, so a send to a peer that is gone raises
EHOSTUNREACH and a send to a peer whose pipe is full raises EAGAIN instead of
silently dropping or blocking. A reply that does not fit waits in that client's
backlog (in order, frames by reference) and is retried by :meth:`Backlog.flush`;
only a client whose backlog is full — one that stopped reading — loses replies
(counted). A worker we cannot reach is reported to the caller, which drops it and
re-queues its jobs.

Both waits are timers on the broker's one heap, armed when they start: the backlog's
retry (every ``BACKLOG_RETRY_S`` while one is pending) and, for a client a reply
could not reach at all, the end of its liveness window, when :attr:`Backlog.abandon`
drops what it still has queued.
"""

from __future__ import annotations

import errno
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from ipuserve import transport
from ipuserve.broker.metrics import BrokerMetrics
from ipuserve.broker.timers import Timers
from ipuserve.protocol import Frame

log = logging.getLogger(__name__)

Frames = Sequence[Frame]
#: How soon to retry replies waiting for a client whose pipe was full.
BACKLOG_RETRY_S = 0.002


def _keep(_client: bytes) -> None:
    """What :attr:`Backlog.abandon` does until the broker sets it (the job life's)."""


class Backlog:
    """The broker's sends on its two ROUTERs, none of which blocks: a reply a client's
    pipe cannot take yet joins that client's backlog (the name: what it keeps), a
    worker's send that fails is reported (the caller drops the worker)."""

    def __init__(
        self,
        frontend: zmq.Socket[Any],
        backend: zmq.Socket[Any],
        metrics: BrokerMetrics,
        backlog_limit: int,
        timers: Timers,
        liveness_s: float,
    ) -> None:
        self._frontend = frontend
        self._backend = backend
        self._dropped = metrics.dropped
        self._backlog_limit = backlog_limit
        self._backlogs: dict[bytes, deque[Frames]] = {}
        self._timers = timers
        self._liveness_s = liveness_s
        self._retry_armed = False
        #: clients a reply could not reach (disconnected), and since when; forgotten
        #: when they are heard from again (reconnected) or their queue is dropped
        self.unreachable: dict[bytes, float] = {}
        #: called with a client unreachable for a liveness window: drop its queued jobs
        self.abandon: Callable[[bytes], None] = _keep

    def to_client(self, identity: bytes, frames: Frames) -> bool:
        """Send, or keep for later; False only if the reply is lost (and counted)."""
        backlog = self._backlogs.get(identity)
        if backlog is not None:
            return self._defer(backlog, frames)
        reason = _send(self._frontend, identity, frames)
        if reason is None:
            return True
        if reason == "unwritable":
            return self._defer(self._backlogs.setdefault(identity, deque()), frames)
        self._dropped.labels("client_gone").inc()
        self._lost(identity)
        return False

    def _defer(self, backlog: deque[Frames], frames: Frames) -> bool:
        if len(backlog) >= self._backlog_limit:
            self._dropped.labels("client_backlog_full").inc()
            return False
        backlog.append(frames)
        if not self._retry_armed:
            self._retry_armed = True
            self._timers.at(time.monotonic() + BACKLOG_RETRY_S, self._retry)
        return True

    def _retry(self, _arg: None, now: float) -> None:
        self._retry_armed = False
        self.flush()
        if self._backlogs:
            self._retry_armed = True
            self._timers.at(now + BACKLOG_RETRY_S, self._retry)

    def _lost(self, identity: bytes) -> None:
        """A reply found no client: from now on it has one liveness window to return."""
        if identity not in self.unreachable:
            since = self.unreachable[identity] = time.monotonic()
            self._timers.at(since + self._liveness_s, self._give_up, identity)

    def _give_up(self, identity: bytes, now: float) -> None:
        since = self.unreachable.get(identity)
        if since is not None and now - since >= self._liveness_s:
            del self.unreachable[identity]
            self.abandon(identity)

    def flush(self) -> None:
        """Retry the backlogs, oldest reply first, until each client's pipe is full again."""
        for identity, backlog in list(self._backlogs.items()):
            while backlog:
                reason = _send(self._frontend, identity, backlog[0])
                if reason == "unwritable":
                    break
                if reason == "gone":
                    self._dropped.labels("client_gone").inc(len(backlog))
                    self._lost(identity)
                    backlog.clear()
                    break
                backlog.popleft()
            if not backlog:
                del self._backlogs[identity]

    def to_worker(self, identity: bytes, frames: Frames) -> bool:
        reason = _send(self._backend, identity, frames)
        if reason is not None:
            self._dropped.labels(f"worker_{reason}").inc()
        return reason is None

    def heard_from(self, client: bytes) -> None:
        """A client sent something: it is reachable again, and keeps its queue (its
        timer, when it fires, finds it gone from :attr:`unreachable`)."""
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
        transport.send(sock, frames, identity=identity, nonblock=True)
    except zmq.Again:
        return "unwritable"
    except zmq.ZMQError as exc:
        if exc.errno == errno.EHOSTUNREACH:
            return "gone"
        raise
    return None
