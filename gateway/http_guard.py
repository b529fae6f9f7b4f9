"""Slow, half-open, greedy and deaf HTTP clients cannot hold the gateway: a deadline for
a request's headers (TLS handshake included), a cap on open connections in all and per
peer address, a write timeout.

A client that opens connections and trickles a byte now and then (slowloris) must not
hold them forever. aiohttp's keep-alive timeout (the door sets it to ``header_timeout_s``)
covers a connection's first request too in recent releases (3.14 arms it at connect and
does not reset it on partial data), but not in every release the dependency allows, and
it has no connection cap. So each connection's aiohttp protocol sits behind a
:class:`GuardedProtocol`, which closes the connection unless a request's headers have
arrived within ``header_timeout_s`` of the connection opening or of the previous
response, whatever aiohttp does: that is the keep-alive idle timeout too. The door's
middleware tells the guard when headers arrived (:meth:`ConnectionGuards.request_started`)
and when the response is done (:meth:`ConnectionGuards.request_done`); the body has its
own deadline in the door.

The guard sees the TCP connection, not the TLS one: with TLS it runs the handshake
itself (``loop.start_tls``), so a connection that never starts TLS is counted in the
caps and cut at the same header deadline as one that sends no headers (asyncio's own
server would hide it from the guard for its 60 s handshake timeout).

Over ``max_connections``, a new connection is answered ``503`` and closed; over
``max_per_peer`` from its address (IPv4, or an IPv6 /64: one host's share), ``429``; so
the open ones, and other addresses, keep being served. Without TLS the answer lingers a
second for the client to read it, at most :data:`_MAX_LINGERING` at once (more are
closed at once: refusals must not cost descriptors of their own); with TLS the
connection is closed unanswered (answering would cost a handshake).

A client that stops reading its answer would hold it in memory for good: when the
transport's write buffer stays above its high-water mark (``pause_writing`` with no
``resume_writing``) for ``write_timeout_s``, the connection is aborted.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import ssl
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_REFUSAL = (
    b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s"
)

#: how long a refused connection is kept to let the client read its answer
_LINGER_S = 1.0
#: refused connections lingering at once, at most
_MAX_LINGERING = 64
#: how long a TLS connection may take to say goodbye (close_notify) once closed
_TLS_SHUTDOWN_S = 5.0


def peer_key(transport: asyncio.BaseTransport) -> str:
    """The address a connection counts against: its IPv4 address, or its IPv6 /64 (a
    host's usual share, which it may fill with addresses of its own)."""
    peer = transport.get_extra_info("peername")
    host = peer[0] if isinstance(peer, tuple) and peer else ""
    if not isinstance(host, str) or ":" not in host:
        return str(host)
    try:
        ip = ipaddress.IPv6Address(host.partition("%")[0])
    except ValueError:
        return host
    if ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ipaddress.IPv6Network((ip, 64), strict=False))


class ConnectionGuards:
    """The guards of one door, by transport, and the connections counted per peer."""

    def __init__(
        self,
        *,
        header_timeout_s: float,
        max_connections: int,
        max_per_peer: int = 0,
        write_timeout_s: float = 30.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.header_timeout_s = header_timeout_s
        self.max_connections = max_connections
        #: 0: no cap per address
        self.max_per_peer = max_per_peer
        self.write_timeout_s = write_timeout_s
        self.ssl_context = ssl_context
        self._open: dict[Any, GuardedProtocol] = {}
        self._per_peer: dict[str, int] = {}
        self._lingering = 0
        #: connections closed for sending no headers in time (or finishing no TLS
        #: handshake), refused over a cap, aborted for not reading their answer
        self.timed_out = 0
        self.refused = 0
        self.write_timed_out = 0

    def factory(self, make: Callable[[], asyncio.Protocol]) -> Callable[[], GuardedProtocol]:
        return lambda: GuardedProtocol(self, make())

    @property
    def open(self) -> int:
        return len(self._open)

    def from_peer(self, peer: str) -> int:
        return self._per_peer.get(peer, 0)

    def request_started(self, transport: Any) -> None:
        guard = self._open.get(transport)
        if guard is not None:
            guard.disarm()

    def request_done(self, transport: Any) -> None:
        guard = self._open.get(transport)
        if guard is not None:
            guard.arm()

    def close_all(self) -> None:
        """Abort every connection still open (the door is stopping): those aiohttp
        does not know of yet, in a TLS handshake, included."""
        for guard in list(self._open.values()):
            if guard.transport is not None:
                guard.transport.abort()

    def _admit(self, guard: GuardedProtocol, peer: str) -> tuple[int, bytes] | None:
        """Count ``guard`` in; or the status and message it is refused with."""
        if len(self._open) >= self.max_connections:
            self.refused += 1
            return 503, b"too many connections: the gateway is at its connection cap"
        count = self._per_peer.get(peer, 0)
        if self.max_per_peer and count >= self.max_per_peer:
            self.refused += 1
            message = "too many connections from this address: %d at most per address"
            return 429, (message % self.max_per_peer).encode()
        self._per_peer[peer] = count + 1
        self._open[guard.transport] = guard
        return None

    def _rekey(self, old: Any, new: Any) -> None:
        guard = self._open.pop(old, None)
        if guard is not None:
            self._open[new] = guard

    def _remove(self, guard: GuardedProtocol, peer: str) -> None:
        self._open.pop(guard.transport, None)
        left = self._per_peer.pop(peer, 1) - 1
        if left > 0:
            self._per_peer[peer] = left

    def _refuse(self, transport: asyncio.Transport, status: int, message: bytes) -> None:
        if self.ssl_context is not None or self._lingering >= _MAX_LINGERING:
            transport.abort()
            return
        body = b'{"error":"%s"}' % message
        reason = b"Service Unavailable" if status == 503 else b"Too Many Requests"
        transport.write(_REFUSAL % (status, reason, len(body), body))
        # linger a moment, discarding what the client sends: closing with its request
        # unread would reset the connection before it reads the answer
        transport.write_eof()
        self._lingering += 1
        asyncio.get_running_loop().call_later(_LINGER_S, self._let_go, transport)

    def _let_go(self, transport: asyncio.Transport) -> None:
        self._lingering -= 1
        transport.close()


class GuardedProtocol(asyncio.Protocol):
    """Forwards everything to the wrapped protocol; closes the connection at the headers'
    deadline or when its answer goes unread for the write timeout; runs TLS."""

    def __init__(self, guards: ConnectionGuards, inner: asyncio.Protocol) -> None:
        self._guards = guards
        self._inner = inner
        self.transport: asyncio.Transport | None = None
        self._peer = ""
        self._timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._admitted = False
        #: the inner protocol has its transport (after the TLS handshake, with TLS)
        self._forward = False
        self._early: list[bytes] = []
        self._handshake: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self._peer = peer_key(transport)
        refusal = self._guards._admit(self, self._peer)
        if refusal is not None:
            self._guards._refuse(transport, *refusal)
            return
        self._admitted = True
        self.arm()
        if self._guards.ssl_context is None:
            self._forward = True
            self._inner.connection_made(transport)
            return
        # not a byte of the ClientHello may reach this protocol: start_tls (a task,
        # so a loop iteration later) takes the reading over from here
        transport.pause_reading()
        self._handshake = asyncio.get_running_loop().create_task(self._start_tls(transport))

    async def _start_tls(self, raw: asyncio.Transport) -> None:
        guards = self._guards
        assert guards.ssl_context is not None
        try:
            tls = await asyncio.get_running_loop().start_tls(
                raw,
                self,
                guards.ssl_context,
                server_side=True,
                ssl_handshake_timeout=guards.header_timeout_s,
                ssl_shutdown_timeout=_TLS_SHUTDOWN_S,
            )
        except OSError as exc:  # refused, timed out, cut off: start_tls closed it
            log.debug("TLS handshake failed: %r", exc)
            self._release()
            return
        except asyncio.CancelledError:  # the door is stopping
            self._release()
            raise
        if tls is None or tls.is_closing():
            self._release()
            return
        guards._rekey(raw, tls)
        self.transport = tls
        self._forward = True
        self._inner.connection_made(tls)
        early, self._early = self._early, []
        for data in early:  # what came with the handshake's last flight
            self._inner.data_received(data)

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
        if self.transport is None or self.transport.is_closing():
            return
        if self._write_timer is not None:  # an answer still going out: its own clock
            self.arm()
            return
        self._guards.timed_out += 1
        log.info(
            "closing a connection that sent no request headers in %.1f s%s",
            self._guards.header_timeout_s,
            "" if self._forward else " (no TLS handshake done)",
        )
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._forward:
            self._inner.data_received(data)
        elif self._admitted:  # decrypted before start_tls returned
            self._early.append(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._forward else False

    def pause_writing(self) -> None:
        if self._write_timer is None and self._admitted:
            loop = asyncio.get_running_loop()
            self._write_timer = loop.call_later(self._guards.write_timeout_s, self._write_expired)
        if self._forward:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        if self._forward:
            self._inner.resume_writing()

    def _write_expired(self) -> None:
        self._write_timer = None
        if self.transport is None or self.transport.is_closing():
            return
        self._guards.write_timed_out += 1
        log.info(
            "aborting a connection that read none of its answer in %.1f s (%d bytes unsent)",
            self._guards.write_timeout_s,
            self.transport.get_write_buffer_size(),
        )
        self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._release()
        if self._forward:
            self._forward = False
            self._inner.connection_lost(exc)

    def _release(self) -> None:
        """Stop the clocks and leave the counts, once."""
        self.disarm()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        if self._admitted:
            self._admitted = False
            self._guards._remove(self, self._peer)
