"""The I/O thread of a client with several brokers: one :class:`Link` per frontend,
polled together, requests spread over the live ones and moved off a dead one.

What it does (docs/protocol.md, "A client with several brokers"):

* **Spreading.** A new request goes to the usable link with the fewest pending
  requests, ties taken round-robin (:func:`least_loaded`). Usable: connected, heard
  within ``liveness_s`` (every link is PINGed every ``ping_interval_s``, busy or
  not, so an idle link's health is known too), not shutting down.
* **Failover.** When a link stops being usable (disconnected, silent past the
  window, BROKER_SHUTDOWN, a backend port) and another is usable, its pending
  requests go to the others with their ids unchanged (``ClientStats.failovers``).
  The pending table is shared: the first reply for an id settles it, a later one
  (the first broker answering after all) is dropped and counted
  (``dropped_replies``). With no usable link, requests wait unsent ("parked") and a
  link keeps what it had, re-sending it as the single-broker client does (on
  reconnection, a new epoch, once per silence); each request's deadline still holds.
  A link that comes back gets new requests again, so the load spreads back.
* **Discovery.** The configured endpoints are an :class:`EndpointSet`: a name that
  resolves to several addresses is one link per address. It is re-resolved when due
  and when a link loses its connection or its requests move for another reason; a
  new address gets a link, a removed one's requests move to the others before its
  socket closes.

Only the I/O thread touches the sockets: callers hand every request over through the
inbox (a deque and a :class:`Waker`), unlike the single-broker loop's send from the
caller's thread; future callbacks hand theirs straight to a link's outbox. The
*turn lock* is held for each turn but for the poll and the settling of futures, so
that :meth:`close` can fail what a blocked callback strands, as in
:class:`~ipuserve.client.io_loop.IoLoop`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import zmq

from ipuserve.client.config import ClientConfig, ClientStats
from ipuserve.client.following import Following
from ipuserve.client.lifecycle import IoThread
from ipuserve.client.links import Link, least_loaded
from ipuserve.client.pending import Pending, PendingTable, refuse_if_forked
from ipuserve.discovery import EndpointSet
from ipuserve.errors import (
    ClosedError,
    DeadlineExceeded,
    IpuserveError,
    ProtocolError,
    UnavailableError,
)
from ipuserve.waker import Waker

log = logging.getLogger(__name__)

_MAX_POLL_MS = 60_000
#: per-link counters that add up into the client's
_LINK_COUNTERS = ("batched", "grouped", "reconnects", "epoch_changes")

Connect = Callable[[str], tuple[zmq.Socket[Any], zmq.Socket[Any]]]


@dataclass(frozen=True)
class LinkInfo:
    """One broker link as :meth:`Client.links` shows it."""

    endpoint: str
    usable: bool
    pending: int
    #: requests this link was given (new ones and those moved here)
    assigned: int
    epoch: str | None


class LinksLoop(IoThread):
    """Owns the links, the shared pending table, the deadlines and the failover (its
    thread's start and end: :class:`~ipuserve.client.lifecycle.IoThread`)."""

    def __init__(self, endpoints: EndpointSet, connect: Connect, config: ClientConfig) -> None:
        """``connect`` opens a socket and its monitor for one endpoint (ConfigError if
        ZeroMQ refuses it); the first resolution's links are opened here, on the
        caller's thread, so a bad endpoint fails the constructor."""
        self.config = config
        self.endpoint = " ".join(endpoints.configured)
        self._stats = ClientStats()
        self._connect = connect
        self._table = PendingTable()
        self._due: deque[tuple[Pending, Callable[[Pending], None]]] = deque()
        self._links: dict[str, Link] = {}
        self._owner: dict[bytes, Link] = {}
        #: requests waiting for a usable link
        self._parked: dict[bytes, None] = {}
        #: requests for one broker (its models), never moved: id -> endpoint
        self._targets: dict[bytes, str] = {}
        #: the brokers that answered a request UNKNOWN_MODEL: id -> their endpoints
        self._refused: dict[bytes, set[str]] = {}
        self._assigned: dict[str, int] = {}
        self._turns = 0
        self._poller_stale = True
        self._waker = Waker()
        self._following = Following(endpoints, self._waker.wake)
        self._inbox: deque[tuple[Pending, str | None]] = deque()
        self._lock = threading.Lock()  # the inbox and _closed
        self._turn_lock = threading.Lock()  # everything else (module docstring)
        self._work_lock = self._turn_lock  # the lifecycle's name for it
        self._closed = False
        self._pid = os.getpid()
        self._crash: Exception | None = None
        try:
            for endpoint in endpoints.refresh()[0]:
                self._add_link(endpoint)
        except BaseException:
            self._close_links()
            self._waker.close()
            raise
        self.thread = threading.Thread(target=self._run, name="ipuserve-client-links", daemon=True)

    # ------------------------------------------------------------ any thread

    @property
    def stats(self) -> ClientStats:
        """The client's counters plus every link's (epoch: the links' epochs, sorted)."""
        merged = dataclasses.replace(self._stats)
        links = list(self._links.values())
        for name in _LINK_COUNTERS:
            setattr(
                merged, name, getattr(merged, name) + sum(getattr(k.stats, name) for k in links)
            )
        epochs = sorted({link.stats.epoch for link in links if link.stats.epoch})
        merged.epoch = " ".join(epochs) or None
        limits = [k.stats.max_payload_bytes for k in links if k.stats.max_payload_bytes]
        merged.max_payload_bytes = min(limits) if limits else None
        return merged

    def links(self) -> list[LinkInfo]:
        now = time.monotonic()
        return [
            LinkInfo(e, k.usable(now), len(k.ids), self._assigned.get(e, 0), k.stats.epoch)
            for e, k in list(self._links.items())
        ]

    def submit(self, pending: Pending, *, direct: bool = True, to: str | None = None) -> None:
        """Hand a request to the I/O thread (``direct`` is the single loop's; here every
        request goes through the I/O thread). ``to``: only that link's broker."""
        del direct
        refuse_if_forked(self._pid)
        if threading.current_thread() is self.thread:  # a done-callback: batched
            with self._turn_lock:
                if self._closed:
                    raise self._closed_error()
                self._place(pending, to)
            return
        with self._lock:
            if self._closed:
                raise self._closed_error()
            was_empty = not self._inbox
            self._inbox.append((pending, to))
        if was_empty:
            self._waker.wake()

    def silence_hint(self) -> str:
        """The first link's hint that has one (none once any broker answered)."""
        links = list(self._links.values())
        if any(link.liveness.heard_anything for link in links):
            return ""
        for link in links:
            hint = link.liveness.silence_hint()
            if hint:
                return hint
        return ""

    def _outstanding(self) -> list[Pending]:
        return [*self._table.values(), *(p for p, _ in self._due), *(p for p, _ in self._inbox)]

    def _take_outstanding(self) -> list[Pending]:
        outstanding = self._outstanding()
        self._table.take_all()
        self._due.clear()
        self._inbox.clear()
        return outstanding

    def _closed_error(self) -> IpuserveError:
        if self._crash is not None:
            return UnavailableError(
                f"the client's I/O thread failed ({self._crash!r}; see the log); "
                "create a new Client"
            )
        return ClosedError("the client is closed")

    # ------------------------------------------------------------ links

    def _add_link(self, endpoint: str) -> None:
        link = Link(
            endpoint,
            self._connect(endpoint),
            self.config,
            self._table,
            self._stats,
            self._forget,
            self._elsewhere,
        )
        link.replies.due = self._due
        self._links[endpoint] = link
        self._poller_stale = True

    def _drop_link(self, endpoint: str) -> None:
        link = self._links.pop(endpoint)
        self._poller_stale = True
        gone = _failing(UnavailableError(f"the broker at {endpoint} is gone"))
        for request_id in list(link.ids):
            if request_id in self._targets:
                link.replies.finish(request_id, gone)
            else:  # placed on the usable links by this turn's _rebalance
                self._unassign(request_id)
                self._parked[request_id] = None
                self._stats.failovers += 1
                self._stats.resent += 1
        link.close()

    def _close_links(self) -> None:
        for link in self._links.values():
            link.close()

    def _forget(self, request_id: bytes) -> None:
        """A request is settled (or taken): off every list but the table's."""
        self._unassign(request_id)
        self._parked.pop(request_id, None)
        self._targets.pop(request_id, None)
        self._refused.pop(request_id, None)

    def _unassign(self, request_id: bytes) -> None:
        link = self._owner.pop(request_id, None)
        if link is not None:
            link.ids.pop(request_id, None)
            link.held.pop(request_id, None)

    def _place(self, pending: Pending, to: str | None) -> None:
        """Register a new request and give it to a link (or park it)."""
        self._table.add(pending)
        self._stats.sent += 1
        if to is None:
            self._assign(pending, time.monotonic())
            return
        self._targets[pending.request_id] = to
        link = self._links.get(to)
        if link is None:
            error = UnavailableError(f"no link to {to}")
            self._due.append((self._table.pop(pending.request_id) or pending, _failing(error)))
            self._forget(pending.request_id)
            return
        self._give(link, pending)

    def _assign(self, pending: Pending, now: float) -> bool:
        """To the usable link with the fewest pending; parked when none is usable."""
        usable = [link for link in self._links.values() if link.usable(now)]
        if not usable:
            self._parked[pending.request_id] = None
            return False
        self._turns += 1
        self._give(usable[least_loaded([len(k.ids) for k in usable], self._turns)], pending)
        return True

    def _give(self, link: Link, pending: Pending) -> None:
        request_id = pending.request_id
        self._parked.pop(request_id, None)
        self._owner[request_id] = link
        link.ids[request_id] = None
        self._assigned[link.endpoint] = self._assigned.get(link.endpoint, 0) + 1
        link.outbox.add(pending)

    def _rebalance(self, now: float) -> None:
        """Parked requests to usable links; a failed link's requests to the others."""
        if not any(link.usable(now) for link in self._links.values()):
            for link in self._links.values():  # as with one broker: re-send once per silence
                if link.ids and link.liveness.silence(now, len(link.ids)):
                    link.resend_all()
            return
        for link in list(self._links.values()):
            if link.ids and not link.usable(now):
                self._move_from(link, now)
        for request_id in list(self._parked):
            pending = self._table.get(request_id)
            if pending is None:
                del self._parked[request_id]
            elif not self._assign(pending, now):
                return

    def _elsewhere(self, link: Link, request_id: bytes) -> bool:
        """``link``'s broker does not serve the request's model: give it to a usable
        link whose broker has not said so yet; False when none is left (it fails)."""
        pending = self._table.get(request_id)
        if pending is None or request_id in self._targets:
            return False
        refused = self._refused.setdefault(request_id, set())
        refused.add(link.endpoint)
        now = time.monotonic()
        others = [k for k in self._links.values() if k.endpoint not in refused and k.usable(now)]
        if not others:
            return False
        self._unassign(request_id)
        self._turns += 1
        self._give(others[least_loaded([len(k.ids) for k in others], self._turns)], pending)
        self._stats.unknown_model_retries += 1
        return True

    def _move_from(self, link: Link, now: float) -> None:
        movable = [rid for rid in link.ids if rid not in self._targets]
        if not movable:
            return
        self._following.lost()  # the name may stand for other addresses now
        log.warning(
            "broker at %s is %s; sending its %d pending requests to the other brokers",
            link.endpoint,
            link.why_unusable(now),
            len(movable),
        )
        for request_id in movable:
            pending = self._table.get(request_id)
            self._unassign(request_id)
            if pending is not None and self._assign(pending, now):
                self._stats.failovers += 1
                self._stats.resent += 1

    def _follow_endpoints(self) -> None:
        """Links follow the addresses the endpoints stand for (re-resolved when due or
        after a lost connection, off this thread: :mod:`ipuserve.client.following`)."""
        for added, removed in self._following.changes():
            for endpoint in removed:
                self._drop_link(endpoint)
            for endpoint in added:
                try:
                    self._add_link(endpoint)
                except IpuserveError as exc:  # ZeroMQ refused it: the others carry on
                    log.warning("%s", exc)

    # ------------------------------------------------------------ I/O thread

    def _release(self) -> None:
        self._close_links()

    def _loop(self) -> None:
        poller = zmq.Poller()
        with self._turn_lock:
            now = time.monotonic()
            for link in self._links.values():
                link.ping(now)
            timeout_ms = self._plan()
        while not self._closed:
            if self._poller_stale:
                poller = self._poller()
            events = dict(poller.poll(timeout_ms))
            with self._turn_lock:
                self._turn(events)
                if not self._due:
                    timeout_ms = self._end_turn()
                    continue
            self._settle_due()
            with self._turn_lock:
                timeout_ms = self._end_turn()

    def _poller(self) -> zmq.Poller:
        self._poller_stale = False
        poller = zmq.Poller()
        poller.register(self._waker.fileno(), zmq.POLLIN)
        for link in self._links.values():
            poller.register(link.sock, zmq.POLLIN)
            poller.register(link.monitor, zmq.POLLIN)
        return poller

    def _turn(self, events: dict[Any, int]) -> None:
        now = time.monotonic()
        if self._waker.fileno() in events:
            self._take_inbox()
        for link in list(self._links.values()):
            if link.monitor in events and link.on_connection_events(now):
                self._following.lost()
            if link.sock in events:
                link.receive(now)
            if link.unsent:
                link.send_unsent()
        if not self._closed:
            self._tick(now)

    def _take_inbox(self) -> None:
        self._waker.clear()
        with self._lock:
            items, self._inbox = self._inbox, deque()
        for pending, to in items:
            self._place(pending, to)

    def _tick(self, now: float) -> None:
        self._expire(time.perf_counter_ns())
        for link in self._links.values():
            if link.liveness.ping_due(now):
                link.ping(now)
        self._follow_endpoints()
        self._rebalance(now)

    def _end_turn(self) -> int:
        if self._closed:
            return 0
        for link in self._links.values():
            link.outbox.flush()
        return self._plan()

    def _plan(self) -> int:
        """The poll timeout: until the next PING, deadline or re-resolution."""
        if self._inbox:
            return 0
        now = time.monotonic()
        waits = [self.config.ping_interval_s, self._following.seconds_until_due()]
        waits += [link.liveness.seconds_to_ping(now) for link in self._links.values()]
        due_ns = self._table.next_deadline_ns()
        if due_ns is not None:
            waits.append((due_ns - time.perf_counter_ns()) / 1e9)
        if self._parked or any(link.ids for link in self._links.values()):
            waits.append(self.config.liveness_s / 4)  # notice a silence in time
        return min(max(int(min(waits) * 1e3) + 1, 0), _MAX_POLL_MS)

    def _settle_due(self) -> None:
        """Settle what replies and expiry took out, without the turn lock."""
        due = self._due
        while due:
            pending, settle = due[0]
            if not pending.future.done():
                try:
                    settle(pending)
                except Exception as exc:  # e.g. numpy cannot view the reply's tensors
                    log.exception("cannot hand request %s its reply", pending.request_id.hex())
                    pending.fail(ProtocolError(f"unreadable reply ({exc!r})"))
            due.popleft()

    def _expire(self, now_ns: int) -> None:
        due_ns = self._table.next_deadline_ns()
        if due_ns is None or due_ns > now_ns:
            return
        answers = any(link.liveness.broker_answers() for link in self._links.values())
        grace_ns = int(self.config.deadline_grace_s * 1e9) if answers else None
        for pending in self._table.expired(now_ns, grace_ns):
            self._stats.expired += 1
            self._forget(pending.request_id)
            error = DeadlineExceeded(
                f"no reply within {pending.timeout_s} s (request {pending.request_id.hex()})"
                + self.silence_hint()
            )
            self._due.append((pending, _failing(error)))


def _failing(error: IpuserveError) -> Callable[[Pending], None]:
    return partial(Pending.fail, error=error)
