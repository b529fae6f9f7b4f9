"""Where a queue's samples lie in its tensor, and how user data is checked against it."""

from __future__ import annotations

import math

import numpy as np

from ipuserve.errors import TensorError
from ipuserve.runtime.popef.types import TensorInfo
from ipuserve.runtime.queues.items import Array


class Layout:
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
