"""The client's core: a connection to one or more brokers, with no I/O of its own.

The sans-I/O shape of h11 and httpcore: :class:`Core` never touches a socket, a
thread, a lock or an event loop. Its driver -- the I/O thread of
:class:`~ipuserve.client.Client` (:mod:`ipuserve.client.thread_loop`) or the event
loop of :class:`~ipuserve.client.AsyncClient` (:mod:`ipuserve.client.async_loop`) --
owns the sockets and feeds it events:

* a request submitted (:meth:`Core.submit`; :meth:`Core.place_direct` for the send
  from the caller's thread), frames received on link L (:meth:`Core.on_frames`), a
  connection event on link L (:meth:`Core.on_connection_event`), time passed
  (:meth:`Core.tick`), endpoints changed (:meth:`Core.add_link`,
  :meth:`Core.drop_link`);

and it sends through each link's :class:`~ipuserve.client.link.Port` (a non-blocking
``send_frames`` that says False when the pipe is full). What is due to settle waits in
:attr:`Core.due` (a request and how to settle it), for the driver to settle without
its lock held; :meth:`Core.wait_s` says how long the driver may wait for I/O.

What it does (docs/protocol.md, "A client with several brokers"):

* **Links.** One per configured endpoint, or per address of a name that resolves to
  several. One broker is the one-link case of several.
* **Spreading.** A new request goes to the usable link with the fewest pending
  requests, ties taken round-robin (:func:`least_loaded`). Usable: connected, heard
  within ``liveness_s`` (every link is PINGed every ``ping_interval_s``, busy or
  not, so an idle link's health is known too), not shutting down, not a backend port.
* **Failover.** When a link stops being usable and another is usable, its pending
  requests go to the others with their ids unchanged (``ClientStats.failovers``).
  The pending table is shared: the first reply for an id settles it, a later one is
  dropped and counted (``dropped_replies``). With no usable link, requests wait
  unsent ("parked") -- but a lone link takes them (there is nowhere else to go:
  ZeroMQ keeps them until the broker is there) -- and a link keeps what it had,
  re-sending it on reconnection, a new epoch, and once per silence; each request's
  deadline still holds. A link that comes back gets new requests again.
* **UNKNOWN_MODEL** from one broker sends the request to a broker that has not said
  so yet, before it fails; that broker is then left out of the model's placement
  until its MODELS_REPLY lists the model or ``lacking.FORGET_AFTER_S`` passed
  (:mod:`ipuserve.client.lacking`), unless every usable broker is.
* **Dead ends.** A link pointed at a broker's backend (worker) port, or whose broker
  refused the handshake (CURVE keys; its connection monitor says so), is unusable;
  its requests fail at once (UnavailableError; HandshakeRefusedError, saying why and
  what to check) when no other link is usable, and those for its broker only at once
  in any case. The other links serve on.
* **Deadlines.** A request past its deadline fails with DeadlineExceeded, after
  ``deadline_grace_s`` more when a broker answers (its own DEADLINE_EXCEEDED, which
  says where the request waited, is then on its way).
* **Exactly once.** Every request leaves the table once (answered, failed, expired
  or taken at close), and only then is it put in :attr:`Core.due`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial

import zmq

from ipuserve.client.config import ClientConfig, ClientStats
from ipuserve.client.lacking import Lacking
from ipuserve.client.link import Link, Port
from ipuserve.client.pending import Pending, PendingTable
from ipuserve.client.reply_router import Due
from ipuserve.errors import DeadlineExceeded, IpuserveError, UnavailableError

__all__ = ["Core", "LinkInfo", "least_loaded"]

log = logging.getLogger(__name__)

#: per-link counters that add up into the client's
_LINK_COUNTERS = ("batched", "grouped", "groups", "reconnects", "epoch_changes")


@dataclass(frozen=True)
class LinkInfo:
    """One broker link as :meth:`Client.links` shows it."""

    endpoint: str
    usable: bool
    pending: int
    #: requests this link was given (new ones and those moved here)
    assigned: int
    epoch: str | None


def least_loaded(loads: Sequence[int], turn: int) -> int:
    """The index of the smallest load; among equal ones, the first at or after
    ``turn % len(loads)`` (round-robin), so one request at a time still visits every
    link instead of always the first. ``loads`` must not be empty."""
    count = len(loads)
    start = turn % count
    order: list[int] = [*range(start, count), *range(start)]
    best = order[0]
    for index in order:
        if loads[index] < loads[best]:
            best = index
    return best


class Core:
    """The links, the shared pending table, the deadlines and the failover."""

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        #: the client's own counters (:attr:`stats` adds the links')
        self.shared = ClientStats()
        self.table = PendingTable()
        #: requests out of the table, to settle in order by the driver (without its
        #: lock held); each leaves only once settled, so close() can fail what a
        #: blocked done-callback strands
        self.due: Due = deque()
        self.links: dict[str, Link] = {}
        self._owner: dict[bytes, Link] = {}
        #: requests waiting for a usable link
        self._parked: dict[bytes, None] = {}
        #: requests for one broker (its models), never moved: id -> endpoint
        self._targets: dict[bytes, str] = {}
        #: the brokers that answered a request UNKNOWN_MODEL: id -> their endpoints
        self._refused: dict[bytes, set[str]] = {}
        #: which broker lacks which model (their UNKNOWN_MODEL), for a while
        self._lacking = Lacking()
        self._assigned: dict[str, int] = {}
        self._turns = 0
        #: a connection was lost or a broker's requests moved: the names may stand for
        #: other addresses now (the driver asks for a re-resolution and clears this)
        self.lost = False

    # ------------------------------------------------------------ links

    def add_link(self, endpoint: str, port: Port) -> Link:
        link = Link(
            endpoint,
            port,
            self.config,
            self.table,
            self.shared,
            self.due,
            self._forget,
            self._elsewhere,
            self._lacking,
        )
        self.links[endpoint] = link
        return link

    def drop_link(self, endpoint: str) -> Link:
        """The endpoint is gone: its requests go to the others (this turn's
        :meth:`tick`), those for its broker only fail. The driver closes its socket."""
        link = self.links.pop(endpoint)
        self._lacking.forget(endpoint)
        gone = _failing(UnavailableError(f"the broker at {endpoint} is gone"))
        for request_id in list(link.ids):
            if request_id in self._targets:
                link.router.finish(request_id, gone)
            else:
                self._unassign(request_id)
                self._parked[request_id] = None
                self.shared.failovers += 1
                self.shared.resent += 1
        return link

    # ------------------------------------------------------------ requests

    def submit(self, pending: Pending, now: float, to: str | None = None) -> None:
        """Register a new request and give it to a link's turn batch (or park it);
        ``to``: only that link's broker. Sent by :meth:`flush`."""
        self.table.add(pending)
        self.shared.sent += 1
        if to is None:
            self._assign(pending, now)
            return
        self._targets[pending.request_id] = to
        link = self.links.get(to)
        if link is None:
            error = UnavailableError(f"no link to {to}")
            self.due.append((self.table.pop(pending.request_id) or pending, _failing(error)))
            self._forget(pending.request_id)
            return
        self._give(link, pending)

    def place_direct(self, pending: Pending, now: float) -> Link | None:
        """The send from the caller's thread: register ``pending`` on the link it
        would go to if it can leave at once -- nothing parked before it, nothing
        deferred on that link, within its limit and not held -- and return the link,
        on whose port the driver sends it (``link.send(pending)``); None: submit it."""
        if self._parked:
            return None
        link = self._pick(now, pending.model)
        if link is None or link.unsent or link.batch or not link.sendable(pending):
            return None
        self.table.add(pending)
        self.shared.sent += 1
        self.shared.direct += 1
        self._give(link, pending, batch=False)
        return link

    def torn(self, pending: Pending, error: BaseException) -> None:
        """A direct send ended by an exception (Ctrl-C): the request is forgotten (its
        caller never got its future) and fails with ``error``."""
        if self.table.pop(pending.request_id) is pending:
            pending.fail(error)
        self._forget(pending.request_id)

    # ------------------------------------------------------------ events

    def on_frames(self, link: Link, frames: list[zmq.Frame], now: float) -> None:
        """One message received on ``link``."""
        link.on_frames(frames, now)

    def on_connection_event(self, link: Link, event: int, value: int, now: float) -> None:
        """One event of ``link``'s connection monitor."""
        if event == zmq.EVENT_DISCONNECTED:
            self.lost = True
        link.on_connection_event(event, value, now)

    def send_unsent(self) -> None:
        """Send what found a pipe full (call when a socket may have room again)."""
        for link in self.links.values():
            if link.unsent:
                link.send_unsent()

    def tick(self, now: float, now_ns: int) -> None:
        """Time passed: expire, PING, re-send after a silence, fail over."""
        self._expire(now_ns)
        for link in self.links.values():
            if link.liveness.ping_due(now):
                link.ping(now)
        self._rebalance(now)

    def flush(self) -> None:
        """Send what the links' turn batches hold (the end of a driver's turn)."""
        for link in self.links.values():
            link.batch.flush()

    # ------------------------------------------------------------ questions

    def wait_s(self, now: float, now_ns: int) -> float:
        """How long the driver may wait for I/O before the next :meth:`tick`: the next
        PING or deadline, a quarter of the liveness window while requests are out
        (to notice a silence in time), 0 while a turn batch holds requests."""
        waits = [self.config.ping_interval_s]
        busy = bool(self._parked)
        for link in self.links.values():
            if link.batch:
                return 0.0
            waits.append(link.liveness.seconds_to_ping(now))
            busy = busy or bool(link.ids)
        due_ns = self.table.next_deadline_ns()
        if due_ns is not None:
            waits.append((due_ns - now_ns) / 1e9)
        if busy:
            waits.append(self.config.liveness_s / 4)
        return max(min(waits), 0.0)

    @property
    def stats(self) -> ClientStats:
        """The client's counters plus every link's (epoch: the links' epochs, sorted)."""
        merged = dataclasses.replace(self.shared)
        links = list(self.links.values())
        for name in _LINK_COUNTERS:
            total = getattr(merged, name) + sum(getattr(k.stats, name) for k in links)
            setattr(merged, name, total)
        epochs = sorted({link.stats.epoch for link in links if link.stats.epoch})
        merged.epoch = " ".join(epochs) or None
        limits = [k.stats.max_payload_bytes for k in links if k.stats.max_payload_bytes]
        merged.max_payload_bytes = min(limits) if limits else None
        return merged

    def link_infos(self, now: float) -> list[LinkInfo]:
        return [
            LinkInfo(e, k.usable(now), len(k.ids), self._assigned.get(e, 0), k.stats.epoch)
            for e, k in list(self.links.items())
        ]

    def silence_hint(self) -> str:
        """The first link's hint that has one (none while a broker is usable): what a
        timeout tells its caller about brokers that never answered, refused the
        handshake, shut down, or are backend ports."""
        links = list(self.links.values())
        now = time.monotonic()
        if any(link.usable(now) for link in links):
            return ""
        for link in links:
            hint = link.liveness.silence_hint()
            if hint:
                return hint
        return ""

    def outstanding(self) -> list[Pending]:
        """Every request not settled yet: in the table or due."""
        return [*self.table.values(), *(p for p, _ in self.due)]

    def take_outstanding(self) -> list[Pending]:
        """:meth:`outstanding`, now no longer the core's (the client closes)."""
        outstanding = self.outstanding()
        self.table.take_all()
        self.due.clear()
        return outstanding

    # ------------------------------------------------------------ placing

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

    def _pick(self, now: float, model: str | None) -> Link | None:
        """The usable link with the fewest pending, among those not known to lack
        ``model`` if any; a lone link even if not usable (unless it is a dead end);
        None: park."""
        if len(self.links) == 1:  # one broker: the lone link, whatever its state
            (link,) = self.links.values()
            return None if link.liveness.dead_end() else link
        usable = [link for link in self.links.values() if link.usable(now)]
        if usable and model is not None and self._lacking:
            usable = self._serving(usable, model, now) or usable
        if usable:
            self._turns += 1
            return usable[least_loaded([len(k.ids) for k in usable], self._turns)]
        return None

    def _assign(self, pending: Pending, now: float) -> bool:
        """To the usable link with the fewest pending; parked when none is usable."""
        link = self._pick(now, pending.model)
        if link is None:
            self._parked[pending.request_id] = None
            return False
        self._give(link, pending)
        return True

    def _give(self, link: Link, pending: Pending, *, batch: bool = True) -> None:
        request_id = pending.request_id
        self._parked.pop(request_id, None)
        self._owner[request_id] = link
        link.ids[request_id] = None
        self._assigned[link.endpoint] = self._assigned.get(link.endpoint, 0) + 1
        if batch:
            link.batch.add(pending)

    def _rebalance(self, now: float) -> None:
        """Parked requests to usable links; a failed link's requests to the others."""
        if not self._parked:  # the common case, every turn: nothing to move?
            for link in self.links.values():
                if link.ids and not link.usable(now):
                    break
            else:
                return
        if not any(link.usable(now) for link in self.links.values()):
            for link in self.links.values():
                dead_end = link.liveness.dead_end() if link.ids else None
                if dead_end is not None:
                    self._fail_on(link, link.ids, dead_end)
                elif link.ids and link.liveness.silence(now, len(link.ids)):
                    link.resend_all()  # as with one broker: re-send once per silence
            if self._parked and all(k.liveness.dead_end() for k in self.links.values()):
                self._fail_parked()
            return
        for link in list(self.links.values()):
            if link.ids and not link.usable(now):
                dead_end = link.liveness.dead_end()
                if dead_end is not None:  # what only its broker may serve fails now
                    self._fail_on(link, [r for r in link.ids if r in self._targets], dead_end)
                self._move_from(link, now)
        for request_id in list(self._parked):
            pending = self.table.get(request_id)
            if pending is None:
                del self._parked[request_id]
            elif not self._assign(pending, now):
                return

    def _fail_on(self, link: Link, request_ids: Iterable[bytes], error: IpuserveError) -> None:
        """``link`` is a dead end and no other broker may take these requests."""
        for request_id in list(request_ids):
            link.router.finish(request_id, _failing(error))

    def _fail_parked(self) -> None:
        """Every link is a dead end: the parked requests fail with the first's reason."""
        errors = (link.liveness.dead_end() for link in self.links.values())
        error = next((e for e in errors if e is not None), None)
        hint = self.silence_hint().removeprefix(": ") or "no broker is usable"
        for request_id in list(self._parked):
            pending = self.table.pop(request_id)
            self._forget(request_id)
            if pending is not None:
                self.shared.replies += 1
                self.due.append((pending, _failing(error or UnavailableError(hint))))

    def _elsewhere(self, link: Link, request_id: bytes) -> bool:
        """``link``'s broker does not serve the request's model: remember that, and
        give the request to a usable link whose broker has not said so (for it, or
        lately for its model); False when none is left (it fails)."""
        pending = self.table.get(request_id)
        now = link.liveness.last_heard  # when the answer came
        if pending is not None and pending.model is not None:
            self._lacking.refused(link.endpoint, pending.model, now)
        if pending is None or pending.model is None or request_id in self._targets:
            return False
        refused = self._refused.setdefault(request_id, set())
        refused.add(link.endpoint)
        others = [k for k in self.links.values() if k.endpoint not in refused and k.usable(now)]
        others = self._serving(others, pending.model, now)
        if not others:
            return False
        self._unassign(request_id)
        self._turns += 1
        self._give(others[least_loaded([len(k.ids) for k in others], self._turns)], pending)
        self.shared.unknown_model_retries += 1
        return True

    def _serving(self, links: list[Link], model: str, now: float) -> list[Link]:
        """Those of ``links`` not known to lack ``model``."""
        return [k for k in links if not self._lacking.lacks(k.endpoint, model, now)]

    def _move_from(self, link: Link, now: float) -> None:
        movable = [rid for rid in link.ids if rid not in self._targets]
        if not movable:
            return
        self.lost = True  # the name may stand for other addresses now
        log.warning(
            "broker at %s is %s; sending its %d pending requests to the other brokers",
            link.endpoint,
            link.why_unusable(now),
            len(movable),
        )
        for request_id in movable:
            pending = self.table.get(request_id)
            self._unassign(request_id)
            if pending is not None and self._assign(pending, now):
                self.shared.failovers += 1
                self.shared.resent += 1

    # ------------------------------------------------------------ deadlines

    def _expire(self, now_ns: int) -> None:
        due_ns = self.table.next_deadline_ns()
        if due_ns is None or due_ns > now_ns:
            return
        answers = any(link.liveness.broker_answers() for link in self.links.values())
        grace_ns = int(self.config.deadline_grace_s * 1e9) if answers else None
        for pending in self.table.expired(now_ns, grace_ns):
            self.shared.expired += 1
            self._forget(pending.request_id)
            error = DeadlineExceeded(
                f"no reply within {pending.timeout_s} s (request {pending.request_id.hex()})"
                + self.silence_hint()
            )
            self.due.append((pending, _failing(error)))


def _failing(error: IpuserveError) -> Callable[[Pending], None]:
    return partial(Pending.fail, error=error)
