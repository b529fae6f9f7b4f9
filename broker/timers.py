"""Every timer of the broker on one heap: deadlines, heartbeats, the end of the start-up
grace, orphaned models, unreachable clients, the backlog retry, the shedding report.

The loop asks one thing per turn, the heap's first due time (how long to poll, and
whether anything is due now), so a turn that only moved messages costs no timer work
at all: nothing is scanned, nothing recomputed. Each timer is armed by the event that
makes it needed (a request with a deadline, a worker leaving, a reply that found no
client, the first OVERLOADED answer) and fires once; what it checks when it fires is
whether it still matters (the job is done, the model has a worker again, the client
was heard from). Such stale entries are cheaper than cancelling: a cancel would be a
search of the heap.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any

#: What a timer runs when due: ``fire(arg, now)``.
Fire = Callable[[Any, float], None]


def _never(_arg: Any, _now: float) -> None:  # pragma: no cover - the sentinel never fires
    raise AssertionError("the sentinel timer fired")


class Timers:
    """A heap of ``(due, seq, fire, arg)``; ``seq`` keeps equal due times in the order
    armed and spares comparing the callables. A sentinel due at +inf sits at the bottom,
    so ``heap[0]`` always exists and the loop needs no emptiness test."""

    __slots__ = ("_seq", "heap")

    def __init__(self) -> None:
        self._seq = itertools.count(1)
        self.heap: list[tuple[float, int, Fire, Any]] = [(float("inf"), 0, _never, None)]

    def __len__(self) -> int:
        """Timers armed (stale ones included), the sentinel not counted."""
        return len(self.heap) - 1

    def at(self, due: float, fire: Fire, arg: Any = None) -> None:
        """Run ``fire(arg, now)`` at the first turn at or after ``due`` (monotonic s)."""
        heapq.heappush(self.heap, (due, next(self._seq), fire, arg))

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
