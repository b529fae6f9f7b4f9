"""A ModelInferRequest's declared shapes against its tensors' sizes, before it is parsed.

protobuf's parse of a message holds a copy of every tensor it carries (66 M typed
bools: 66 MB more, and more while its arrays grow) before the gateway can compare them
with the shapes. This walks the message's wire format instead, reading only the few
small fields (each input's datatype and shape) and the *lengths* of the tensor fields:
a typed ``contents`` field of fixed-size values holds length / size values, one of
varints as many as it has bytes below 0x80; a ``raw_input_contents`` entry is its
length in bytes. A tensor whose size disagrees with its shape is refused here, at the
cost of the message bytes alone; what passes is parsed and checked again as before.
A message this walk cannot follow is left to the parser, which says what is wrong.
"""

from __future__ import annotations

import math

from ipuserve.errors import InvalidInputError
from ipuserve.gateway.tensors import DATATYPES, check_shape, shown

# ModelInferRequest: inputs = 5, raw_input_contents = 7; InferInputTensor: name = 1,
# datatype = 2, shape = 3, contents = 5 (gateway/proto/inference.proto)
_INPUTS, _RAW, _NAME, _DATATYPE, _SHAPE, _CONTENTS = 5, 7, 1, 2, 3, 5
#: InferTensorContents' field numbers: bytes per value (0: varints)
_CONTENT_SIZES = {1: 1, 2: 0, 3: 0, 4: 0, 5: 0, 6: 4, 7: 8}
_HIGH_BYTES = bytes(range(128))


class _Unreadable(Exception):
    """The walk cannot follow the bytes: the parser will say why."""


def precheck(raw: bytes) -> None:
    """Refuse (400) an input whose typed contents or raw bytes disagree with its
    declared shape, reading ``raw`` without parsing it."""
    try:
        inputs, raws = _walk(raw)
    except (_Unreadable, IndexError):
        return
    for i, (name, datatype, shape, counts) in enumerate(inputs):
        if datatype not in DATATYPES:
            continue
        dims = check_shape(name, shape)
        count = math.prod(dims)
        for got in counts:
            if got != count:
                raise InvalidInputError(
                    f"input {shown(name)}: shape {list(dims)} holds {count} elements, "
                    f"data has {got}"
                )
        if i < len(raws) and raws[i] != count * DATATYPES[datatype].itemsize:
            want = count * DATATYPES[datatype].itemsize
            raise InvalidInputError(
                f"input {shown(name)}: {datatype}{list(dims)} is {want} bytes, got {raws[i]}"
            )


def _walk(
    raw: bytes,
) -> tuple[list[tuple[str, str, list[int], list[int]]], list[int]]:
    inputs: list[tuple[str, str, list[int], list[int]]] = []
    raws: list[int] = []
    for field, start, end in _fields(raw, 0, len(raw), {_INPUTS, _RAW}):
        if field == _INPUTS:
            inputs.append(_input(raw, start, end))
        elif field == _RAW:
            raws.append(end - start)
    return inputs, raws


def _input(raw: bytes, start: int, end: int) -> tuple[str, str, list[int], list[int]]:
    name, datatype, shape, counts = "", "", [], []
    for field, a, b in _fields(raw, start, end, {_NAME, _DATATYPE, _SHAPE, _CONTENTS}):
        if field == _NAME:
            name = raw[a:b].decode(errors="replace")
        elif field == _DATATYPE:
            datatype = raw[a:b].decode(errors="replace")
        elif field == _SHAPE:
            shape.extend(_varints(raw, a, b))
        elif field == _CONTENTS:
            counts.extend(_counts(raw, a, b))
    return name, datatype, shape, counts


def _counts(raw: bytes, start: int, end: int) -> list[int]:
    counts: dict[int, int] = {}
    for field, a, b in _fields(raw, start, end, set(_CONTENT_SIZES)):
        size = _CONTENT_SIZES.get(field)
        if size is None:
            continue
        n = (b - a) // size if size else (b - a) - len(raw[a:b].translate(None, _HIGH_BYTES))
        counts[field] = counts.get(field, 0) + n
    return list(counts.values())


def _fields(raw: bytes, start: int, end: int, wanted: set[int]) -> list[tuple[int, int, int]]:
    """(field number, start, end) of each length-delimited field in ``raw[start:end]``;
    other wire types are skipped, unless a ``wanted`` field comes in one (a repeated
    number not packed: the walk leaves such a message to the parser)."""
    found, at = [], start
    while at < end:
        key, at = _varint(raw, at)
        field, kind = key >> 3, key & 7
        if kind != 2 and field in wanted:
            raise _Unreadable
        if kind == 2:
            length, at = _varint(raw, at)
            if at + length > end:
                raise _Unreadable
            found.append((field, at, at + length))
            at += length
        elif kind == 0:
            _, at = _varint(raw, at)
        elif kind in (1, 5):
            at += 8 if kind == 1 else 4
        else:
            raise _Unreadable
    if at != end:
        raise _Unreadable
    return found


def _varint(raw: bytes, at: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = raw[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7
        if shift > 63:
            raise _Unreadable


def _varints(raw: bytes, start: int, end: int) -> list[int]:
    values: list[int] = []
    at = start
    while at < end and len(values) <= 64:
        value, at = _varint(raw, at)
        values.append(value - (1 << 64) if value >= 1 << 63 else value)  # int64
    return values
