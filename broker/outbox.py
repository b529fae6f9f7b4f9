"""Sending on the broker's two ROUTER sockets without ever blocking the loop.

Both ROUTERs set ROUTER_MANDATORY, so a send to a peer that is gone raises
EHOSTUNREACH and a send to a peer whose queue is full (it stopped reading) raises
EAGAIN instead of silently dropping or blocking. A client that stops reading loses
the replies that do not fit (counted); a worker we cannot reach is reported to the
caller, which drops it and re-queues its jobs.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Sequence
from typing import Any

import zmq

from ipuserve.broker.metrics import BrokerMetrics
from ipuserve.protocol import Frame

log = logging.getLogger(__name__)


class Outbox:
    def __init__(
        self, frontend: zmq.Socket[Any], backend: zmq.Socket[Any], metrics: BrokerMetrics
    ) -> None:
        self._frontend = frontend
        self._backend = backend
        self._dropped = metrics.dropped

    def to_client(self, identity: bytes, frames: Sequence[Frame]) -> bool:
        reason = _send(self._frontend, identity, frames)
        if reason is not None:
            self._dropped.inc(reason=f"client_{reason}")
        return reason is None

    def to_worker(self, identity: bytes, frames: Sequence[Frame]) -> bool:
        reason = _send(self._backend, identity, frames)
        if reason is not None:
            self._dropped.inc(reason=f"worker_{reason}")
        return reason is None


def _send(sock: zmq.Socket[Any], identity: bytes, frames: Sequence[Frame]) -> str | None:
    """Send one message; None when sent, else why not ("unwritable" or "gone")."""
    try:
        sock.send(identity, zmq.SNDMORE | zmq.NOBLOCK)
    except zmq.Again:
        return "unwritable"
    except zmq.ZMQError as exc:
        if exc.errno == errno.EHOSTUNREACH:
            return "gone"
        raise
    # The peer accepted the first frame; the rest of the message goes with it.
    sock.send_multipart(frames, copy=False)  # type: ignore[arg-type]
    return None
