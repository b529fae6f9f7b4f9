"""The queues benchmark (spec chapter 7.2): how fast data moves through the queues.

Two threads, as in a served model. The *producer* enqueues each item (a tensor of
``request_size`` samples, by reference) into an :class:`InputQueue` and a place
for its result into the paired :class:`OutputQueue`. The *device* stand-in drives
the queues' device callbacks exactly as a running program does: the input
callback packs items into the compiled batch (or hands over an item's own memory
when one item is the whole batch), the output callback splits the batch back
into the waiting items. The device computes nothing -- the batch it read is the
batch it returns -- so what is measured is the queues themselves.

A run ends after the budget: the producer pads the last partial batch with
``flush()`` on both queues, the device drains everything, and then both queues
are disconnected. Latency is per item, from the start of its input enqueue
(waiting for a free slot included) to its output's write-complete callback.
``mode="ring"`` measures a bare :class:`SpscRingBuffer` instead
(:mod:`~ipuserve.runtime.tools.ring_bench`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ipuserve.errors import ClosedError
from ipuserve.progress import ProgressCallback
from ipuserve.runtime.memory import RingMemoryPool
from ipuserve.runtime.queues import InputData, InputQueue, OutputData, OutputQueue
from ipuserve.runtime.ring_buffer import SpscRingBuffer
from ipuserve.runtime.tools.item_clock import ItemClock, item_report
from ipuserve.runtime.tools.queues_config import QueuesBenchConfig
from ipuserve.runtime.tools.ring_bench import run_ring_benchmark
from ipuserve.runtime.tools.stats import now_ns
from ipuserve.runtime.tools.workers import Worker, supervise

Array = np.ndarray[Any, Any]


def run_queues_benchmark(
    config: QueuesBenchConfig, progress: ProgressCallback | None = None
) -> dict[str, Any]:
    """Run the benchmark ``config`` describes; returns the JSON-ready report.

    Ctrl-C (KeyboardInterrupt on the calling thread) stops it early: the report
    then covers what completed and says ``"interrupted": true``.
    """
    if config.mode == "ring":
        return run_ring_benchmark(config, progress)
    return QueuePair(config).run(progress)


class QueuePair:
    """One InputQueue/OutputQueue pair, its producer and its device stand-in."""

    def __init__(self, config: QueuesBenchConfig) -> None:
        self.config = config
        info = config.tensor_info()
        self.in_ring = SpscRingBuffer(config.slots(), "bench-in", factory=InputData)
        self.out_ring = SpscRingBuffer(config.slots(), "bench-out", factory=OutputData)
        self.inputs = InputQueue(self.in_ring, info, name="bench")
        self.outputs = OutputQueue(self.out_ring, info, name="bench")
        self.clock = ItemClock(config.budget.warmup)
        self.source = config.source_tensor()
        self.destinations = _output_views(config)
        self.device_runs = 0
        self.padding_samples = 0
        self._stopping = False

    # -- the run ---------------------------------------------------------------------
    def run(self, progress: ProgressCallback | None = None) -> dict[str, Any]:
        started = now_ns()
        workers = [
            Worker("bench-producer", self.produce, self.clock.finished.set),
            Worker("bench-device", self.device, self.clock.finished.set),
        ]
        interrupted = supervise(
            workers, self.clock.finished, self.stop, lambda: self._tick(progress, started)
        )
        return self.report(interrupted)

    def stop(self) -> None:
        """Wake and end both threads: disconnected queues never block."""
        self._stopping = True
        self.inputs.disconnect()
        self.outputs.disconnect()

    # -- producer thread ---------------------------------------------------------------
    def produce(self) -> None:
        clock, views, written = self.clock, self.destinations, self.clock_completed
        index = 0
        try:
            while not self._stopping and not clock.spent(self.config.budget, index):
                clock.started()
                self.inputs.enqueue(self.source)
                self.outputs.enqueue(views[index % len(views)], None, written)
                index += 1
        except ClosedError:  # stop() disconnected the queues under us
            return
        if not self._stopping and index * self.config.request_size % self.config.batch:
            self.padding_samples = self.inputs.flush()
            self.outputs.flush()
        clock.close(index)

    def clock_completed(self, _filled: Array) -> None:
        """Write-complete callback of every output item (device thread)."""
        self.clock.completed()

    # -- device thread -----------------------------------------------------------------
    def device(self) -> None:
        """Run "programs" until stopped: read a batch from the inputs, return it as output."""
        buffer = np.empty(self.config.tensor_info().shape(), self.config.numpy_dtype())
        read, write = self.inputs.device_callback(), self.outputs.device_callback()
        while True:
            given = read(buffer)
            if not self.in_ring.isValid():
                return  # disconnected: the batch is zeros, not data
            self.device_runs += 1
            write(buffer if given is None else given)

    # -- reporting -----------------------------------------------------------------------
    def _tick(self, progress: ProgressCallback | None, started_ns: int) -> None:
        if progress is not None:
            progress(self.clock.progress(started_ns))

    def report(self, interrupted: bool) -> dict[str, Any]:
        return item_report(
            self.config,
            self.clock,
            interrupted,
            device_runs=self.device_runs,
            padding_samples=self.padding_samples,
        )


def _output_views(config: QueuesBenchConfig) -> list[Array]:
    """User memory for the outputs: one item-shaped view per ring slot, plus one.

    Carved from one :class:`RingMemoryPool`. A view comes round
    again only after ``slots + 1`` further items, and the ring holds at most
    ``slots``, so the item that last used it has completed.
    """
    pool = RingMemoryPool(config.item_bytes(), config.slots() + 1)
    dtype, shape = config.numpy_dtype(), config.item_shape()
    return [pool.getMemoryBlob().view(dtype).reshape(shape) for _ in range(pool.numBlobs())]
