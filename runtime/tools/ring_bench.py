"""The queues benchmark's raw mode: one bare :class:`SpscRingBuffer`, no packing.

What is left when the queues' batching is taken away: the producer write-locks a
slot, puts a reference to its tensor in it and publishes it; the consumer
read-locks the slot, looks at the reference and releases it. Nothing is copied,
so the GB/s reported is the payload the references stand for -- the ceiling the
queues' own bookkeeping and copies are to be compared with. Latency is from the
start of ``writeLock()`` to the consumer holding the slot.

The producer ends the stream with an ``end`` slot (``dummy=True``), so the
consumer stops after the last real item without any timeout.
"""

from __future__ import annotations

from typing import Any

from ipuserve.progress import ProgressCallback
from ipuserve.runtime.queues import InputData
from ipuserve.runtime.ring_buffer import SpscRingBuffer
from ipuserve.runtime.tools.item_clock import ItemClock, item_report
from ipuserve.runtime.tools.queues_config import QueuesBenchConfig
from ipuserve.runtime.tools.stats import now_ns
from ipuserve.runtime.tools.workers import Worker, supervise


def run_ring_benchmark(
    config: QueuesBenchConfig, progress: ProgressCallback | None = None
) -> dict[str, Any]:
    """Stream items through one ring; the report has the same fields as the queues mode."""
    return RingRun(config).run(progress)


class RingRun:
    def __init__(self, config: QueuesBenchConfig) -> None:
        self.config = config
        self.ring: SpscRingBuffer[InputData] = SpscRingBuffer(
            config.slots(), "bench-ring", factory=InputData
        )
        self.clock = ItemClock(config.budget.warmup)
        self.source = config.source_tensor()
        self.payload_bytes = 0  # what the consumer saw the references stand for
        self._stopping = False

    def run(self, progress: ProgressCallback | None = None) -> dict[str, Any]:
        started = now_ns()
        workers = [
            Worker("bench-producer", self.produce, self.clock.finished.set),
            Worker("bench-consumer", self.consume, self.clock.finished.set),
        ]
        interrupted = supervise(
            workers, self.clock.finished, self.stop, lambda: self._tick(progress, started)
        )
        return item_report(self.config, self.clock, interrupted, payload_bytes=self.payload_bytes)

    def stop(self) -> None:
        self._stopping = True
        self.ring.invalidate()

    def produce(self) -> None:
        ring, clock, size = self.ring, self.clock, self.config.item_bytes()
        index = 0
        while not self._stopping and not clock.spent(self.config.budget, index):
            clock.started()
            slot = ring.writeLock()
            if not ring.isValid():
                return
            slot.data, slot.data_size, slot.dummy = self.source, size, False
            ring.writeComplete()
            index += 1
        clock.close(index)
        self._send_end()

    def _send_end(self) -> None:
        slot = self.ring.writeLock()
        if self.ring.isValid():
            slot.data, slot.data_size, slot.dummy = None, 0, True
            self.ring.writeComplete()

    def consume(self) -> None:
        ring, clock = self.ring, self.clock
        while True:
            slot = ring.readLock()
            if not ring.isValid() or slot.dummy:
                return
            clock.completed()
            if clock.done_count() > clock.warmup and slot.data is not None:
                self.payload_bytes += slot.data.nbytes
            ring.readComplete()

    def _tick(self, progress: ProgressCallback | None, started_ns: int) -> None:
        if progress is not None:
            progress(self.clock.progress(started_ns))
