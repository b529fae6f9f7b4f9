"""The client's brokers as a name stands for them now, re-resolved off the I/O thread.

:class:`ipuserve.discovery.EndpointSet` does the resolving; this runs each refresh on
a short-lived thread of its own, so that a slow resolver never stalls the replies of
every broker the client talks to (the swarm test saw a 2.9 s gap without a result
after a broker task died, with the re-resolution on the I/O thread), and hands what
changed to the I/O thread, which alone adds and drops links.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from ipuserve.discovery import EndpointSet

log = logging.getLogger(__name__)

#: what one refresh found: (added, removed) endpoints
Change = tuple[list[str], list[str]]


class Following:
    """Asks for re-resolutions (when due, or after a lost connection) and collects
    their results; ``wake`` tells the I/O thread one is ready."""

    def __init__(self, endpoints: EndpointSet, wake: Callable[[], None]) -> None:
        self.endpoints = endpoints
        self._wake = wake
        self._lost = False
        self._running = False
        self._found: deque[Change] = deque()

    def lost(self) -> None:
        """A connection was lost or a broker went silent: its name may stand for other
        addresses now."""
        self._lost = True

    def changes(self) -> list[Change]:
        """What the finished refreshes found, in order; starts the next one when due
        (one at a time: a loss meanwhile waits for the next)."""
        found = []
        while self._found:
            found.append(self._found.popleft())
        if self._running:
            return found
        endpoints = self.endpoints
        lost, self._lost = self._lost, False
        if endpoints.due() or (lost and endpoints.follows_names):
            self._running = True
            threading.Thread(
                target=self._refresh, name="ipuserve-client-resolve", daemon=True
            ).start()
        return found

    def seconds_until_due(self) -> float:
        return self.endpoints.seconds_until_due()

    def _refresh(self) -> None:
        try:
            self._found.append(self.endpoints.refresh())
        except Exception:  # never leave _running set: the next turn tries again
            log.exception("cannot re-resolve %s", " ".join(self.endpoints.configured))
        finally:
            self._running = False
            self._wake()
