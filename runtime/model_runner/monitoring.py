"""Per-replica monitoring: request tracepoints and the statistics of spec section 3.8.

Every finished request leaves a :class:`RequestTrace` (microseconds per phase).
Means and percentiles are taken over the last ``request_tracepoints_buffer_size``
traces (0 = all of them); counts are totals since the runner started. Beyond
the spec's four phases, the counts include ipuserve's device-side figures:
``batches_...`` (main-program runs), ``flushed_batches_...`` (runs padded by a
flush), ``padded_samples_...`` (dummy samples those runs carried) and
``read_timeouts_...`` (input waits that ran out, flushed or not).

Phases: *read preparation* -- from the execute call until the request sits in
the queues; *read queue* -- until the device starts reading it; *computation* --
from the device having read it all until its last output is written; *request*
-- the whole thing.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import NamedTuple

import numpy as np

from ipuserve.errors import ConfigError

PHASES = ("request", "read_preparation", "read_queue", "computation")


class RequestTrace(NamedTuple):
    """Microseconds per phase of one request (a tuple: one is made per request)."""

    request_duration_us: float
    read_preparation_duration_us: float
    read_queue_duration_us: float
    computation_duration_us: float

    def phase(self, name: str) -> float:
        value: float = getattr(self, f"{name}_duration_us")
        return value


class Monitor:
    def __init__(self, buffer_size: int) -> None:
        self._traces: deque[RequestTrace] = deque(maxlen=buffer_size or None)
        self._lock = threading.Lock()
        self.requests = 0
        self.batches = 0
        self.flushed_batches = 0
        self.padded_samples = 0
        self.read_timeouts = 0

    def record(self, trace: RequestTrace) -> None:
        with self._lock:
            self._traces.append(trace)
            self.requests += 1

    def record_batch(self) -> None:
        self.batches += 1  # only the device thread writes it

    def record_read_timeout(self) -> None:
        self.read_timeouts += 1  # only the thread reading inputs writes it

    def record_flush(self, padded_samples: int) -> None:
        with self._lock:
            self.flushed_batches += 1
            self.padded_samples += padded_samples

    def time_trace(self, info: dict[str, float], cur: int = -1) -> dict[str, float]:
        with self._lock:
            if not self._traces:
                return info
            if not -len(self._traces) <= cur < len(self._traces):
                raise IndexError(
                    f"tracepoint {cur} is not kept: the buffer holds the last "
                    f"{len(self._traces)} requests (request_tracepoints_buffer_size)"
                )
            trace = self._traces[cur]
        for phase in PHASES:
            info[f"{phase}_duration_us"] = trace.phase(phase)
        return info

    def percentile(self, info: dict[str, float], quantile: float) -> dict[str, float]:
        if not 0.0 <= quantile <= 1.0:
            raise ConfigError(f"quantile must be within [0, 1], got {quantile}")
        for phase, values in self._columns().items():
            info[f"{phase}_monitoring_statistics_percentile_us"] = float(
                np.quantile(values, quantile)
            )
        return info

    def mean(self, info: dict[str, float]) -> dict[str, float]:
        for phase, values in self._columns().items():
            info[f"{phase}_monitoring_statistics_mean_us"] = float(np.mean(values))
        return info

    def total_count(self, info: dict[str, float]) -> dict[str, float]:
        with self._lock:
            counts = {phase: self.requests for phase in PHASES}
            counts.update(
                batches=self.batches,
                flushed_batches=self.flushed_batches,
                padded_samples=self.padded_samples,
                read_timeouts=self.read_timeouts,
            )
        for name, count in counts.items():
            info[f"{name}_monitoring_statistics_count"] = float(count)
        return info

    def _columns(self) -> dict[str, np.ndarray]:
        with self._lock:
            traces = list(self._traces)
        if not traces:
            return {}
        return {phase: np.array([t.phase(phase) for t in traces]) for phase in PHASES}
