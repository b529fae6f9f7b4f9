"""What the runtime's tools measure with: a budget, a latency recorder, and rates.

Every tool counts the same way: a warm-up that is run but not measured, then
a measured phase that ends after a number of items (or runs) or a duration,
whichever comes first. Latencies are kept as integer nanoseconds in a compact
``array('q')`` (8 bytes each, so millions of items stay cheap) and summarised
only at the end by :func:`ipuserve.latency.latency_us`, the summary ``ipuserve
bench`` reports too.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass

from ipuserve.errors import ConfigError
from ipuserve.latency import latency_us

GB = 1e9


@dataclass(frozen=True, kw_only=True)
class Budget:
    """How long a benchmark runs: ``warmup`` unmeasured units, then ``count`` and/or
    ``duration_s`` measured (at least one of the two; the first reached ends it)."""

    warmup: int = 0
    count: int | None = None
    duration_s: float | None = None

    def __post_init__(self) -> None:
        if self.warmup < 0:
            raise ConfigError(f"warm-up must be >= 0, got {self.warmup}")
        if self.count is None and self.duration_s is None:
            raise ConfigError("give a measured count or a duration (or both)")
        if self.count is not None and self.count < 1:
            raise ConfigError(f"the measured count must be >= 1, got {self.count}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ConfigError(f"the duration must be > 0 seconds, got {self.duration_s}")

    def done(self, measured: int, elapsed_s: float) -> bool:
        """True once ``measured`` units or ``elapsed_s`` seconds use the budget up."""
        if self.count is not None and measured >= self.count:
            return True
        return self.duration_s is not None and elapsed_s >= self.duration_s


class LatencyRecorder:
    """Nanosecond samples, appended from one thread, summarised once at the end."""

    __slots__ = ("_values",)

    def __init__(self) -> None:
        self._values = array("q")

    def add(self, nanoseconds: int) -> None:
        self._values.append(nanoseconds)

    def __len__(self) -> int:
        return len(self._values)

    def summary_us(self) -> dict[str, float]:
        """:func:`ipuserve.latency.latency_us` of what was added (zeros when empty)."""
        return latency_us(self._values)


def rate(count: float, seconds: float) -> float:
    """``count`` per second, 0 for an empty or instantaneous measurement."""
    return round(count / seconds, 3) if seconds > 0 else 0.0


def gb_per_s(nbytes: int, seconds: float) -> float:
    """Decimal gigabytes per second (1 GB = 1e9 bytes, as link speeds are quoted)."""
    return round(nbytes / GB / seconds, 6) if seconds > 0 else 0.0


def now_ns() -> int:
    """The clock every tool measures with (monotonic, highest resolution)."""
    return time.perf_counter_ns()
