"""Tensor memory as the Python API sees it: views, descriptions and result arrays.

In C++ an ``InputMemoryView`` maps names to ``ConstTensorMemoryView`` (pointer +
size); in Python it maps names to numpy arrays, held by reference. Results
allocated by the library come back as :class:`TensorResult` -- an ``ndarray``
subclass, so ``np.frombuffer(result[name], ...)`` works as in the spec's
listings, with the listings' memory semantics:

* library-allocated: ``np.array(r, copy=False)`` is a view of the library's
  buffer, while ``r.numpy()`` and ``np.array(r, copy=True)`` are copies;
* user-allocated: ``r.numpy()`` and ``np.array(r, copy=False)`` are views of the
  user's own array (``np.shares_memory`` with it is True).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ipuserve.runtime.popef.types import Anchor, DataType


class InputMemoryView(dict[str, Any]):
    """Tensor name -> input data (numpy array or buffer), held by reference."""


class OutputMemoryView(dict[str, Any]):
    """Tensor name -> user-allocated output array the result is written into."""


class OutputMemory(dict[str, np.ndarray]):
    """Tensor name -> output allocated by the library (``execute`` without outputs)."""


ReplicaIdToOutputMemoryView = dict[int, OutputMemoryView]


class TensorResult(np.ndarray):
    """An output tensor handed back by a future; ``numpy()`` follows the spec's semantics."""

    _user_allocated: bool

    @classmethod
    def wrap(cls, array: np.ndarray, *, user_allocated: bool) -> TensorResult:
        view = array.view(cls)
        view._user_allocated = user_allocated
        return view

    def __array_finalize__(self, obj: Any) -> None:
        self._user_allocated = getattr(obj, "_user_allocated", False)

    def numpy(self) -> np.ndarray:
        """User-allocated: a view of the user's array. Library-allocated: a copy."""
        plain = self.view(np.ndarray)
        return plain if self._user_allocated else plain.copy()


@dataclass(frozen=True)
class DataDesc:
    """Description of an input or output tensor (spec's ``DataDesc``)."""

    name: str
    size_in_bytes: int
    shape: list[int]
    data_type: DataType
    popef_contains_tensor_data: bool = False
    batch_dim: int | None = field(default=None, compare=False)

    def numpy_data_type(self) -> np.dtype[Any]:
        return self.data_type.numpy

    @classmethod
    def of(cls, anchor: Anchor, contains_data: bool) -> DataDesc:
        info = anchor.tensorInfo()
        return cls(anchor.name(), info.sizeInBytes(), info.shape(), info.dataType(), contains_data)

    def __repr__(self) -> str:
        return (
            f"DataDesc(name={self.name!r}, shape={self.shape}, dtype={self.data_type.value}, "
            f"size_in_bytes={self.size_in_bytes}, "
            f"popef_contains_tensor_data={self.popef_contains_tensor_data})"
        )


InputDesc = DataDesc
OutputDesc = DataDesc
