"""Queue memory: ``IMemoryPool``, ``RingMemoryPool`` and ``allocateQueueStorage``.

Queues hold references to user memory, never copies, so the memory behind an
enqueued tensor must stay untouched until the queue has consumed it. A
:class:`RingMemoryPool` sized by :func:`allocateQueueStorage` gives a producer one
blob per ring slot (plus extras): cycling through the blobs, a blob comes round
again only after the ring has moved past the item that used it — provided the
producer never has more items in flight than the pool has blobs.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from ipuserve.errors import ConfigError

if TYPE_CHECKING:
    from ipuserve.runtime.queues import IQueue

__all__ = ["IMemoryPool", "RingMemoryPool", "allocateQueueStorage"]


class IMemoryPool(ABC):
    """A common interface for all memory allocators."""

    @abstractmethod
    def blobSize(self) -> int:
        """The size in bytes of one memory blob."""

    @abstractmethod
    def getMemoryBlob(self) -> NDArray[np.uint8]:
        """A writable blob of ``blobSize()`` bytes."""


class RingMemoryPool(IMemoryPool):
    """``num_blobs`` fixed-size blobs carved from one allocation, handed out in a cycle.

    Blobs are flat ``uint8`` arrays; view one as a tensor with
    ``blob.view(dtype).reshape(shape)``. getMemoryBlob() may be called from any
    thread (``next()`` on a cycle is atomic under the GIL), but the pool does not
    know which blobs are still in use: that is what sizing it to the queue is for.
    """

    def __init__(self, blob_size: int, num_blobs: int) -> None:
        if blob_size < 0 or num_blobs < 1:
            raise ConfigError(
                f"RingMemoryPool needs blob_size >= 0 and num_blobs >= 1, "
                f"got blob_size={blob_size}, num_blobs={num_blobs}"
            )
        self._blob_size = blob_size
        self._storage = np.zeros(blob_size * num_blobs, dtype=np.uint8)
        self._blobs = [self._storage[i * blob_size : (i + 1) * blob_size] for i in range(num_blobs)]
        self._next_blob = itertools.cycle(self._blobs)

    def numBlobs(self) -> int:
        return len(self._blobs)

    def blobSize(self) -> int:
        return self._blob_size

    def getMemoryBlob(self) -> NDArray[np.uint8]:
        """The next blob; after the last one the cycle starts again from the first."""
        return next(self._next_blob)

    def __repr__(self) -> str:
        return f"RingMemoryPool(blob_size={self._blob_size}, num_blobs={len(self._blobs)})"


def allocateQueueStorage(queue: IQueue, extra_buffers: int = 0) -> RingMemoryPool:
    """A pool with one whole-tensor blob per buffer of ``queue``, plus ``extra_buffers``."""
    if extra_buffers < 0:
        raise ConfigError(f"extra_buffers must be >= 0, got {extra_buffers}")
    return RingMemoryPool(queue.tensorInfo().sizeInBytes(), queue.numBuffers() + extra_buffers)
