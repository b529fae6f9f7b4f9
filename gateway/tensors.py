"""The protocol's datatypes mapped to numpy both ways, and the tensor both doors build.

The Open Inference Protocol names datatypes (``FP32``, ``INT64``...); the fabric speaks
numpy dtypes, little-endian (:data:`ipuserve.protocol.DTYPES`). ``BYTES`` (strings) has no
numpy dtype the fabric carries and no ipuserve model takes it, so it is refused with its
own message rather than "unknown datatype".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ipuserve.errors import InvalidInputError, PayloadTooLargeError
from ipuserve.protocol.envelope import Limits
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

#: what the fabric's wire carries at most (a tensor's rank, and its elements): a shape
#: beyond either could never run, so it is refused before anything is allocated
MAX_RANK = Limits().max_rank
MAX_ELEMENTS = Limits().max_elements
#: a name a client gave is shown in a message cut to this many characters
SHOWN_CHARS = 100


def clip(name: object) -> str:
    """``name`` cut to :data:`SHOWN_CHARS` characters (ending '…'): an error never
    echoes an unbounded string a client sent."""
    text = name if isinstance(name, str) else repr(name)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 1] + "…"


def shown(name: object) -> str:
    """``name`` quoted for a message, :func:`clip`-ped."""
    return repr(clip(name))


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


def check_shape(name: str, shape: object) -> tuple[int, ...]:
    """``shape`` as a tuple: at most :data:`MAX_RANK` integers >= 0 holding at most
    :data:`MAX_ELEMENTS` elements, else :class:`InvalidInputError`."""
    if not isinstance(shape, list | tuple) or not all(
        isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_ELEMENTS for n in shape
    ):
        given = f"{shape!r}"[:120]
        raise InvalidInputError(
            f"input {shown(name)}: shape must be a list of integers in [0, {MAX_ELEMENTS}], "
            f"got {given}"
        )
    if len(shape) > MAX_RANK:
        raise InvalidInputError(
            f"input {shown(name)}: shape has {len(shape)} dimensions; at most {MAX_RANK}"
        )
    if math.prod(shape) > MAX_ELEMENTS:
        raise InvalidInputError(
            f"input {shown(name)}: shape {list(shape)} holds more than {MAX_ELEMENTS} elements"
        )
    return tuple(shape)


def check_budget(tensors: list[tuple[str, str, tuple[int, ...]]], limit: int) -> None:
    """Refuse (413) tensors ``(name, datatype, dims)`` whose declared bytes add up to
    more than ``limit`` (the body limit) before any of them is materialised: a request
    costs what its tensors cost, so what they may cost is bounded first."""
    total = sum(math.prod(dims) * to_dtype(datatype).itemsize for _, datatype, dims in tensors)
    if total > limit:
        raise PayloadTooLargeError(
            f"the inputs' shapes declare {total} bytes of tensors, over the gateway's limit "
            f"of {limit} bytes (--max-body-bytes)"
        )


def from_buffer(name: str, datatype: str, shape: object, buffer: memoryview | bytes) -> Tensor:
    """A tensor over ``buffer`` without a copy (read-only when the buffer is): the
    binary tensor data extension and gRPC's ``raw_input_contents``."""
    dtype = to_dtype(datatype)
    dims = check_shape(name, shape)
    want = math.prod(dims) * dtype.itemsize
    if len(buffer) != want:
        raise InvalidInputError(
            f"input {shown(name)}: {datatype}{list(dims)} is {want} bytes, got {len(buffer)}"
        )
    array = np.frombuffer(buffer, dtype=dtype).reshape(dims)
    return Tensor(name, datatype, dims, array)


def from_values(name: str, datatype: str, shape: object, values: Sequence[Any]) -> Tensor:
    """A tensor from a sequence of numbers (gRPC's typed ``contents``): its length is
    checked against the shape before anything is converted, and the conversion makes no
    list of its own (``np.fromiter``), so it costs the array and nothing per element."""
    dtype = to_dtype(datatype)
    dims = check_shape(name, shape)
    count = math.prod(dims)
    if len(values) != count:
        raise InvalidInputError(
            f"input {shown(name)}: shape {list(dims)} holds {count} elements, "
            f"data has {len(values)}"
        )
    try:
        array = np.fromiter(values, dtype=dtype, count=count)
    except (ValueError, OverflowError) as exc:  # e.g. 300 for INT8 in int_contents
        raise InvalidInputError(
            f"input {shown(name)}: data hold a value out of {datatype}'s range ({exc})"[:300]
        ) from exc
    return Tensor(name, datatype, dims, array.reshape(dims))
