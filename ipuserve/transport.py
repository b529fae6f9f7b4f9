"""Sending and receiving encoded messages on ZeroMQ sockets, and the socket frame limit.

The wire package imports no zmq: this module is where the wire meets the sockets.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import zmq

from ipuserve.protocol import Frame

#: ZeroMQ drops the connection of a peer sending a frame beyond a socket's
#: ``ZMQ_MAXMSGSIZE``: nobody can be answered then. Sockets set it this far above the
#: payload limit, so a frame of at most this size never trips it, whatever the limit;
#: bigger ones are refused by the sender, which learns the receiver's limit first.
FRAME_SLACK_BYTES = 1 << 20


def max_frame_bytes(max_payload_bytes: int) -> int:
    """``ZMQ_MAXMSGSIZE`` for a socket that accepts payloads of ``max_payload_bytes``."""
    return max_payload_bytes + FRAME_SLACK_BYTES


# pyzmq's Socket.send/recv_multipart wrap the Cython methods in Python (flag enums,
# group checks, a loop per frame): several microseconds per frame, which is most of
# a broker's time per message. These call the Cython methods of zmq.Socket's base
# class directly. Sending, the envelope and header (small bytes) are copied and
# tensor frames passed by reference (pyzmq still copies those below its copy
# threshold). Receiving, every frame comes as a zmq.Frame: measured on the Cython
# methods, that is cheaper than receiving the small frames as bytes, which needs a
# getsockopt(RCVMORE) per frame where a Frame carries ``more`` already.

_BASE = next(
    (c for c in zmq.Socket.__mro__[1:] if {"send", "recv", "get"} <= vars(c).keys()), zmq.Socket
)
_SEND: Callable[..., Any] = getattr(_BASE, "send")  # noqa: B009  (a Cython base class)
_RECV: Callable[..., Any] = getattr(_BASE, "recv")  # noqa: B009
_POLL: Callable[..., list[Any]] = zmq.zmq_poll
_POLLIN = int(zmq.POLLIN)
_MORE = int(zmq.SNDMORE)
_NOBLOCK = int(zmq.NOBLOCK)


def send(
    sock: zmq.Socket[Any],
    frames: Sequence[Frame],
    *,
    identity: bytes | None = None,
    nonblock: bool = False,
) -> None:
    """Send one encoded message, behind ``identity`` on a ROUTER.

    With ``nonblock``, zmq.Again (peer's pipe full) or a ZMQError (EHOSTUNREACH under
    ROUTER_MANDATORY) is raised by the first frame, before anything was queued.
    """
    flags = _NOBLOCK if nonblock else 0
    more = flags | _MORE
    if identity is not None:
        _SEND(sock, identity, more, True, False)
    last = len(frames) - 1
    _SEND(sock, frames[0], more, True, False)
    _SEND(sock, frames[1], flags if last == 1 else more, True, False)
    for index in range(2, last + 1):
        _SEND(sock, frames[index], flags if index == last else more, False, False)


def recv(sock: zmq.Socket[Any]) -> list[zmq.Frame]:
    """Receive one whole message as zmq.Frame objects (no copy of any frame); blocks."""
    frame = _RECV(sock, 0, False, False)
    frames = [frame]
    while frame.more:
        frame = _RECV(sock, 0, False, False)
        frames.append(frame)
    return frames


def readable(sock: zmq.Socket[Any]) -> bool:
    """A whole message waits: a zmq_poll of this socket that does not wait.

    Cheaper than the zmq.Again a non-blocking recv raises, and than asking ZMQ_EVENTS
    (pyzmq's Socket.get makes a SocketOption enum of the option on every call: two
    Python calls). Measured on an idle and a ready PAIR socket: 0.76-0.80 us against
    1.01-1.37 us a call (timeit, 5 x 100,000)."""
    return bool(_POLL([(sock, _POLLIN)], 0))


def try_recv(sock: zmq.Socket[Any]) -> list[zmq.Frame] | None:
    """One whole message if one waits, else None."""
    return recv(sock) if readable(sock) else None
