"""Slow or half-open HTTP clients cannot hold the gateway: a deadline for a request's
headers, a cap on open connections.

A client that opens connections and trickles a byte now and then (slowloris) must not
hold them forever. aiohttp's keep-alive timeout (the door sets it to ``header_timeout_s``)
covers a connection's first request too in recent releases (3.14 arms it at connect and
does not reset it on partial data), but not in every release the dependency allows, and
it has no connection cap. So each connection's aiohttp protocol sits behind a
:class:`GuardedProtocol`, which closes the connection unless a request's headers have
arrived within ``header_timeout_s`` of the connection opening or of the previous
response, whatever aiohttp does. The door's middleware tells the guard when headers
arrived (:meth:`ConnectionGuards.request_started`) and when the response is done
(:meth:`ConnectionGuards.request_done`); the body has its own deadline in the door.

Over ``max_connections``, a new connection is answered ``503`` and closed (after a
second's linger for the client to read it), so the open ones keep being served.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_OVER_CAP = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s"
)


#: how long a refused connection is kept to let the client read its 503
_LINGER_S = 1.0


class ConnectionGuards:
    """The guards of one listening socket, by transport."""

    def __init__(self, *, header_timeout_s: float, max_connections: int) -> None:
        self.header_timeout_s = header_timeout_s
        self.max_connections = max_connections
        self._open: dict[Any, GuardedProtocol] = {}
        #: connections closed for sending no headers in time, refused over the cap
        self.timed_out = 0
        self.refused = 0

    def factory(self, make: Callable[[], asyncio.Protocol]) -> Callable[[], GuardedProtocol]:
        return lambda: GuardedProtocol(self, make())

    @property
    def open(self) -> int:
        return len(self._open)

    def request_started(self, transport: Any) -> None:
        guard = self._open.get(transport)
        if guard is not None:
            guard.disarm()

    def request_done(self, transport: Any) -> None:
        guard = self._open.get(transport)
        if guard is not None:
            guard.arm()

    def _add(self, guard: GuardedProtocol) -> bool:
        if len(self._open) >= self.max_connections:
            self.refused += 1
            return False
        self._open[guard.transport] = guard
        return True

    def _remove(self, guard: GuardedProtocol) -> None:
        self._open.pop(guard.transport, None)


class GuardedProtocol(asyncio.Protocol):
    """Forwards everything to the wrapped protocol; closes the connection at the headers'
    deadline."""

    def __init__(self, guards: ConnectionGuards, inner: asyncio.Protocol) -> None:
        self._guards = guards
        self._inner = inner
        self.transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._admitted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if not self._guards._add(self):
            body = b'{"error":"too many connections: the gateway is at its connection cap"}'
            transport.write(_OVER_CAP % (len(body), body))
            # linger a moment, discarding what the client sends: closing with its
            # request unread would reset the connection before it reads the 503
            transport.write_eof()
            asyncio.get_running_loop().call_later(_LINGER_S, transport.close)
            return
        self._admitted = True
        self._inner.connection_made(transport)
        self.arm()

    def arm(self) -> None:
        self.disarm()
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._guards.header_timeout_s, self._expire)

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        if self.transport is not None and not self.transport.is_closing():
            self._guards.timed_out += 1
            log.info(
                "closing a connection that sent no request headers in %.1f s",
                self._guards.header_timeout_s,
            )
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._admitted:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._admitted else False

    def pause_writing(self) -> None:
        if self._admitted:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._admitted:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm()
        if self._admitted:
            self._guards._remove(self)
            self._inner.connection_lost(exc)
