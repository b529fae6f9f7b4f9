"""One capacity, several brokers: how much credit each broker connection may announce.

A worker serving several brokers runs one socket loop per broker (its own connection,
JobBook and credit) over one backend that holds at most ``capacity`` jobs (C). Each
broker respects only the credit it knows, so the worker must split C between them
and never let the parts add up to more, however their traffic shifts. Every
connection has a :class:`Share`; the :class:`CreditPool` keeps, under one lock,

    sum over shares of  leftover + max(exposure, held_current)  <=  C      (the invariant)

* ``held_current``: jobs the worker holds from that broker's current connection;
* ``leftover``: jobs it still holds from that broker's earlier connections (a reconnect,
  a restarted broker): the broker forgot them, so they are outside any credit it knows;
* ``exposure``: the most jobs the broker may yet place on the current connection -- the
  credit announced, or, while a lowered credit is not yet confirmed, the older and
  higher one: the broker may have sent jobs under it that are still on the wire.

The broker answers a HEARTBEAT that carries ``credit`` with one carrying the credit it
now counts, sent after every JOBS it placed under the old value (docs/protocol.md,
"Several brokers"). So a lower credit takes effect for the pool when that echo comes
back, and only one change per connection is in flight at a time: an echo is then
never mistaken for the answer to another change. Since a broker never has more jobs
outstanding at a connection than its credit, ``held_current <= exposure`` and the
worker holds at most C jobs in all.

Rebalancing splits C by demand (:meth:`CreditPool._targets`): a broker that used its
whole credit lately wants everything, one that did not wants a little more than the
most it held lately; every live broker keeps at least 1 when C allows, wants are
met smallest first (water-filling) and what nobody wants is spread evenly. A lower
target is announced at once, a higher one only from room that is free under the
invariant. With one broker its target is always C, as before there was a pool.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from ipuserve.worker.metrics import CreditMetrics

log = logging.getLogger(__name__)

#: how often the split is reconsidered when nothing else asks for it
REBALANCE_S = 0.25
#: a broker that used its whole credit within this long wants more
SATURATED_S = 1.0
#: each rebalance halves a broker's remembered peak of jobs held (then takes the max
#: with what it holds now): a burst is remembered for a second or so
PEAK_DECAY = 0.5


def _nothing() -> None:
    """A share's default doorbell."""


class Share:
    """One broker connection's part of a :class:`CreditPool`.

    Its socket loop reports what it holds (:meth:`update`), asks what to announce
    in HELLO (:meth:`hello`), sends :attr:`pending` when :attr:`pending_seq` moves on,
    and passes the broker's echo to :meth:`confirm`. The attributes change under the
    pool's lock; the loop may read them without it: each is one value, and a stale
    read errs on the safe side (see :meth:`CreditPool.admits`)."""

    def __init__(self, pool: CreditPool, name: str, notify: Callable[[], None]) -> None:
        self.name = name
        self._pool = pool
        #: rung (from any thread) when :attr:`pending` changed: wake the loop to send it
        self.notify = notify
        #: a connection (or a HELLO) is up: the broker may place jobs on it
        self.live = False
        #: no longer served: gone from the pool once its last job is done
        self.leaving = False
        #: the credit the broker confirmed (or HELLO announced)
        self.confirmed = 0
        #: a changed credit not yet confirmed, and its number (the loop sends each once)
        self.pending: int | None = None
        self.pending_seq = 0
        self.held_total = 0
        self.held_current = 0
        #: jobs wait in its book for room in the backend (set by its loop)
        self.waiting = False
        #: demand: the most held lately (decaying), and when the whole credit was last used
        self.peak = 0.0
        self.saturated_at = -math.inf

    @property
    def start_lock(self) -> threading.Lock:
        """The backend's start lock, shared by every connection's book."""
        return self._pool.start_lock

    @property
    def solo(self) -> bool:
        """The only connection of its pool (the single-broker rules apply)."""
        return self._pool.solo

    @property
    def granted(self) -> int:
        """The credit the broker counts, or will once :attr:`pending` reaches it."""
        return self.pending if self.pending is not None else self.confirmed

    @property
    def exposure(self) -> int:
        """The most jobs the broker may still place on the current connection."""
        if not self.live:
            return 0
        return max(self.confirmed, self.pending or 0)

    @property
    def reserve(self) -> int:
        """What the invariant counts for this connection."""
        leftover = self.held_total - self.held_current
        return leftover + max(self.exposure, self.held_current)

    def admits(self) -> bool:
        """Whether a new job on the current connection keeps within the invariant: with a
        broker that respects its credit, always. Read without the lock from the share's
        own loop: its exposure rises before that loop announces the rise, and falls
        only in that loop (:meth:`confirm`)."""
        return self.held_current < self.exposure

    def wake_waiting(self) -> None:
        """Room in the shared backend was freed (a job of this connection finished):
        wake the other connections' loops whose jobs wait for it, as they would not
        notice otherwise (from any thread; no lock: a stale list only wakes one more
        or one less, and that one's own next event starts its jobs)."""
        for share in self._pool.shares:
            if share.waiting and share is not self:
                share.notify()

    def hello(self, held_total: int) -> int:
        """A new connection begins: what it holds now is leftover; the credit to announce."""
        return self._pool.hello(self, held_total)

    def update(self, held_total: int, held_current: int) -> None:
        self._pool.update(self, held_total, held_current)

    def confirm(self, credit: int) -> None:
        """The broker's echo: it counts ``credit`` for this connection from now on."""
        self._pool.confirm(self, credit)

    def lost(self) -> None:
        """The connection ended (the socket is closed): nothing more can arrive on it."""
        self._pool.lost(self)

    def leave(self) -> None:
        """This broker is no longer served; the share goes once its jobs are done."""
        self._pool.leave(self)


class CreditPool:
    """The shares of one capacity among broker connections (module docstring)."""

    def __init__(
        self,
        capacity: int,
        metrics: CreditMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity < 0:  # 0: a repository worker's host node, which takes no jobs
            raise ValueError(f"a credit pool needs a capacity >= 0, got {capacity}")
        self.capacity = capacity
        self.metrics = metrics or CreditMetrics(capacity)
        self._clock = clock
        self._lock = threading.Lock()
        #: the JobBooks' start lock: one backend behind every connection
        self.start_lock = threading.Lock()
        self.shares: list[Share] = []
        #: jobs held now, all connections together, and the most ever
        self.held = 0
        self.held_max = 0
        self._next_rebalance = 0.0
        #: a live share's credit is below its target: room a finished job frees goes
        #: to it at once, not at the next rebalance
        self._short = False

    @property
    def solo(self) -> bool:
        """One connection only: the single-broker rules apply (:meth:`admits`)."""
        return len(self.shares) == 1

    def share(self, name: str, notify: Callable[[], None] = _nothing) -> Share:
        share = Share(self, name, notify)
        with self._lock:
            self.shares.append(share)
        return share

    def reserved(self) -> int:
        with self._lock:
            return sum(s.reserve for s in self.shares)

    def rename(self, share: Share, name: str) -> None:
        """The connection's broker is now reached under ``name`` (its metrics label)."""
        with self._lock:
            self.metrics.set_credit(share.name, None)
            share.name = name
            self._count()

    # ------------------------------------------------------------ events

    def hello(self, share: Share, held_total: int) -> int:
        with self._lock:
            share.live, share.pending, share.confirmed = True, None, 0
            share.held_total, share.held_current = held_total, 0
            target = self._targets(self._clock())[share]
            free = self.capacity - sum(s.reserve for s in self.shares)
            share.confirmed = max(0, min(target, free))
            changed = self._rebalance()
            self._count()
            credit = share.confirmed
        self._ring(changed)
        log.debug("%s: HELLO announces credit %d", share.name, credit)
        return credit

    def update(self, share: Share, held_total: int, held_current: int) -> None:
        now = self._clock()
        if (
            held_total == share.held_total
            and held_current == share.held_current
            and now < self._next_rebalance
        ):
            return  # every turn of every loop reports: most change nothing
        with self._lock:
            freed = held_total < share.held_total
            share.held_total, share.held_current = held_total, held_current
            share.peak = max(share.peak, held_current)
            if share.live and held_current >= max(1, share.exposure):
                share.saturated_at = now
            changed: list[Share] = []
            if share.leaving and held_total == 0:
                self._remove(share)
                changed = self._rebalance()
            elif now >= self._next_rebalance or (freed and self._short):
                changed = self._rebalance()
            self._count(credits=bool(changed))
        self._ring(changed)

    def confirm(self, share: Share, credit: int) -> None:
        with self._lock:
            if not share.live or share.pending != credit:
                return  # an echo of the drain's credit 0, or of an older connection
            share.confirmed, share.pending = credit, None
            changed = self._rebalance()
            self._count()
        self._ring(changed)

    def lost(self, share: Share) -> None:
        with self._lock:
            share.live, share.pending, share.confirmed = False, None, 0
            changed = self._rebalance()
            self._count()
        self._ring(changed)

    def leave(self, share: Share) -> None:
        with self._lock:
            share.live, share.leaving, share.pending, share.confirmed = False, True, None, 0
            if share.held_total == 0:
                self._remove(share)
            changed = self._rebalance()
            self._count()
        self._ring(changed)

    # ------------------------------------------------------------ the split

    def _remove(self, share: Share) -> None:
        if share in self.shares:
            self.shares.remove(share)
            self.metrics.set_credit(share.name, None)

    def _rebalance(self) -> list[Share]:
        """Move every live share towards its target: lower ones at once, higher ones
        from free room. The shares whose :attr:`Share.pending` changed."""
        now = self._clock()
        self._next_rebalance = now + REBALANCE_S
        live = [s for s in self.shares if s.live]
        if not live:
            self._short = False
            return []
        targets = self._targets(now)
        for share in self.shares:
            share.peak = max(share.held_current, share.peak * PEAK_DECAY)
        changed = []
        for share in live:
            if share.pending is None and targets[share] < share.confirmed:
                share.pending = targets[share]
                changed.append(share)
        free = self.capacity - sum(s.reserve for s in self.shares)
        for share in sorted(live, key=lambda s: s.confirmed - targets[s]):
            if free <= 0:
                break
            if share.pending is not None or targets[share] <= share.confirmed:
                continue
            before = max(share.confirmed, share.held_current)
            share.pending = min(targets[share], before + free)
            free -= max(share.pending, share.held_current) - before
            changed.append(share)
        for share in changed:
            share.pending_seq += 1
        self._short = any(s.granted < targets[s] for s in live)
        return changed

    def _targets(self, now: float) -> dict[Share, int]:
        """Each live share's credit by demand (the module docstring's rule)."""
        live = [s for s in self.shares if s.live]
        capacity = self.capacity
        wants = {
            s: capacity if now - s.saturated_at < SATURATED_S else round(s.peak) + 1 for s in live
        }
        by_want = sorted(live, key=lambda s: -wants[s])  # stable: the earlier first on ties
        if capacity < len(live):  # not one each: the most wanting get one
            return {s: int(i < capacity) for i, s in enumerate(by_want)}
        targets = dict.fromkeys(live, 1)
        left = capacity - len(live)
        ascending = by_want[::-1]
        for i, share in enumerate(ascending):
            give = min(wants[share] - 1, left // (len(ascending) - i))
            targets[share] += give
            left -= give
        for i, share in enumerate(by_want):  # what nobody wants: evenly, the wanting first
            targets[share] += left // len(by_want) + int(i < left % len(by_want))
        return targets

    # ------------------------------------------------------------ reporting

    def _count(self, credits: bool = True) -> None:
        """The held gauges, and (``credits``: they may have changed) each credit's."""
        held = sum(s.held_total for s in self.shares)
        self.held = held
        self.held_max = max(self.held_max, held)
        metrics = self.metrics
        metrics.held.set(float(held))
        metrics.held_max.set(float(self.held_max))
        if credits:
            for share in self.shares:
                metrics.set_credit(share.name, share.granted if share.live else 0)

    @staticmethod
    def _ring(changed: list[Share]) -> None:
        for share in changed:
            share.notify()
