"""What the client's two drivers (:mod:`ipuserve.client.thread_loop`, with its I/O
thread, and :mod:`ipuserve.client.async_loop`, on an event loop) share: a
:class:`~ipuserve.client.core.Core` and one socket per link, the links following
what the endpoints stand for, and the checks that end a turn. Each driver adds how
it waits on the sockets (a poller, the event loop's readers) and hands requests over;
it hears of each link added or dropped (:meth:`Driver._linked`, :meth:`Driver._unlinked`)
to wait on that socket or stop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ipuserve.client.config import ClientConfig, ClientStats
from ipuserve.client.core import Core, LinkInfo
from ipuserve.client.following import Following
from ipuserve.client.sockets import LinkSocket
from ipuserve.discovery import EndpointSet
from ipuserve.errors import IpuserveError

log = logging.getLogger(__name__)

#: opens a link's socket to one endpoint (the face's :class:`ClientSetup`)
Connect = Callable[[str], LinkSocket]


class Driver:
    """A core and its links' sockets; see the module's docstring."""

    def __init__(
        self,
        endpoints: EndpointSet,
        connect: Connect,
        config: ClientConfig,
        *,
        follow: bool,
        wake: Callable[[], None],
    ) -> None:
        """``follow``: the endpoints' names are re-resolved and followed (else the one
        configured endpoint is the one link, ZeroMQ resolving its host); ``wake``
        rouses the driver when a re-resolution is ready. No link is open yet:
        :meth:`_open_links`, once the driver can hear of them."""
        self.config = config
        self.core = Core(config)
        self._endpoints = endpoints
        self._connect = connect
        self._sockets: dict[str, LinkSocket] = {}
        self._following = Following(endpoints, wake) if follow else None

    def _open_links(self) -> None:
        """A link per endpoint: the configured ones, or what they stand for now."""
        following = self._following
        first = self._endpoints.refresh()[0] if following else list(self._endpoints.configured)
        for endpoint in first:
            self._add_link(endpoint)

    @property
    def follows(self) -> bool:
        """Whether names are followed (a link per address, as they change)."""
        return self._following is not None

    @property
    def stats(self) -> ClientStats:
        return self.core.stats

    def links(self) -> list[LinkInfo]:
        return self.core.link_infos(time.monotonic())

    def silence_hint(self) -> str:
        return self.core.silence_hint()

    def close(self) -> None:
        """Fail what is pending with :class:`ClosedError`, let the sockets go."""
        raise NotImplementedError

    # ------------------------------------------------------------ links

    def _linked(self, endpoint: str, sockets: LinkSocket) -> None:
        """A link was added: wait on its socket from now on."""

    def _unlinked(self, sockets: LinkSocket) -> None:
        """A link is dropped: stop waiting on its socket (closed next)."""

    def _add_link(self, endpoint: str) -> None:
        sockets = self._connect(endpoint)
        self._sockets[endpoint] = sockets
        self.core.add_link(endpoint, sockets)
        self._linked(endpoint, sockets)

    def _drop_link(self, endpoint: str) -> None:
        self.core.drop_link(endpoint)
        sockets = self._sockets.pop(endpoint)
        self._unlinked(sockets)
        sockets.close()

    def _follow_endpoints(self) -> None:
        """Links follow the addresses the endpoints stand for (re-resolved when due or
        after a lost connection, off the driver's thread: :mod:`ipuserve.client.following`)."""
        following = self._following
        lost, self.core.lost = self.core.lost, False
        if following is None:
            return
        if lost:
            following.lost()
        for added, removed in following.changes():
            for endpoint in removed:
                self._drop_link(endpoint)
            for endpoint in added:
                try:
                    self._add_link(endpoint)
                except IpuserveError as exc:  # ZeroMQ refused it: the others carry on
                    log.warning("%s", exc)

    # ------------------------------------------------------------ ending a turn

    def _sockets_ready(self) -> bool:
        """The last operation on each socket before the driver waits: whether one holds
        a message already, or room for what its link deferred (the descriptors signal
        only what comes after this)."""
        links = self.core.links
        return any(
            sockets.ready(want_room=bool(links[endpoint].unsent))
            for endpoint, sockets in self._sockets.items()
        )

    def _wait_s(self) -> float:
        """How long the driver may wait: until the next PING, deadline or re-resolution."""
        wait_s = self.core.wait_s(time.monotonic(), time.perf_counter_ns())
        if self._following is not None:
            wait_s = min(wait_s, self._following.seconds_until_due())
        return wait_s
