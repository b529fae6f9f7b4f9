"""``OutputQueue``: splits each run's output across the waiting items, in order."""

from __future__ import annotations

import time

import numpy as np

from ipuserve.errors import ClosedError
from ipuserve.runtime.queues.base import BaseQueue, StreamCallback
from ipuserve.runtime.queues.items import Array, OutputData, WriteCompleteCallback


class OutputQueue(BaseQueue[OutputData]):
    """Splits each run's output across the waiting items, in order.

    ``OutputQueue(buffer: OutputRingBuffer, info, *, name, batch_dim=0)``.
    """

    _writable = True

    def _clear_state(self) -> None:
        super()._clear_state()
        self._assembly: Array | None = None  # consumer: queue memory for a spanning item

    # -- producer --------------------------------------------------------------------
    def enqueue(
        self,
        output: object,
        data_size: int | None = None,
        write_complete_callback: WriteCompleteCallback | None = None,
        *,
        tag: object = None,
    ) -> None:
        """Queue a place for the next samples of output; blocks while the ring is full.

        ``output`` is a writable array (or buffer) checked like an input, or None
        with ``data_size`` bytes: the queue then provides the memory -- a read-only
        view of the device's output when the item lies within one run, a fresh
        array otherwise. ``write_complete_callback(filled)`` receives it.
        """
        data, size = self._checked(output, data_size)
        self._put(data, size // self._layout.sample_bytes, tag, write_complete_callback)

    def enqueueTrusted(
        self,
        data: Array | None,
        samples: int,
        write_complete_callback: WriteCompleteCallback | None = None,
        *,
        tag: object = None,
    ) -> None:
        """enqueue() without re-checking ``data`` (ipuserve extension, the ModelRunner's
        hot path); ``data=None`` lets the queue provide the memory."""
        self._put(data, samples, tag, write_complete_callback)

    def _put(
        self,
        data: Array | None,
        samples: int,
        tag: object,
        write_complete: WriteCompleteCallback | None,
    ) -> None:
        now = time.monotonic()
        size = samples * self._layout.sample_bytes

        def fill(slot: OutputData) -> None:
            slot.data, slot.data_size, slot.tag, slot.enqueue_time = data, size, tag, now
            slot.dummy = slot.cancelled = False
            slot.writeCompleteCallback = write_complete
            self._enqueued += samples  # before the device can see the item

        if not self._ring.writeWith(fill):
            raise ClosedError(f"queue {self._name!r} is disconnected")

    def flush(self) -> None:
        """Enqueue a dummy handler: it discards the rest of the current batch.

        At a batch boundary that is the whole next batch, matching the whole dummy
        batch InputQueue.flush() enqueues there. An item held from enqueueLock() is
        completed first, and needs no handler after it if it ends a batch. A no-op
        once disconnected.
        """
        if self._ring.isValid() and self._flush_locked():
            return
        count = self.paddingSamples()
        slot = self._lock_slot()
        if slot is None:
            return
        # data_size only keeps the sample counts in step: the handler always
        # discards the rest of whatever batch the device is in when it reaches it.
        slot.dummy, slot.data_size = True, count * self._layout.sample_bytes
        self._publish(slot)

    # -- consumer (device thread) ----------------------------------------------------
    def device_callback(self) -> StreamCallback:
        """The stream callback for this output anchor (docs/architecture.md §1.1).

        Hands each waiting item its samples of the run's output; blocks while no item
        waits; once the queue is disconnected it discards the output.
        """
        return self._split_batch

    def _split_batch(self, result: Array) -> None:
        self._run_tags.clear()
        rows = self._layout.rows(result.reshape(self._layout.shape))
        done = 0
        while done < self._layout.batch:
            item = self._next_item(done) if self._ring.isValid() else None
            if item is None:
                return  # disconnected: discard
            if item.dummy:  # flush padding: the rest of the batch is nobody's
                self._consumed += self._layout.batch - done
                self._release_head()
                return
            done += self._deliver(item, rows, done)

    def _deliver(self, item: OutputData, rows: Array, done: int) -> int:
        offset, count = self._chunk(item, self._layout.batch - done)
        if not item.cancelled:
            self._store(item, rows[done : done + count], offset)
        if self._consume(item, count):
            self._complete(item)
        return count

    def _store(self, item: OutputData, chunk: Array, offset: int) -> None:
        """Put ``chunk`` (batch-first) at sample ``offset`` of the item's memory."""
        count = chunk.shape[0]
        if item.data is not None:
            self._layout.rows(item.data)[offset : offset + count] = chunk
            return
        total = item.data_size // self._layout.sample_bytes
        if count == total:
            self._assembly = self._layout.unrows(chunk)  # within one run: a view
            return
        if offset == 0:
            self._assembly = np.empty(self._layout.shape_for(total), self._layout.dtype)
        assert self._assembly is not None
        self._layout.rows(self._assembly)[offset : offset + count] = chunk

    def _complete(self, item: OutputData) -> None:
        filled = item.data if item.data is not None else self._assembly
        self._assembly = None
        try:
            if item.writeCompleteCallback is not None and not item.cancelled:
                assert filled is not None
                item.writeCompleteCallback(filled)
        finally:
            self._release_head()
