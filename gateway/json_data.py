"""An input's JSON ``data`` into a typed numpy array, at a cost bounded by its shape.

The HTTP door's header decoder (:mod:`gateway.http_codec`) keeps each input's ``data``
as raw JSON text (a ``msgspec.Raw``: a view of the body, no copy). This module turns
that text into the datatype's array, strictly and without a Python object per element:

- **Strict**: each element is decoded by msgspec with the datatype's declared type
  (:data:`ELEMENT_TYPES`), so ``null``, ``"0.5"`` and ``true`` are not FP32, a bool is
  only BOOL, an integer must be in its type's range; a refusal names the input and the
  element's position.
- **Bounded**: the declared shape is checked against the text before anything is
  materialised: a flat list of N numbers has N - 1 commas, whatever its nesting (a
  row-major nested list too), so ``bytes.count`` refuses a body whose element count
  disagrees with the shape without allocating. Nested data must then have exactly the
  shape's brackets (its skeleton of ``[],`` is compared with the shape's).
- **Chunked**: large data is decoded in pieces of :data:`CHUNK_BYTES` cut at commas
  (brackets dropped), each into a Python list of at most a few tens of thousands of
  numbers that is copied into the preallocated array and dropped. The cost is the
  array, the skeleton (one byte per element, nested data only) and one piece.

Small data (up to :data:`SMALL_BYTES`), the common case, is decoded in one call.
docs/gateway.md says how the alternatives measured.
"""

from __future__ import annotations

import math
import re
from functools import lru_cache
from typing import Annotated, Any

import msgspec
import numpy as np

from ipuserve.errors import InvalidInputError
from ipuserve.gateway.tensors import shown, to_dtype


def _int(dtype: str) -> Any:
    info = np.iinfo(dtype)
    if info.max > np.iinfo(np.int64).max:  # msgspec's bounds are int64s: numpy checks the top
        return Annotated[int, msgspec.Meta(ge=0)]
    return Annotated[int, msgspec.Meta(ge=int(info.min), le=int(info.max))]


def _float(dtype: str) -> Any:
    top = float(np.finfo(dtype).max)
    return Annotated[float, msgspec.Meta(ge=-top, le=top)]


#: the body, as the HTTP door read it
Text = bytes | bytearray

#: the msgspec type of one element of each datatype
ELEMENT_TYPES: dict[str, Any] = {
    "BOOL": bool,
    **{t.upper(): _int(t) for t in ("int8", "int16", "int32", "int64")},
    **{t.upper(): _int(t) for t in ("uint8", "uint16", "uint32", "uint64")},
    "FP16": _float("float16"),
    "FP32": _float("float32"),
    "FP64": float,
}
#: data up to this many bytes of text is decoded in one call
SMALL_BYTES = 64 * 1024
#: larger data is decoded in pieces of about this many bytes of text
CHUNK_BYTES = 256 * 1024
#: every byte but the skeleton's ``[``, ``]`` and ``,``
_NOT_SKELETON = bytes(b for b in range(256) if b not in b"[],")
_SPACE = re.compile(rb"[ \t\r\n]*")
#: msgspec's ``... - at `$[3][1]``` and its position
_AT = re.compile(r"(.*?)(?: - at `\$((?:\[\d+\])*)`)?")


@lru_cache(maxsize=64)
def _decoder(datatype: str, depth: int) -> msgspec.json.Decoder[Any]:
    kind: Any = ELEMENT_TYPES[datatype]
    for _ in range(depth):
        kind = list[kind]
    return msgspec.json.Decoder(kind)


def decode(
    name: str, datatype: str, dims: tuple[int, ...], text: Text, start: int, end: int
) -> np.ndarray[Any, Any]:
    """The array of input ``name``'s data, ``text[start:end]`` (JSON), of ``dims``;
    :class:`InvalidInputError` naming the input (and the element) otherwise."""
    dtype = to_dtype(datatype)
    if datatype not in ELEMENT_TYPES:  # pragma: no cover - every DATATYPES entry has one
        raise InvalidInputError(f"input {shown(name)}: {datatype} cannot be JSON data")
    count = math.prod(dims)
    first = _first(text, start, end)
    if first != ord("["):
        raise InvalidInputError(f"input {shown(name)}: data must be a list")
    nested = _first(text, text.index(b"[", start) + 1, end) == ord("[")
    depth = len(dims) if nested and len(dims) > 1 else 1
    if end - start <= SMALL_BYTES:
        return _small(name, datatype, dims, dtype, text[start:end], depth)
    _check_counts(name, dims, count, text, start, end, depth)
    if depth > 1:
        _check_skeleton(name, dims, text, start, end)
    return _chunked(name, datatype, dims, dtype, text, start, end)


def _first(text: Text, start: int, end: int) -> int:
    """The first byte of ``text[start:end]`` that is not whitespace (-1: none)."""
    at = _SPACE.match(text, start, end).end()  # type: ignore[union-attr]
    return text[at] if at < end else -1


def _small(
    name: str, datatype: str, dims: tuple[int, ...], dtype: np.dtype[Any], raw: Text, depth: int
) -> np.ndarray[Any, Any]:
    try:
        values = _decoder(datatype, depth).decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise _refusal(name, datatype, dims, exc, 0) from None
    try:
        array = np.array(values, dtype=dtype)
    except OverflowError:  # UINT64 above its range
        raise _out_of_range(name, datatype) from None
    except ValueError:  # rows of different lengths
        raise _not_shaped(name, dims) from None
    if (depth > 1 and array.shape != dims) or array.size != math.prod(dims):
        if depth > 1:
            raise _not_shaped(name, dims)
        raise _miscount(name, dims, array.size)
    return array.reshape(dims)


def _check_counts(
    name: str, dims: tuple[int, ...], count: int, text: Text, start: int, end: int, depth: int
) -> None:
    """Elements and brackets as many as ``dims`` has, counted without allocating."""
    values = text.count(b",", start, end) + 1
    if count == 0 or values != count:
        raise _miscount(name, dims, values)
    lists = sum(math.prod(dims[:k]) for k in range(depth))
    if text.count(b"[", start, end) != lists or text.count(b"]", start, end) != lists:
        raise _not_shaped(name, dims)


def _check_skeleton(name: str, dims: tuple[int, ...], text: Text, start: int, end: int) -> None:
    """Nested data's ``[],`` are exactly those of ``dims`` in row-major order."""
    want = b"[" + b"," * (dims[-1] - 1) + b"]"
    for n in reversed(dims[:-1]):
        want = b"[" + b",".join([want] * n) + b"]"
    view, done = memoryview(text), 0
    for a in range(start, end, CHUNK_BYTES * 4):
        piece = bytes(view[a : min(a + CHUNK_BYTES * 4, end)]).translate(None, _NOT_SKELETON)
        if want[done : done + len(piece)] != piece:
            raise _not_shaped(name, dims)
        done += len(piece)
    if done != len(want):
        raise _not_shaped(name, dims)


def _chunked(
    name: str,
    datatype: str,
    dims: tuple[int, ...],
    dtype: np.dtype[Any],
    text: Text,
    start: int,
    end: int,
) -> np.ndarray[Any, Any]:
    out = np.empty(math.prod(dims), dtype=dtype)
    decoder, view, done, a = _decoder(datatype, 1), memoryview(text), 0, start
    while a < end:
        b = text.find(b",", min(a + CHUNK_BYTES, end), end)
        b = end if b < 0 else b
        piece = b"[" + bytes(view[a:b]).translate(None, b"[]") + b"]"
        try:
            values = decoder.decode(piece)
        except (msgspec.DecodeError, RecursionError) as exc:
            raise _refusal(name, datatype, dims, exc, done) from None
        if done + len(values) > out.size:  # pragma: no cover - the counts were checked
            raise _miscount(name, dims, done + len(values))
        try:
            out[done : done + len(values)] = values
        except OverflowError:
            raise _out_of_range(name, datatype) from None
        done, a = done + len(values), b + 1
    if done != out.size:
        raise _miscount(name, dims, done)
    return out.reshape(dims)


def _refusal(
    name: str, datatype: str, dims: tuple[int, ...], exc: Exception, before: int
) -> InvalidInputError:
    """msgspec's refusal as the input's: the element's position in the tensor."""
    if isinstance(exc, RecursionError):
        return InvalidInputError(f"input {shown(name)}: data is nested too deeply")
    what, path = _AT.fullmatch(str(exc)).groups()  # type: ignore[union-attr]
    if not isinstance(exc, msgspec.ValidationError) or not path:
        return InvalidInputError(f"input {shown(name)}: data is not valid JSON: {what}"[:300])
    index = [int(i) for i in re.findall(r"\d+", path)]
    if before or len(index) == 1:  # a flat position (a piece's, or flat data)
        flat = before + index[-1]
        index = [int(i) for i in np.unravel_index(flat, dims)] if flat < math.prod(dims) else [flat]
    expected = what.removeprefix("Expected ").replace("`", "")
    return InvalidInputError(f"input {shown(name)}: data{index} is not {datatype} ({expected})")


def _out_of_range(name: str, datatype: str) -> InvalidInputError:
    return InvalidInputError(f"input {shown(name)}: data holds a value out of {datatype}'s range")


def _miscount(name: str, dims: tuple[int, ...], values: int) -> InvalidInputError:
    return InvalidInputError(
        f"input {shown(name)}: shape {list(dims)} holds {math.prod(dims)} elements, "
        f"data has {values}"
    )


def _not_shaped(name: str, dims: tuple[int, ...]) -> InvalidInputError:
    return InvalidInputError(
        f"input {shown(name)}: data must be a flat list or lists nested as the shape "
        f"{list(dims)}, row-major"
    )
