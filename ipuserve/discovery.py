"""Endpoints that name several peers: resolve a host to every address, and follow them.

An orchestrator names a replicated service by one host that resolves to every task's
address (Docker Swarm's ``tasks.SERVICE`` with ``endpoint_mode: dnsrr``; a Kubernetes
headless service does the same). ZeroMQ would connect to one of them, so workers and
clients expand such an endpoint into one endpoint per address and re-resolve it --
on an interval and when a connection is lost -- to follow the set as tasks come and
go (:class:`EndpointSet`).

Rules, chosen so that a plain deployment behaves as before:

* ``ipc://``, ``inproc://`` and ``tcp://`` endpoints whose host is an IP literal are
  used as given;
* a host that resolves to one IPv4 address is kept as the name, so ZeroMQ's own
  re-resolution on reconnect still follows it (a compose service restarted on a new
  address);
* a host that resolves to several becomes one ``tcp://ADDRESS:PORT`` per address,
  sorted, so every peer behind it is used;
* a host that does not resolve (yet: the broker's container is still starting) is
  kept as the name, and a failed re-resolution keeps the addresses it had: a DNS
  hiccup never drops live peers.

Only IPv4 addresses are used for names (ipuserve's sockets do not enable IPv6, and
``localhost`` often resolves to ``::1`` too); an IPv6 literal endpoint is used as given.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import time
from collections.abc import Callable, Iterable, Sequence

log = logging.getLogger(__name__)

#: how often an :class:`EndpointSet` re-resolves its names when nothing else asks it to
REFRESH_INTERVAL_S = 2.0

#: ``host -> addresses``; raises ``OSError`` when the host does not resolve
Resolver = Callable[[str], list[str]]


def resolve_ipv4(host: str) -> list[str]:
    """Every IPv4 address ``host`` resolves to, sorted and without repeats."""
    infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos}, key=ipaddress.IPv4Address)


def _host_port(endpoint: str) -> tuple[str, str] | None:
    """``(host, port)`` of a ``tcp://`` endpoint whose host is a name, else None."""
    if not endpoint.startswith("tcp://"):
        return None
    host, colon, port = endpoint[len("tcp://") :].rpartition(":")
    if not colon or not host:
        return None
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return host, port
    return None  # an IP literal


def expand(endpoint: str, resolver: Resolver = resolve_ipv4) -> list[str]:
    """The endpoints ``endpoint`` stands for (see the module's rules); raises ``OSError``
    when its host is a name that does not resolve."""
    named = _host_port(endpoint)
    if named is None:
        return [endpoint]
    host, port = named
    addresses = sorted(set(resolver(host)), key=ipaddress.ip_address)
    if len(addresses) <= 1:
        return [endpoint]
    return [f"tcp://{address}:{port}" for address in addresses]


class EndpointSet:
    """The peers a list of configured endpoints stands for, followed as they change.

    ``refresh()`` re-resolves every name and returns what was added and removed since
    the last call; the owner connects to the added and lets go of the removed. Call it
    when :meth:`due` says so (every ``interval_s``) and whenever a connection is lost.
    Not thread-safe: one owner (a socket loop) calls it.
    """

    def __init__(
        self,
        configured: Sequence[str],
        *,
        interval_s: float = REFRESH_INTERVAL_S,
        resolver: Resolver = resolve_ipv4,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not configured:
            raise ValueError("an EndpointSet needs at least one endpoint")
        self.configured = tuple(dict.fromkeys(configured))
        self._interval_s = interval_s
        self._resolver = resolver
        self._clock = clock
        self._by_name: dict[str, list[str]] = {}
        self._current: list[str] = []
        self._next_at = 0.0

    @property
    def current(self) -> tuple[str, ...]:
        """The endpoints in use after the last :meth:`refresh`, in a stable order."""
        return tuple(self._current)

    @property
    def follows_names(self) -> bool:
        """Whether any configured endpoint is a name that re-resolving could change."""
        return any(_host_port(e) is not None for e in self.configured)

    def due(self) -> bool:
        """Whether the interval since the last refresh has passed."""
        return self.follows_names and self._clock() >= self._next_at

    def seconds_until_due(self) -> float:
        """How long until :meth:`due` (a poll timeout's bound); inf for fixed endpoints."""
        if not self.follows_names:
            return float("inf")
        return max(0.0, self._next_at - self._clock())

    def refresh(self) -> tuple[list[str], list[str]]:
        """Re-resolve; ``(added, removed)`` since the previous call (the first call adds
        everything)."""
        self._next_at = self._clock() + self._interval_s
        for endpoint in self.configured:
            try:
                self._by_name[endpoint] = expand(endpoint, self._resolver)
            except OSError as error:
                kept = self._by_name.setdefault(endpoint, [endpoint])
                log.debug("%s does not resolve (%s); keeping %s", endpoint, error, kept)
        fresh = list(dict.fromkeys(e for name in self.configured for e in self._by_name[name]))
        added = [e for e in fresh if e not in self._current]
        removed = [e for e in self._current if e not in fresh]
        if (added or removed) and self._current:
            log.info(
                "endpoints changed: +%s -%s (now %s)",
                added or "none",
                removed or "none",
                " ".join(fresh),
            )
        self._current = fresh
        return added, removed


def split_endpoints(values: Iterable[str]) -> list[str]:
    """Endpoints from repeated options and space-separated variables, without repeats:
    ``["tcp://a:1 tcp://b:1", "tcp://c:1"]`` -> three endpoints."""
    return list(dict.fromkeys(part for value in values for part in value.split()))
