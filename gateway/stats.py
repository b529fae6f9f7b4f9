"""Per-model counters in the shape of Triton's statistics extension, from the latency
split the fabric reports with every result (:class:`~ipuserve.client.Timing`).

The fabric batches behind the gateway's back, so an *execution* here is one request
the fabric ran (``execution_count`` counts requests, ``inference_count`` samples).
``queue`` is the time in the broker's and the worker's queues, ``compute_infer`` the
device time, ``compute_input`` the rest of the worker's time (validation, packing,
copies); ``compute_output`` is folded into that and stays 0.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from ipuserve.client import Timing


@dataclass(frozen=True)
class Duration:
    """How many and how long, in all (nanoseconds)."""

    count: int
    ns: int


@dataclass(frozen=True)
class ModelStatistics:
    """One model version's statistics (Triton's ``ModelStatistics``)."""

    name: str
    version: str
    last_inference_ms: int
    inference_count: int
    execution_count: int
    success: Duration
    fail: Duration
    queue: Duration
    compute_input: Duration
    compute_infer: Duration
    compute_output: Duration


class _Counter:
    __slots__ = ("count", "ns")

    def __init__(self) -> None:
        self.count = 0
        self.ns = 0

    def add(self, seconds_or_us: float, *, us: bool = False) -> None:
        self.count += 1
        self.ns += int(seconds_or_us * 1e3) if us else int(seconds_or_us * 1e9)

    def frozen(self) -> Duration:
        return Duration(self.count, self.ns)


class _ModelCounters:
    def __init__(self) -> None:
        self.last_inference_ms = 0
        self.inferences = 0
        self.executions = 0
        self.success = _Counter()
        self.fail = _Counter()
        self.queue = _Counter()
        self.compute_input = _Counter()
        self.compute_infer = _Counter()
        self.compute_output = _Counter()


class Statistics:
    """Counters by model version; safe to read from another thread (the gRPC door's)."""

    def __init__(self) -> None:
        self._models: dict[tuple[str, str], _ModelCounters] = {}
        self._lock = threading.Lock()

    def _counters(self, model: str, version: str) -> _ModelCounters:
        counters = self._models.get((model, version))
        if counters is None:
            counters = self._models.setdefault((model, version), _ModelCounters())
        return counters

    def succeeded(
        self, model: str, version: str, samples: int, seconds: float, timing: Timing
    ) -> None:
        with self._lock:
            c = self._counters(model, version)
            c.last_inference_ms = int(time.time() * 1e3)
            c.inferences += samples
            c.executions += 1
            c.success.add(seconds)
            c.queue.add(timing.broker_queue_us + timing.worker_queue_us, us=True)
            c.compute_input.add(timing.worker_other_us, us=True)
            c.compute_infer.add(timing.device_us, us=True)
            c.compute_output.add(0.0)

    def failed(self, model: str, version: str, seconds: float) -> None:
        with self._lock:
            c = self._counters(model, version)
            c.last_inference_ms = int(time.time() * 1e3)
            c.fail.add(seconds)

    def of(self, model: str, version: str) -> ModelStatistics:
        """A snapshot of ``model`` ``version``'s counters (zeros if it never served)."""
        with self._lock:
            c = self._models.get((model, version)) or _ModelCounters()
            return ModelStatistics(
                name=model,
                version=version,
                last_inference_ms=c.last_inference_ms,
                inference_count=c.inferences,
                execution_count=c.executions,
                success=c.success.frozen(),
                fail=c.fail.frozen(),
                queue=c.queue.frozen(),
                compute_input=c.compute_input.frozen(),
                compute_infer=c.compute_infer.frozen(),
                compute_output=c.compute_output.frozen(),
            )

    def names(self) -> list[str]:
        with self._lock:
            return list(dict.fromkeys(name for name, _ in self._models))

    def versions(self, model: str) -> list[str]:
        """The versions of ``model`` that have counters."""
        with self._lock:
            return [v for name, v in self._models if name == model]
