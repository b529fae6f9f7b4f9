"""The HTTP door's listening sockets and their accept loop, which meets descriptor
exhaustion with a back-off and one log line per interval.

asyncio's own server (``loop.create_server``) at ``EMFILE`` logs a traceback and
schedules a retry for *every* iteration of its accept loop (CPython 3.11's
``_accept_connection`` does not leave the loop after the error), then again when each
of those retries fires: measured, 20,662 tracebacks in 3 s from 300 connections over a
limit of 128 descriptors, and the probe unanswered meanwhile. So the door accepts on
its own: :class:`Acceptor` reads its listening socket with ``loop.add_reader``, hands
each accepted socket to ``loop.connect_accepted_socket``, and when ``accept`` fails for
want of a resource (``EMFILE``, ``ENFILE``, ``ENOBUFS``, ``ENOMEM``) stops reading for
:data:`RETRY_S`, logging one WARNING per :data:`LOG_EVERY_S` that says how often it
happened. Pending connections wait in the kernel's backlog meanwhile, and are served
once a descriptor is free (none are shed: a client waiting there gets its answer late
rather than a reset).

:func:`raise_descriptor_limit` lifts the soft ``RLIMIT_NOFILE`` to the hard one at
start: the soft default (1,024 on many systems) is below what the connection caps
admit, and every connection is a descriptor.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import socket
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

#: accept errors that mean "out of a resource, try again later" rather than a bug
_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
#: how long accepting pauses after such an error
RETRY_S = 0.25
#: at most one log line per this long about it
LOG_EVERY_S = 10.0
#: connections accepted per readiness event before the loop serves others
_BATCH = 128
#: descriptors the process needs besides connections (brokers, pipes, files, gRPC's own)
RESERVED_DESCRIPTORS = 64


def raise_descriptor_limit() -> int:
    """Lift the soft ``RLIMIT_NOFILE`` to the hard limit; return the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:  # a sandbox that forbids it: keep the soft one
            log.info("cannot raise the descriptor limit from %d to %d: %s", soft, hard, exc)
    return soft


def listening_sockets(
    host: str, port: int, *, backlog: int, reuse_port: bool
) -> list[socket.socket]:
    """Bound, listening, non-blocking sockets for ``host:port``, one per address the
    host resolves to (as ``loop.create_server`` binds them)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:  # worded as loop.create_server words it
                raise OSError(
                    exc.errno,
                    f"error while attempting to bind on address {address!r}: "
                    f"{(exc.strerror or str(exc)).lower()}",
                ) from None
            sock.listen(backlog)
            sock.setblocking(False)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


class Acceptor:
    """Accepts connections on one listening socket for ``factory``'s protocols."""

    def __init__(self, sock: socket.socket, factory: Callable[[], asyncio.Protocol]) -> None:
        self.sock = sock
        self._factory = factory
        self._loop = asyncio.get_running_loop()
        self._pending: set[asyncio.Task[None]] = set()
        self._retry: asyncio.TimerHandle | None = None
        #: accept attempts that failed for want of a resource, in all, and since the
        #: last log line
        self.exhausted = 0
        self._unlogged = 0
        self._logged_at = -LOG_EVERY_S

    def start(self) -> None:
        self._retry = None
        self._loop.add_reader(self.sock.fileno(), self._accept)

    def close(self) -> None:
        """Stop accepting and close the listening socket; connections being set up
        are dropped (open ones are their server's to close)."""
        if self._retry is not None:
            self._retry.cancel()
        self._loop.remove_reader(self.sock.fileno())
        self.sock.close()
        for task in self._pending:
            task.cancel()

    def _accept(self) -> None:
        for _ in range(_BATCH):
            try:
                conn, _address = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue  # gone before we took it
            except OSError as exc:
                self._back_off(exc)
                return
            conn.setblocking(False)
            task = self._loop.create_task(self._connect(conn))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    async def _connect(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self._factory, conn)
        except OSError:  # the peer left before its transport was made
            conn.close()

    def _back_off(self, exc: OSError) -> None:
        """Stop reading the listening socket for :data:`RETRY_S` (level-triggered, it
        stays readable while connections wait), saying so once per interval."""
        self._loop.remove_reader(self.sock.fileno())
        self._retry = self._loop.call_later(RETRY_S, self.start)
        self.exhausted += 1
        self._unlogged += 1
        now = time.monotonic()
        if now - self._logged_at < LOG_EVERY_S:
            return
        self._logged_at = now
        what = "out of descriptors or memory" if exc.errno in _EXHAUSTED else "failing"
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        log.warning(
            "accepting connections is %s (%s; descriptor limit %d): pausing %.2f s "
            "between attempts, %d failed since the last such line (at most one per %.0f s)",
            what,
            exc.strerror or exc,
            soft,
            RETRY_S,
            self._unlogged,
            LOG_EVERY_S,
        )
        self._unlogged = 0
