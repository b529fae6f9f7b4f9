"""``InputQueue``: packs enqueued samples into the compiled batch, splitting items
across runs (zero-copy when one item covers the batch)."""

from __future__ import annotations

import time

from ipuserve.errors import ClosedError
from ipuserve.runtime.queues.base import BaseQueue, StreamCallback
from ipuserve.runtime.queues.items import (
    Array,
    InputData,
    ReadCompleteCallback,
    ReadStartCallback,
)


class InputQueue(BaseQueue[InputData]):
    """Packs enqueued samples into the compiled batch, splitting items across runs.

    ``InputQueue(buffer: InputRingBuffer, info, *, name, batch_dim=0)``.
    """

    # -- producer --------------------------------------------------------------------
    def enqueue(
        self,
        input: object,
        data_size: int | None = None,
        read_start_callback: ReadStartCallback | None = None,
        read_complete_callback: ReadCompleteCallback | None = None,
        *,
        tag: object = None,
    ) -> None:
        """Queue ``input`` (by reference) for the device; blocks while the ring is full.

        ``input`` is a numpy array of the tensor's dtype whose dims other than the
        batch dim match the tensor, or flat data / a buffer holding whole samples.
        ``data_size`` (bytes) uses only the first samples. TensorError if it does not
        fit; ClosedError if the queue is disconnected.
        """
        data, size = self._checked(input, data_size)
        self._put(
            data,
            size // self._layout.sample_bytes,
            tag,
            read_start_callback,
            read_complete_callback,
        )

    def enqueueTrusted(
        self,
        data: Array,
        samples: int,
        read_start_callback: ReadStartCallback | None = None,
        read_complete_callback: ReadCompleteCallback | None = None,
        *,
        tag: object = None,
    ) -> None:
        """enqueue() without re-checking ``data`` (ipuserve extension, the ModelRunner's
        hot path): the caller guarantees an array in the tensor's layout holding
        ``samples`` samples, as its own validation already established."""
        self._put(data, samples, tag, read_start_callback, read_complete_callback)

    def _put(
        self,
        data: Array | None,
        samples: int,
        tag: object,
        read_start: ReadStartCallback | None,
        read_complete: ReadCompleteCallback | None,
    ) -> None:
        now = time.monotonic()
        size = samples * self._layout.sample_bytes

        def fill(slot: InputData) -> None:
            slot.data, slot.data_size, slot.tag, slot.enqueue_time = data, size, tag, now
            slot.dummy = slot.cancelled = False
            slot.readStartCallback, slot.readCompleteCallback = read_start, read_complete
            self._enqueued += samples  # before the device can see the item

        if not self._ring.writeWith(fill):
            raise ClosedError(f"queue {self._name!r} is disconnected")

    def flush(self, padding: object = None) -> int:
        """Pad the batch being assembled with a dummy item; returns the samples added.

        An item held from enqueueLock() is completed first (and padded after, if it
        ends inside a batch). ``padding`` (ipuserve extension) gives the padding's
        values, exactly paddingSamples() samples; default zeros. A no-op (0) once
        disconnected.
        """
        if self._ring.isValid() and self._flush_locked():
            return 0
        count = self.paddingSamples()
        data = None
        if padding is not None:
            data = self._layout.to_samples(padding, None, writable=False)
            if data.shape[self._layout.batch_dim] != count:
                raise self._layout.error(
                    f"expected {count} padding samples, given {data.shape[self._layout.batch_dim]}"
                )
        slot = self._lock_slot()
        if slot is None:
            return 0
        slot.data, slot.data_size, slot.dummy = data, count * self._layout.sample_bytes, True
        self._publish(slot)
        return count

    def readerWaits(self) -> int:
        """How many times the device found this queue empty and waited (ipuserve
        extension: the simulated device's clock asks whether its inputs were late)."""
        return self._ring.readWaits()

    def interrupt(self) -> None:
        """Make the device's wait for this input return without an item (ipuserve
        extension): its callback returns None having read nothing, for a caller that
        hands the run its data another way. Only between batches (nothing filled)."""
        self._ring.interrupt()

    # -- consumer (device thread) ----------------------------------------------------
    def device_callback(self) -> StreamCallback:
        """The stream callback for this input anchor (docs/architecture.md §1.1).

        Fills the device's buffer from consecutive items, or returns one item's own
        memory when it alone covers the batch (batch_dim 0, C-contiguous). Blocks
        while items are missing; once the queue is disconnected it fills zeros.
        """
        return self._fill_batch

    def _fill_batch(self, buffer: Array) -> Array | None:
        self._run_tags.clear()
        rows = self._layout.rows(buffer.reshape(self._layout.shape))
        filled = 0
        while filled < self._layout.batch:
            item = self._next_item(filled) if self._ring.isValid() else None
            if item is None:
                if self._ring.isValid():  # interrupted: the caller has the run's data
                    return None
                rows[filled:] = 0  # disconnected: zeros, so the running program finishes
                return None
            if filled == 0 and (whole := self._whole_batch(item)) is not None:
                return whole.reshape(buffer.shape)
            filled += self._copy_chunk(item, rows, filled)
        return None

    def _whole_batch(self, item: InputData) -> Array | None:
        """Zero-copy: the batch as a view of the item's memory, if the item covers it."""
        data, batch = item.data, self._layout.batch
        offset, count = self._chunk(item, batch)
        if (
            count < batch
            or data is None
            or item.cancelled
            or self._layout.batch_dim != 0
            or not data.flags.c_contiguous
        ):
            return None
        self._start(item)
        self._take(item, batch)
        return data[offset : offset + batch]

    def _copy_chunk(self, item: InputData, rows: Array, filled: int) -> int:
        offset, count = self._chunk(item, self._layout.batch - filled)
        cancelled = item.cancelled  # read once: cancel() may set it meanwhile
        if not cancelled:
            self._start(item)
        if item.data is None or cancelled:
            rows[filled : filled + count] = 0
        else:
            rows[filled : filled + count] = self._layout.rows(item.data)[offset : offset + count]
        self._take(item, count)
        return count

    def _start(self, item: InputData) -> None:
        if self._head_offset == 0 and item.readStartCallback is not None:
            item.readStartCallback()

    def _take(self, item: InputData, count: int) -> None:
        if not self._consume(item, count):
            return
        try:
            if item.readCompleteCallback is not None and not item.cancelled:
                item.readCompleteCallback()
        finally:
            self._release_head()
