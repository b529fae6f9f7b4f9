"""RingMemoryPool and allocateQueueStorage."""

from __future__ import annotations

import numpy as np
import pytest

from ipuserve.errors import ConfigError
from ipuserve.runtime.memory import IMemoryPool, RingMemoryPool, allocateQueueStorage
from ipuserve.runtime.popef.types import TensorInfo
from ipuserve.runtime.queues import InputData, InputQueue, OutputData, OutputQueue
from ipuserve.runtime.ring_buffer import SpscRingBuffer


def test_blobs_cycle_in_order_and_do_not_overlap() -> None:
    pool = RingMemoryPool(blob_size=16, num_blobs=3)
    blobs = [pool.getMemoryBlob() for _ in range(3)]
    for number, blob in enumerate(blobs):
        assert blob.dtype == np.uint8 and blob.shape == (16,) and blob.flags.writeable
        blob[:] = number + 1
    assert [int(b[0]) for b in blobs] == [1, 2, 3]  # writes did not overlap
    assert pool.getMemoryBlob() is blobs[0]  # the cycle starts again
    assert pool.getMemoryBlob() is blobs[1]
    assert pool.numBlobs() == 3 and pool.blobSize() == 16


def test_blobs_come_from_one_allocation() -> None:
    pool = RingMemoryPool(8, 4)
    first, second = pool.getMemoryBlob(), pool.getMemoryBlob()
    assert first.base is second.base and first.base is not None
    assert first.base.nbytes == 32


def test_blob_can_be_viewed_as_a_tensor() -> None:
    pool = RingMemoryPool(4 * 2 * 3, 2)
    tensor = pool.getMemoryBlob().view(np.float32).reshape(2, 3)
    tensor[:] = 1.5
    assert np.all(tensor == 1.5)


@pytest.mark.parametrize(("blob_size", "num_blobs"), [(-1, 2), (8, 0)])
def test_bad_pool_sizes_are_refused(blob_size: int, num_blobs: int) -> None:
    with pytest.raises(ConfigError, match="RingMemoryPool"):
        RingMemoryPool(blob_size, num_blobs)


def test_memory_pool_interface_is_abstract() -> None:
    with pytest.raises(TypeError):
        IMemoryPool()  # type: ignore[abstract]
    assert isinstance(RingMemoryPool(1, 1), IMemoryPool)


def test_allocate_queue_storage_gives_one_whole_tensor_per_buffer() -> None:
    ring = SpscRingBuffer(5, "x", factory=InputData)
    queue = InputQueue(ring, TensorInfo("float32", [4, 3]), name="x")
    pool = allocateQueueStorage(queue)
    assert pool.blobSize() == 4 * 3 * 4
    assert pool.numBlobs() == 5


def test_allocate_queue_storage_adds_extra_buffers() -> None:
    ring = SpscRingBuffer(2, "y", factory=OutputData)
    queue = OutputQueue(ring, TensorInfo("float16", [8]), name="y")
    pool = allocateQueueStorage(queue, extra_buffers=3)
    assert (pool.blobSize(), pool.numBlobs()) == (16, 5)
    with pytest.raises(ConfigError, match="extra_buffers"):
        allocateQueueStorage(queue, extra_buffers=-1)
