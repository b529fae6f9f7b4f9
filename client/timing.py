"""Where one request's time went, as the fabric reported it back with the result.

The client attaches a :class:`Timing` to every future (``future.timing``); the
benchmarks (:mod:`ipuserve.bench.recording`) add them up into the latency split.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Timing:
    """Where one request's time went, in microseconds, as the fabric reported it.

    ``worker_us`` is the whole stay in the worker (queue and device included);
    ``total_us`` is measured by the client from hand-over to result.
    """

    total_us: float
    broker_queue_us: float = 0.0
    worker_queue_us: float = 0.0
    device_us: float = 0.0
    worker_us: float = 0.0

    @property
    def worker_other_us(self) -> float:
        """Worker time that was neither queueing nor the device (validation, packing, copies)."""
        return max(self.worker_us - self.worker_queue_us - self.device_us, 0.0)

    @property
    def wire_us(self) -> float:
        """What the workers did not account for: sockets, framing, broker work, the client."""
        return max(self.total_us - self.broker_queue_us - self.worker_us, 0.0)
