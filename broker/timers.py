"""Every timer of the broker on one heap: deadlines, heartbeats, the end of the start-up
grace, orphaned models, unreachable clients, the backlog retry, the shedding report.

The loop asks one thing per turn, the heap's first due time (how long to poll, and
whether anything is due now), so a turn that only moved messages costs no timer work
at all: nothing is scanned, nothing recomputed. Each timer is armed by the event that
makes it needed (a request with a deadline, a worker leaving, a reply that found no
client, the first OVERLOADED answer) and fires once; what it checks when it fires is
whether it still matters (the job is done, the model has a worker again, the client
was heard from). Such stale entries are cheaper than cancelling: a cancel would be a
search of the heap. But they must not pile up: every request with a timeout arms its
deadline, and nearly all are answered long before it (a client's timeout may be days),
so the heap would hold rate x timeout finished jobs (~450 B each: 175 MB at 13k
req/s and a 30 s timeout) and every push and pop would climb a deeper heap. So a
kind of timer may say when its entries are moot (:meth:`Timers.lapses`), and once
the heap has doubled since it was last rebuilt, it is rebuilt without them (the
amortised cost: well under 0.1 us a push, against ~1 us a stale entry's later pop).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any

#: What a timer runs when due: ``fire(arg, now)``.
Fire = Callable[[Any, float], None]
#: Whether a timer's ``arg`` no longer needs its ``fire`` (checked when the heap is rebuilt).
Moot = Callable[[Any], bool]

#: The heap is never rebuilt below this many entries: a scan of stale entries would
#: cost more than popping them when due.
COMPACT_MIN = 4096


def _never(_arg: Any, _now: float) -> None:  # pragma: no cover - the sentinel never fires
    raise AssertionError("the sentinel timer fired")


class Timers:
    """A heap of ``(due, seq, fire, arg)``; ``seq`` keeps equal due times in the order
    armed and spares comparing the callables. A sentinel due at +inf sits at the bottom,
    so ``heap[0]`` always exists and the loop needs no emptiness test."""

    __slots__ = ("_moot", "_seq", "compact_at", "compact_min", "heap")

    def __init__(self, compact_min: int = COMPACT_MIN) -> None:
        self._seq = itertools.count(1)
        #: never rebound (the loop holds it): rebuilt in place
        self.heap: list[tuple[float, int, Fire, Any]] = [(float("inf"), 0, _never, None)]
        #: the kinds of timer whose entries may go moot, by their ``fire`` (set up once)
        self._moot: dict[Fire, Moot] = {}
        self.compact_min = compact_min
        #: the heap is rebuilt without moot entries when it grows past this size
        self.compact_at = compact_min

    def __len__(self) -> int:
        """Timers armed (stale ones included), the sentinel not counted."""
        return len(self.heap) - 1

    def at(self, due: float, fire: Fire, arg: Any = None) -> None:
        """Run ``fire(arg, now)`` at the first turn at or after ``due`` (monotonic s)."""
        heap = self.heap
        heapq.heappush(heap, (due, next(self._seq), fire, arg))
        if len(heap) > self.compact_at:
            self.compact()

    def lapses(self, fire: Fire, moot: Moot) -> None:
        """Timers that run ``fire`` may be dropped unfired once ``moot(arg)`` is true
        (a deadline's job answered): the heap sheds them when it is rebuilt."""
        self._moot[fire] = moot

    def compact(self) -> None:
        """Rebuild the heap without its moot entries (in place); the next rebuild comes
        when it has doubled (at least :data:`COMPACT_MIN` entries): amortised O(1)."""
        moot = self._moot
        if moot:
            kept = [e for e in self.heap if (test := moot.get(e[2])) is None or not test(e[3])]
            heapq.heapify(kept)
            self.heap[:] = kept
        self.compact_at = max(self.compact_min, 2 * len(self.heap))

    @property
    def next_due(self) -> float:
        """When the earliest timer is due (+inf when none is armed)."""
        return self.heap[0][0]

    def run(self, now: float) -> int:
        """Fire every timer due by ``now``, earliest first; how many fired. A timer armed
        by one that fires, due by ``now`` as well, fires in this same call."""
        heap, fired = self.heap, 0
        while heap[0][0] <= now:
            _due, _seq, fire, arg = heapq.heappop(heap)
            fire(arg, now)
            fired += 1
        return fired
