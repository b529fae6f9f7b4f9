"""What both queues share: the interface, geometry, the producer's lock and publish,
and the consumer's head item (threads: see :mod:`ipuserve.runtime.queues`)."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Generic, TypeAlias, TypeVar

from ipuserve.errors import ClosedError, RuntimeUsageError
from ipuserve.runtime.popef.types import TensorInfo
from ipuserve.runtime.queues.items import Array, Item
from ipuserve.runtime.queues.layout import Layout
from ipuserve.runtime.ring_buffer import SpscRingBuffer

#: Stream callback (docs/architecture.md §1.1): input side returns None or a
#: replacement array of the anchor's shape; the output side's return is ignored.
StreamCallback: TypeAlias = Callable[[Array], "Array | None"]
#: ``policy(queue, samples_already_in_batch, first_sample_enqueue_time_or_None)``
#: -> the timeout in ns for the next read wait (0 = forever; use >= 1 for "now").
ReadTimeoutPolicy: TypeAlias = Callable[["IQueue", int, "float | None"], int]


class IQueue(ABC):
    """Common interface implemented by the queues."""

    @abstractmethod
    def tensorInfo(self) -> TensorInfo:
        """Shape and data type of the tensor behind the queue (the compiled batch)."""

    @abstractmethod
    def numBuffers(self) -> int:
        """How many items the queue's ring can hold."""

    @abstractmethod
    def disconnect(self) -> None:
        """Stop waiting for data: feed zeros / discard outputs until reset."""


SlotT = TypeVar("SlotT", bound=Item)


class BaseQueue(IQueue, Generic[SlotT]):
    """What both queues share: geometry, the producer's lock/publish, the consumer's head item."""

    _writable = False  # whether user memory must be writable (outputs)

    def __init__(
        self, buffer: SpscRingBuffer[SlotT], info: TensorInfo, *, name: str, batch_dim: int = 0
    ) -> None:
        self._ring = buffer
        self._info = info
        self._name = name
        self._layout = Layout(name, info, batch_dim)
        self._policy: ReadTimeoutPolicy | None = None
        self._run_tags: list[object] = []
        self._clear_state()

    def _clear_state(self) -> None:
        self._write_slot: SlotT | None = None  # producer: the enqueueLock()ed item
        self._enqueued = 0  # producer: samples published so far
        self._consumed = 0  # consumer: samples taken so far
        self._head: SlotT | None = None  # consumer: item being consumed (read-locked)
        self._head_offset = 0  # consumer: its samples already taken
        self._batch_started: float | None = None
        self._run_tags.clear()

    # -- IQueue and spec methods -----------------------------------------------------
    def tensorInfo(self) -> TensorInfo:
        return self._info

    def numBuffers(self) -> int:
        return self._ring.numBuffers()

    def disconnect(self) -> None:
        """Invalidate the ring: blocked calls return, the device gets zeros / discards."""
        self._ring.invalidate()

    def reset(self) -> None:
        """Empty the queue and make it usable again; only while no run is in progress."""
        self._ring.reset()
        self._clear_state()

    def enqueueLock(self) -> SlotT:
        """The item to fill (blocks while the ring is full); the same one until completed.

        Raises ClosedError if the queue is disconnected.
        """
        slot = self._lock_slot()
        if slot is None:
            raise ClosedError(f"queue {self._name!r} is disconnected")
        return slot

    def enqueueComplete(self) -> None:
        """Check the item filled after enqueueLock() and hand it to the device."""
        slot = self._write_slot
        if slot is None:
            raise RuntimeUsageError(
                f"queue {self._name!r}: enqueueComplete() without enqueueLock()"
            )
        if not (slot.dummy and slot.data is None):
            slot.data, slot.data_size = self._checked(slot.data, slot.data_size or None)
        self._publish(slot)

    def _flush_locked(self) -> bool:
        """flush()'s first part (spec: "flush any partial input [output] still being
        created"): complete an item the producer holds from enqueueLock(), as
        enqueueComplete() would, instead of overwriting it with padding. True if the
        queue then stands at a batch boundary, where no padding is needed."""
        if self._write_slot is None:
            return False
        self.enqueueComplete()
        return not self.holdsPartialBatch()

    # -- ipuserve extensions ---------------------------------------------------------
    def name(self) -> str:
        return self._name

    def batchSize(self) -> int:
        """Samples per run: the tensor's extent along the batch dimension."""
        return self._layout.batch

    def sampleBytes(self) -> int:
        return self._layout.sample_bytes

    def paddingSamples(self) -> int:
        """Samples a flush() now covers: up to the batch boundary, or a whole batch.

        Inputs: the zero padding flush() adds. Outputs: the samples its dummy
        handler will discard, if the queues are in step.
        """
        return self._layout.batch - self._enqueued % self._layout.batch

    def hasRoom(self) -> bool:
        """True if enqueueing one item now would not block."""
        return self._ring.writeAvailable()

    def holdsPartialBatch(self) -> bool:
        """Enqueued samples end inside a batch: it cannot fill up without padding."""
        return self._enqueued % self._layout.batch != 0

    def pendingSamples(self) -> int:
        """Samples enqueued and not yet consumed by the device (padding included)."""
        return self._enqueued - self._consumed

    def setReadTimeoutPolicy(self, policy: ReadTimeoutPolicy | None) -> None:
        """Choose the timeout of each read wait (None: the ring's own timeout)."""
        self._policy = policy

    def cancel(self, tag: object) -> int:
        """Mark every not yet consumed item tagged ``tag`` cancelled; returns how many."""
        if tag is None:
            raise RuntimeUsageError(f"queue {self._name!r}: cancel() needs a tag")
        marked = 0

        def mark(item: SlotT) -> None:
            nonlocal marked
            if item.tag == tag:
                item.cancelled = True
                marked += 1

        self._ring.forEachPending(mark)
        return marked

    def lastRunTags(self) -> tuple[object, ...]:
        """Tags of the items that fed the latest run, in order (read on the device thread)."""
        return tuple(self._run_tags)

    # -- producer internals ----------------------------------------------------------
    def _checked(self, data: object, data_size: int | None) -> tuple[Array | None, int]:
        """User data as (array in layout or None, byte count); TensorError if it does not fit."""
        if data is None:
            if data_size is None:
                raise self._layout.error("expected data_size in bytes when no memory is given")
            return None, self._layout.whole_samples(data_size) * self._layout.sample_bytes
        array = self._layout.to_samples(data, data_size, writable=self._writable)
        return array, array.shape[self._layout.batch_dim] * self._layout.sample_bytes

    def _lock_slot(self) -> SlotT | None:
        """Write-lock an item, cleared unless it was already locked; None if disconnected."""
        slot = self._ring.writeLock()
        if not self._ring.isValid():
            return None
        if self._write_slot is not slot:
            slot.clear()
            self._write_slot = slot
        return slot

    def _publish(self, slot: SlotT) -> None:
        slot.enqueue_time = time.monotonic()
        # Counted before the device can see the item, so pendingSamples() >= 0.
        self._enqueued += slot.data_size // self._layout.sample_bytes
        self._write_slot = None
        self._ring.writeComplete()

    # -- consumer internals ----------------------------------------------------------
    def _next_item(self, filled: int) -> SlotT | None:
        """The item the batch's next samples belong to; None once the ring is invalid."""
        if self._head is None:
            item = self._ring.readLock(self._read_timeout(filled))
            if not self._ring.isValid() or self._ring.takeInterrupt():
                return None
            self._head, self._head_offset = item, 0
        if filled == 0:
            self._batch_started = self._head.enqueue_time
        return self._head

    def _read_timeout(self, filled: int) -> int | None:
        if self._policy is None:
            return None
        return self._policy(self, filled, self._batch_started if filled else None)

    def _chunk(self, item: SlotT, room: int) -> tuple[int, int]:
        """(offset, count) of the head item's samples that go into ``room`` samples."""
        left = item.data_size // self._layout.sample_bytes - self._head_offset
        return self._head_offset, min(left, room)

    def _consume(self, item: SlotT, count: int) -> bool:
        """Count ``count`` samples of the head as taken; True if that was its last."""
        self._head_offset += count
        self._consumed += count
        if item.tag is not None:
            self._run_tags.append(item.tag)
        return self._head_offset * self._layout.sample_bytes == item.data_size

    def _release_head(self) -> None:
        item = self._head
        assert item is not None
        self._head, self._head_offset = None, 0
        item.clear()  # drop user memory now, not when the producer reuses the item
        self._ring.readComplete()
