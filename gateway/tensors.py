"""The protocol's datatypes mapped to numpy both ways, and the tensor both doors build.

The Open Inference Protocol names datatypes (``FP32``, ``INT64``...); the fabric speaks
numpy dtypes, little-endian (:data:`ipuserve.protocol.DTYPES`). ``BYTES`` (strings) has no
numpy dtype the fabric carries and no ipuserve model takes it, so it is refused with its
own message rather than "unknown datatype".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ipuserve.errors import InvalidInputError
from ipuserve.protocol.tensors import DTYPES as WIRE_DTYPES

#: protocol datatype -> numpy dtype (little-endian, as the fabric's wire)
DATATYPES: dict[str, np.dtype[Any]] = {
    "BOOL": WIRE_DTYPES["bool"],
    "INT8": WIRE_DTYPES["int8"],
    "INT16": WIRE_DTYPES["int16"],
    "INT32": WIRE_DTYPES["int32"],
    "INT64": WIRE_DTYPES["int64"],
    "UINT8": WIRE_DTYPES["uint8"],
    "UINT16": WIRE_DTYPES["uint16"],
    "UINT32": WIRE_DTYPES["uint32"],
    "UINT64": WIRE_DTYPES["uint64"],
    "FP16": WIRE_DTYPES["float16"],
    "FP32": WIRE_DTYPES["float32"],
    "FP64": WIRE_DTYPES["float64"],
}

_BY_NAME: dict[str, str] = {dtype.name: datatype for datatype, dtype in DATATYPES.items()}


def to_dtype(datatype: str) -> np.dtype[Any]:
    """The numpy dtype of a protocol datatype; :class:`InvalidInputError` naming the
    supported ones otherwise."""
    dtype = DATATYPES.get(datatype)
    if dtype is not None:
        return dtype
    if datatype == "BYTES":
        raise InvalidInputError(
            "datatype BYTES is not supported: no ipuserve model takes strings "
            f"(datatypes: {', '.join(DATATYPES)})"
        )
    raise InvalidInputError(f"unknown datatype {datatype!r} (datatypes: {', '.join(DATATYPES)})")


def to_datatype(dtype: np.dtype[Any] | str) -> str:
    """The protocol datatype of a numpy dtype (or dtype name) the fabric carries."""
    name = np.dtype(dtype).name
    datatype = _BY_NAME.get(name)
    if datatype is None:
        raise InvalidInputError(f"dtype {name} has no Open Inference Protocol datatype")
    return datatype


@dataclass(frozen=True)
class Tensor:
    """A named tensor as a door received or will send it: ``array`` already has the
    datatype's dtype and ``shape`` (possibly a read-only view of received bytes)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    array: np.ndarray[Any, Any]

    @classmethod
    def of(cls, name: str, array: np.ndarray[Any, Any]) -> Tensor:
        """A tensor for ``array`` as it is (a fabric result)."""
        return cls(name, to_datatype(array.dtype), tuple(int(n) for n in array.shape), array)


def _check_shape(name: str, shape: object) -> tuple[int, ...]:
    if not isinstance(shape, list | tuple) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
    ):
        raise InvalidInputError(
            f"input {name!r}: shape must be a list of integers >= 0, got {shape!r}"
        )
    return tuple(shape)


def from_buffer(name: str, datatype: str, shape: object, buffer: memoryview | bytes) -> Tensor:
    """A tensor over ``buffer`` without a copy (read-only when the buffer is): the
    binary tensor data extension and gRPC's ``raw_input_contents``."""
    dtype = to_dtype(datatype)
    dims = _check_shape(name, shape)
    want = math.prod(dims) * dtype.itemsize
    if len(buffer) != want:
        raise InvalidInputError(
            f"input {name!r}: {datatype}{list(dims)} is {want} bytes, got {len(buffer)}"
        )
    array = np.frombuffer(buffer, dtype=dtype).reshape(dims)
    return Tensor(name, datatype, dims, array)


def from_list(name: str, datatype: str, shape: object, data: object) -> Tensor:
    """A tensor from JSON ``data``: flat or nested lists, row-major."""
    dtype = to_dtype(datatype)
    dims = _check_shape(name, shape)
    if not isinstance(data, list):
        raise InvalidInputError(f"input {name!r}: data must be a list, got {type(data).__name__}")
    try:
        array = np.asarray(data, dtype=dtype)
    except (ValueError, TypeError, OverflowError) as exc:
        raise InvalidInputError(f"input {name!r}: data are not {datatype} values ({exc})") from exc
    if array.dtype != dtype:  # np.asarray keeps a native-order dtype: make it the wire's
        array = array.astype(dtype)
    count = math.prod(dims)
    if array.size != count:
        raise InvalidInputError(
            f"input {name!r}: shape {list(dims)} holds {count} elements, data has {array.size}"
        )
    return Tensor(name, datatype, dims, array.reshape(dims))
