"""What the queues benchmark runs: tensor geometry, ring size, budget (spec chapter 7.2).

The tensor behind the queues is ``[batch, *sample_shape]`` of ``dtype`` -- the
compiled batch a device run consumes. A producer enqueues items of
``request_size`` samples; the queues pack them into batches and split the
batches back, exactly as for a model anchor. ``ring_size`` is the number of slots
of each ring; by default ``2 * batch``, what a QueueManager gives with its
default ring size multiplier.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ipuserve.errors import ConfigError
from ipuserve.runtime.popef.types import DataType, TensorInfo
from ipuserve.runtime.tools.stats import Budget

MODES = ("queues", "ring")


@dataclass(frozen=True, kw_only=True)
class QueuesBenchConfig:
    mode: str = "queues"
    sample_shape: tuple[int, ...] = (1024,)
    dtype: str = "float32"
    batch: int = 16
    request_size: int = 1
    ring_size: int | None = None
    budget: Budget = field(default_factory=lambda: Budget(warmup=100, duration_s=2.0))

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if any(d < 1 for d in self.sample_shape):
            raise ConfigError(f"sample dimensions must be >= 1, got {list(self.sample_shape)}")
        try:
            DataType.from_numpy(self.dtype)
        except (TypeError, ValueError) as error:
            raise ConfigError(str(error)) from None
        if self.batch < 1 or self.request_size < 1:
            raise ConfigError("the batch and the request size must be >= 1 samples")
        if self.slots() < self.min_slots():
            raise ConfigError(
                f"a ring of {self.slots()} slots is too small: a batch of {self.batch} samples "
                f"fed {self.request_size} at a time touches up to {self.min_slots() - 1} items, "
                f"and the producer must be able to queue them all plus one; use a ring "
                f"of >= {self.min_slots()} slots"
            )

    def slots(self) -> int:
        """Slots per ring (the default is a QueueManager's: 2 x the compiled batch)."""
        return self.ring_size if self.ring_size is not None else 2 * self.batch

    def min_slots(self) -> int:
        """Smallest ring that cannot deadlock (queues mode).

        The device needs every item of a batch before it splits the batch's output,
        while the producer enqueues each item's output before its next input: when
        the device waits for an input, the outputs queued are those of the items of
        the current batch but the missing one -- at most ceil(batch/request) of them.
        """
        if self.mode == "ring":
            return 1
        return math.ceil(self.batch / self.request_size) + 1

    def numpy_dtype(self) -> np.dtype[Any]:
        return np.dtype(self.dtype)

    def tensor_info(self) -> TensorInfo:
        """The compiled tensor: ``[batch, *sample_shape]``."""
        return TensorInfo(self.dtype, (self.batch, *self.sample_shape))

    def item_shape(self) -> tuple[int, ...]:
        return (self.request_size, *self.sample_shape)

    def sample_bytes(self) -> int:
        return math.prod(self.sample_shape) * self.numpy_dtype().itemsize

    def item_bytes(self) -> int:
        return self.request_size * self.sample_bytes()

    def source_tensor(self) -> np.ndarray[Any, Any]:
        """What the producer enqueues, by reference, every time: one item of fixed
        pseudo-random contents (never zeros, which a copy could shortcut)."""
        rng, dtype, shape = np.random.default_rng(0), self.numpy_dtype(), self.item_shape()
        if dtype.kind == "f":
            return rng.standard_normal(shape).astype(dtype)
        return rng.integers(0, 2 if dtype.kind == "b" else 100, shape).astype(dtype)

    def describe(self) -> dict[str, Any]:
        """The configuration as it goes into the JSON report."""
        return {
            "mode": self.mode,
            "sample_shape": list(self.sample_shape),
            "dtype": self.dtype,
            "batch": self.batch,
            "request_size": self.request_size,
            "ring_size": self.slots(),
            "warmup_items": self.budget.warmup,
            "items": self.budget.count,
            "duration_s": self.budget.duration_s,
        }
