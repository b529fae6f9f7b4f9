"""The client's sockets, as both drivers of the core open and use them: a DEALER per
link with its connection monitor, and the :class:`~ipuserve.client.link.Port` the
core sends through.

The drivers (:mod:`ipuserve.client.thread_loop`, :mod:`ipuserve.client.async_loop`)
wait on each socket's ``zmq.FD``, which is edge-triggered: it signals what waits in
the socket's mailbox, and *any* operation on the socket may consume that signal. So
whoever operated on a socket checks :func:`ready` as its last operation before it
waits, and does not wait when a message (or, with sends deferred, room) is there.
"""

from __future__ import annotations

import contextlib
from typing import Any, cast

import zmq
from zmq.utils.monitor import recv_monitor_message

from ipuserve import protocol as wire
from ipuserve import transport
from ipuserve.client.config import ClientConfig
from ipuserve.client.liveness import connection_monitor
from ipuserve.errors import ConfigError
from ipuserve.security import ClientKeys

_EVENTS, _POLLIN, _POLLOUT = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.POLLOUT)


class LinkSocket:
    """One link's DEALER, its monitor and its edge-triggered descriptor; the core's
    :class:`~ipuserve.client.link.Port` for that link."""

    def __init__(self, sock: zmq.Socket[Any], monitor: zmq.Socket[Any]) -> None:
        self.sock = sock
        self.monitor = monitor
        self.fd = cast(int, sock.get(zmq.FD))
        self.monitor_fd = cast(int, monitor.get(zmq.FD))

    def send_frames(self, frames: list[wire.Frame]) -> bool:
        """Send without blocking and without copying tensors; False: the pipe was full."""
        try:
            transport.send(self.sock, frames, nonblock=True)
        except zmq.Again:
            return False
        return True

    def ready(self, want_room: bool) -> bool:
        """A message waits (or room, when ``want_room``): the last operation on the
        socket before its driver waits on :attr:`fd`."""
        events: int = self.sock.get(_EVENTS)  # type: ignore[assignment]
        return bool(events & _POLLIN or (want_room and events & _POLLOUT))

    def receive(self, limit: int) -> list[list[zmq.Frame]]:
        """Up to ``limit`` whole messages that wait, without blocking."""
        received = []
        for _ in range(limit):
            frames = transport.try_recv(self.sock)
            if frames is None:
                break
            received.append(frames)
        return received

    def connection_events(self) -> list[tuple[int, int]]:
        """What the monitor saw since last asked: (event, value) pairs."""
        events = []
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            events.append((int(event["event"]), int(event["value"])))
        return events

    def end_torn_message(self) -> None:
        """A send cut short between frames (Ctrl-C): end the message with an empty
        frame, which the broker refuses as malformed, so that the next message is not
        glued to it."""
        with contextlib.suppress(zmq.ZMQError):
            self.sock.send(b"", zmq.NOBLOCK)

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)


def open_socket(
    context: zmq.Context[Any],
    endpoint: str,
    routing_id: bytes,
    config: ClientConfig,
    keys: ClientKeys | None,
) -> LinkSocket:
    """A DEALER (CURVE with ``keys``) connecting to ``endpoint``, with its connection
    monitor attached first (a first handshake it missed left the client thinking it
    never connected); :class:`ConfigError` when ZeroMQ refuses the endpoint."""
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
    return LinkSocket(sock, monitor)
