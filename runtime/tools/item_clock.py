"""Per-item timing shared by a producer thread and a consumer thread.

The producer calls :meth:`ItemClock.started` just before it enqueues item ``i``;
the consumer calls :meth:`ItemClock.completed` when item ``i`` has come out the
other end. Items complete in the order they started (the rings are FIFO), so the
consumer needs no item id: the n-th completion belongs to the n-th start. Only
items after the warm-up are measured; the measured window runs from the start
of the first measured item to the completion of the last one.

Threads: ``started``/``close`` on the producer, ``completed`` on the consumer,
the rest on the main thread. ``starts`` is only appended to, and list appends
and reads are atomic under the GIL, so no lock is needed on the hot path.
"""

from __future__ import annotations

import threading
from typing import Any

from ipuserve.progress import Progress
from ipuserve.runtime.tools.queues_config import QueuesBenchConfig
from ipuserve.runtime.tools.stats import Budget, LatencyRecorder, gb_per_s, now_ns, rate


class ItemClock:
    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.latency = LatencyRecorder()
        self.finished = threading.Event()
        self._starts: list[int] = []
        self._completed = 0
        self._total: int | None = None
        self._last_done_ns = 0

    # -- producer ------------------------------------------------------------------
    def started(self) -> int:
        """Stamp the next item's start; returns its index (0-based)."""
        self._starts.append(now_ns())
        return len(self._starts) - 1

    def close(self, total: int) -> None:
        """The producer made ``total`` items and no more: finish once all have completed."""
        self._total = total
        if self._completed >= total:
            self.finished.set()

    # -- consumer ------------------------------------------------------------------
    def completed(self) -> None:
        """The oldest outstanding item came out."""
        done = now_ns()
        index = self._completed
        if index >= self.warmup:
            self.latency.add(done - self._starts[index])
        self._completed = index + 1
        self._last_done_ns = done
        total = self._total
        if total is not None and index + 1 >= total:
            self.finished.set()

    def spent(self, budget: Budget, produced: int) -> bool:
        """Whether a producer that made ``produced`` items has used ``budget`` up."""
        since = self.measuring_since_ns()
        elapsed = 0.0 if since is None else (now_ns() - since) / 1e9
        return budget.done(produced - self.warmup, elapsed)

    # -- main thread ----------------------------------------------------------------
    def progress(self, started_ns: int) -> Progress:
        """A progress snapshot: completions in the current phase, seconds since it began."""
        done, since = self._completed, self.measuring_since_ns()
        if done < self.warmup or since is None:
            return Progress("warm-up", (now_ns() - started_ns) / 1e9, done, "items")
        return Progress("measuring", (now_ns() - since) / 1e9, done - self.warmup, "items")

    def done_count(self) -> int:
        return self._completed

    def started_count(self) -> int:
        return len(self._starts)

    def measuring_since_ns(self) -> int | None:
        """When the first measured item started (None while still warming up)."""
        return self._starts[self.warmup] if len(self._starts) > self.warmup else None

    def measured(self) -> tuple[int, float]:
        """(items measured, seconds of the measured window), from completed items only."""
        count = self._completed - self.warmup
        begin = self.measuring_since_ns()
        if count <= 0 or begin is None:
            return 0, 0.0
        return count, (self._last_done_ns - begin) / 1e9


def item_report(
    config: QueuesBenchConfig, clock: ItemClock, interrupted: bool, **extra: int
) -> dict[str, Any]:
    """The report both queue modes share: counts, throughput and latency of measured items.

    Self-consistent by construction: ``samples = items * request_size`` and
    ``bytes = items * item_bytes``; ``latency_us.count == items``.
    """
    items, seconds = clock.measured()
    samples, nbytes = items * config.request_size, items * config.item_bytes()
    return {
        "tool": "queues-benchmark",
        "config": config.describe(),
        "item_bytes": config.item_bytes(),
        "items_started": clock.started_count(),
        "items_completed": clock.done_count(),
        "warmup_items": min(clock.warmup, clock.done_count()),
        "items": items,
        "samples": samples,
        "bytes": nbytes,
        "duration_s": round(seconds, 6),
        "throughput": {
            "items_per_s": rate(items, seconds),
            "samples_per_s": rate(samples, seconds),
            "gb_per_s": gb_per_s(nbytes, seconds),
        },
        "latency_us": clock.latency.summary_us(),
        **extra,
        "interrupted": interrupted,
    }
