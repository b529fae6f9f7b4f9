"""``InputQueue`` / ``OutputQueue``: pack user tensors into the compiled batch and back.

Each queue owns an :class:`~ipuserve.runtime.ring_buffer.SpscRingBuffer` of reusable
:class:`InputData` / :class:`OutputData` items. Items hold *references* to user
memory, never copies: an input must stay unchanged until it has been consumed, an
output buffer must stay alive until its write-complete callback has run.

Geometry. The batch dimension is ``batch_dim`` (0 unless the queue was built for
``ModelRunnerConfig.batching_dim``); the compiled batch is ``shape[batch_dim]`` (1
for a scalar) and one *sample* is one index along it. Items carry any whole number
of samples; an item's ``data`` is kept in the anchor's layout with its own sample
count in place of the batch.

Threads (docs/architecture.md §1.1-1.3):

* producer -- enqueue*/flush/reset, from one thread at a time (the ModelRunner
  holds the replica's lock so that every queue of a request advances together);
* consumer -- the stream callback from :meth:`device_callback`, on the device thread;
* any thread -- cancel, pendingSamples, disconnect.

Cancellation keeps positions: a cancelled item still occupies its samples (inputs
become zeros, outputs are discarded) and only its callbacks and user memory are
skipped. Dropping its samples instead would shift every later item against the
batch boundaries that flush() and the output side have already counted on.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Generic, TypeAlias, TypeVar

import numpy as np
from numpy.typing import NDArray

from ipuserve.errors import ClosedError, RuntimeUsageError, TensorError
from ipuserve.runtime.popef.types import TensorInfo
from ipuserve.runtime.ring_buffer import InputRingBuffer, OutputRingBuffer, SpscRingBuffer

__all__ = [
    "IQueue",
    "InputData",
    "InputQueue",
    "InputRingBuffer",
    "OutputData",
    "OutputQueue",
    "OutputRingBuffer",
    "ReadCompleteCallback",
    "ReadStartCallback",
    "ReadTimeoutPolicy",
    "StreamCallback",
    "WriteCompleteCallback",
]

Array: TypeAlias = NDArray[Any]

#: Called just before an input item's first samples are copied towards the device.
ReadStartCallback: TypeAlias = Callable[[], None]
#: Called once an input item's last samples have been handed to the device.
ReadCompleteCallback: TypeAlias = ReadStartCallback
#: Called with the filled output array (the user's memory, or the queue's).
WriteCompleteCallback: TypeAlias = Callable[[Array], None]
#: Stream callback (docs/architecture.md §1.1): input side returns None or a
#: replacement array of the anchor's shape; the output side's return is ignored.
StreamCallback: TypeAlias = Callable[[Array], "Array | None"]
#: ``policy(queue, samples_already_in_batch, first_sample_enqueue_time_or_None)``
#: -> the timeout in ns for the next read wait (0 = forever; use >= 1 for "now").
ReadTimeoutPolicy: TypeAlias = Callable[["IQueue", int, "float | None"], int]


class _Item:
    """Fields shared by input and output items; the ring reuses item objects."""

    __slots__ = ("cancelled", "data", "data_size", "dummy", "enqueue_time", "tag")
    data: Array | None
    data_size: int
    dummy: bool
    cancelled: bool
    tag: object
    enqueue_time: float

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Back to an empty item, dropping every reference to user memory."""
        self.data = None
        self.data_size = 0
        self.dummy = False
        self.cancelled = False
        self.tag = None
        self.enqueue_time = 0.0

    def __repr__(self) -> str:
        shape = None if self.data is None else list(self.data.shape)
        return (
            f"{type(self).__name__}(data={shape}, data_size={self.data_size}, "
            f"dummy={self.dummy}, cancelled={self.cancelled}, tag={self.tag!r})"
        )


class InputData(_Item):
    """An input queue item: ``data`` (None = zeros), its size and optional callbacks.

    ``dummy`` marks flush padding (its outputs are discarded); ``cancelled`` items
    are fed as zeros without touching ``data`` or calling back; ``enqueue_time`` is
    ``time.monotonic()`` at enqueue (batch timeouts count from it).
    """

    __slots__ = ("readCompleteCallback", "readStartCallback")
    readStartCallback: ReadStartCallback | None
    readCompleteCallback: ReadCompleteCallback | None

    def clear(self) -> None:
        super().clear()
        self.readStartCallback = None
        self.readCompleteCallback = None


class OutputData(_Item):
    """An output queue item: where to write (None = the queue provides memory).

    A ``dummy`` item is a flush handler: it discards the rest of the current batch.
    """

    __slots__ = ("writeCompleteCallback",)
    writeCompleteCallback: WriteCompleteCallback | None

    def clear(self) -> None:
        super().clear()
        self.writeCompleteCallback = None


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


class _Layout:
    """Where the samples lie in a queue's tensor, and how user data is checked against it."""

    def __init__(self, name: str, info: TensorInfo, batch_dim: int) -> None:
        self.name = name
        self.dtype = info.numpyDType()
        self.shape = tuple(info.shape()) or (1,)  # a scalar tensor is one sample
        if not 0 <= batch_dim < len(self.shape):
            raise self.error(
                f"expected batch_dim in [0, {len(self.shape)}), given {batch_dim} "
                f"for shape {info.shape()}"
            )
        self.batch_dim = batch_dim
        self.batch = self.shape[batch_dim]
        self.sample_bytes = math.prod(self.shape) // max(self.batch, 1) * self.dtype.itemsize
        if self.batch < 1 or self.sample_bytes == 0:
            raise self.error(
                f"cannot queue a tensor of shape {info.shape()}: "
                "no samples, or samples of zero bytes"
            )

    def error(self, what: str) -> TensorError:
        return TensorError(f"tensor {self.name!r}: {what}")

    def shape_for(self, samples: int) -> tuple[int, ...]:
        """The tensor's shape with ``samples`` in place of the batch."""
        bd = self.batch_dim
        return (*self.shape[:bd], samples, *self.shape[bd + 1 :])

    def rows(self, array: Array) -> Array:
        """A view with the batch dimension first, so samples are sliced as ``[a:b]``."""
        return array if self.batch_dim == 0 else np.moveaxis(array, self.batch_dim, 0)

    def unrows(self, rows: Array) -> Array:
        return rows if self.batch_dim == 0 else np.moveaxis(rows, 0, self.batch_dim)

    def whole_samples(self, nbytes: int) -> int:
        """``nbytes`` as a positive whole number of samples, or TensorError."""
        if nbytes <= 0 or nbytes % self.sample_bytes:
            raise self.error(
                f"expected a whole, non-zero number of samples "
                f"({self.sample_bytes} bytes each), given {nbytes} bytes"
            )
        return nbytes // self.sample_bytes

    def to_samples(self, obj: object, data_size: int | None, *, writable: bool) -> Array:
        """``obj`` as an array in the tensor's layout, cut to ``data_size`` bytes if given."""
        array = self._packed(self._as_array(obj, writable))
        have = array.shape[self.batch_dim]
        if have == 0:
            raise self.error(f"expected at least one sample, given shape {list(array.shape)}")
        want = have if data_size is None else self.whole_samples(data_size)
        if want > have:
            raise self.error(
                f"expected data_size <= {have * self.sample_bytes} bytes "
                f"(the {have} samples given), given {data_size} bytes"
            )
        return array if want == have else self.unrows(self.rows(array)[:want])

    def _as_array(self, obj: object, writable: bool) -> Array:
        if isinstance(obj, np.ndarray):
            if obj.dtype != self.dtype:
                raise self.error(f"expected dtype {self.dtype}, given {obj.dtype}")
            array: Array = obj
        else:
            array = self._view_buffer(obj)
        if writable and not array.flags.writeable:
            raise self.error("expected writable memory for outputs, given read-only memory")
        return array

    def _view_buffer(self, obj: object) -> Array:
        """A buffer-protocol object (bytes, bytearray, memoryview...) seen as the dtype."""
        try:
            view = memoryview(obj)  # type: ignore[arg-type]
        except TypeError:
            raise self.error(
                f"expected a numpy array of {self.dtype} or a buffer, given {type(obj).__name__}"
            ) from None
        if not view.c_contiguous:
            raise self.error("expected a contiguous buffer, given a strided one")
        self.whole_samples(view.nbytes)
        return np.frombuffer(view, dtype=self.dtype)

    def _packed(self, array: Array) -> Array:
        """``array`` in the tensor's layout: flat data is cut into whole samples."""
        if array.ndim == len(self.shape):
            if self.shape_for(array.shape[self.batch_dim]) != array.shape:
                raise self.error(f"expected shape {self.describe()}, given {list(array.shape)}")
            return array
        if array.ndim > 1:
            raise self.error(f"expected shape {self.describe()}, given {list(array.shape)}")
        self.whole_samples(array.nbytes)
        return array.reshape(self.shape_for(-1))

    def describe(self) -> str:
        dims = [str(d) for d in self.shape]
        dims[self.batch_dim] = "N"
        return f"[{', '.join(dims)}] (N samples along dim {self.batch_dim}) or flat"


SlotT = TypeVar("SlotT", bound=_Item)


class _Queue(IQueue, Generic[SlotT]):
    """What both queues share: geometry, the producer's lock/publish, the consumer's head item."""

    _writable = False  # whether user memory must be writable (outputs)

    def __init__(
        self, buffer: SpscRingBuffer[SlotT], info: TensorInfo, *, name: str, batch_dim: int = 0
    ) -> None:
        self._ring = buffer
        self._info = info
        self._name = name
        self._layout = _Layout(name, info, batch_dim)
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
            if not self._ring.isValid():
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


class InputQueue(_Queue[InputData]):
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


class OutputQueue(_Queue[OutputData]):
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
