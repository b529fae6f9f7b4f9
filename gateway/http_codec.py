"""The HTTP door's wire: an infer request body (JSON, or JSON then binary tensor data)
into an :class:`InferRequest`, and an :class:`InferResponse` back into a body.

Binary tensor data extension: the JSON header's length is the request's
``Inference-Header-Content-Length`` header; each input with a ``binary_data_size``
parameter takes that many bytes of what follows, in input order, as a read-only numpy
view of the received body (no copy). An output is sent binary when its ``binary_data``
parameter says so, else when the request's ``binary_data_output`` parameter does; then
the response carries the same header and ``application/octet-stream``.
``parameters.timeout`` is the request's timeout in microseconds, as Triton's (0: the
gateway's default).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from ipuserve.errors import RequestError
from ipuserve.gateway import json_data
from ipuserve.gateway.service import InferRequest, InferResponse, check_parameters
from ipuserve.gateway.tensors import (
    Tensor,
    check_budget,
    check_shape,
    from_buffer,
    shown,
    to_dtype,
)
from ipuserve.limits import MAX_DURATION_MS

HEADER_LENGTH = "Inference-Header-Content-Length"
JSON_TYPE = "application/json"
BINARY_TYPE = "application/octet-stream"


class _InputJson(msgspec.Struct, kw_only=True):
    name: str
    datatype: str
    shape: list[int]
    parameters: dict[str, Any] = {}
    #: the JSON text of ``data``, a view of the body decoded later (gateway/json_data.py)
    data: msgspec.Raw = msgspec.Raw(b"")  # empty: absent


class _OutputJson(msgspec.Struct, kw_only=True):
    name: str
    parameters: dict[str, Any] = {}


class _RequestJson(msgspec.Struct, kw_only=True):
    """An infer request's JSON: decoding is the first validation (types, in C)."""

    inputs: list[_InputJson]
    id: str | None = None
    parameters: dict[str, Any] = {}
    outputs: list[_OutputJson] | None = None


_HEADER = msgspec.json.Decoder(_RequestJson)


@dataclass(frozen=True)
class ParsedInfer:
    request: InferRequest
    #: output name -> binary or not, as the request asked; absent: ``binary_default``
    binary: dict[str, bool]
    binary_default: bool


def parse_infer(
    body: bytes | bytearray,
    header_length: str | None,
    model: str,
    version: str | None,
    max_tensor_bytes: int,
) -> ParsedInfer:
    """The request in ``body``; :class:`RequestError` (400) saying what is malformed,
    :class:`PayloadTooLargeError` (413) when its shapes declare more than
    ``max_tensor_bytes`` of tensors (checked before any is materialised)."""
    view = memoryview(body).toreadonly()
    json_end = json_length(header_length, len(body))
    document = _load(body if json_end == len(body) else view[:json_end])  # all JSON: no copy
    check_parameters(document.parameters.items())
    declared = [(i.name, i.datatype, check_shape(i.name, i.shape)) for i in document.inputs]
    check_budget(declared, max_tensor_bytes)
    tensors: list[Tensor] = []
    offset = json_end
    for item, (_, _, dims) in zip(document.inputs, declared, strict=True):
        tensor, offset = _input(item, dims, body, view, offset)
        tensors.append(tensor)
    if offset != len(body):
        raise RequestError(
            f"{len(body) - offset} bytes of binary data follow the inputs' binary_data_size "
            f"(the body has {len(body) - json_end} bytes after the JSON header)"
        )
    outputs, binary = _outputs(document.outputs)
    request = InferRequest(
        model=model,
        version=version,
        id=document.id,
        inputs=tuple(tensors),
        outputs=outputs,
        timeout_s=_timeout(document.parameters.get("timeout")),
    )
    return ParsedInfer(request, binary, bool(document.parameters.get("binary_data_output", False)))


def declared_binary_bytes(header: bytes | bytearray) -> int:
    """The binary bytes a binary-extension body's JSON header says follow it, judged
    from the header alone: each input's ``binary_data_size`` must be exactly the bytes
    its shape and datatype declare (else :class:`RequestError`). The HTTP door reads
    (or inflates) no more than the header and this, so a body that lies about its
    tensors costs its header, not its length; :func:`parse_infer` checks the whole
    body again."""
    total = 0
    for item in _load(header).inputs:
        size = item.parameters.get("binary_data_size")
        if size is None:
            continue
        dims = check_shape(item.name, item.shape)
        want = math.prod(dims) * to_dtype(item.datatype).itemsize
        if isinstance(size, bool) or size != want:
            raise RequestError(
                f"input {shown(item.name)}: binary_data_size {size!r:.40} is not the {want} "
                f"bytes its shape {list(dims)} of {item.datatype:.20} declares"
            )
        total += want
    return total


def json_length(header: str | None, size: int) -> int:
    """The header's byte count: ASCII digits only (``int()`` would also take ``1_12``
    and other scripts' digits), within the body."""
    if header is None:
        return size
    length = int(header) if header.isascii() and header.isdigit() and len(header) < 20 else -1
    if not 0 <= length <= size:
        raise RequestError(
            f"{HEADER_LENGTH} must be a byte count within the body ({size} bytes), "
            f"got {header[:40]!r}"
        )
    return length


def _load(raw: memoryview | bytes | bytearray) -> _RequestJson:
    try:
        return _HEADER.decode(raw)
    except msgspec.ValidationError as exc:
        raise RequestError(_reworded(str(exc))[:300]) from None
    except msgspec.DecodeError as exc:
        raise RequestError(f"the request body is not valid JSON: {exc}"[:300]) from None
    except RecursionError:
        raise RequestError("the request body's JSON is nested too deeply") from None


_EXPECTED = re.compile(r"Expected `(\w+)`(?: \| `\w+`)*, got `(\w+)`(?: - at `\$\.?(.*)`)?")
_NOUNS = {"object": "JSON object", "array": "JSON list", "str": "string", "int": "integer"}


def _reworded(message: str) -> str:
    """msgspec's ``Expected `array`, got `int` - at `$.inputs``` as ``inputs must be a
    JSON list, got int``."""
    found = _EXPECTED.fullmatch(message)
    if found is None:
        return f"the request body is not a valid infer request: {message}"
    want, got, where = found.groups()
    return f"{where or 'the request body'} must be a {_NOUNS.get(want, want)}, got {got}"


def _input(
    item: _InputJson, dims: tuple[int, ...], body: bytes | bytearray, view: memoryview, offset: int
) -> tuple[Tensor, int]:
    name, datatype = item.name, item.datatype
    size = item.parameters.get("binary_data_size")
    if size is None:
        if not len(item.data):
            raise RequestError(f"input {shown(name)} has neither data nor binary_data_size")
        start, end = _span(item.data, body)
        array = json_data.decode(name, datatype, dims, body, start, end)
        return Tensor(name, datatype, dims, array), offset
    if isinstance(size, bool) or not isinstance(size, int) or size < 0 or offset + size > len(body):
        raise RequestError(
            f"input {shown(name)}: binary_data_size {size!r:.40} does not fit the "
            f"{len(body) - offset} bytes of binary data left"
        )
    return from_buffer(name, datatype, dims, view[offset : offset + size]), offset + size


def _span(raw: msgspec.Raw, body: bytes | bytearray) -> tuple[int, int]:
    """Where ``raw`` (msgspec's view of the body) lies in ``body``."""
    at = np.frombuffer(raw, np.uint8).__array_interface__["data"][0]
    base = np.frombuffer(body, np.uint8).__array_interface__["data"][0]
    start = at - base
    if not 0 <= start <= len(body) - len(raw):  # pragma: no cover - msgspec copied it
        raise AssertionError("msgspec.Raw is not a view of the body")
    return start, start + len(raw)


def _outputs(
    value: list[_OutputJson] | None,
) -> tuple[tuple[str, ...] | None, dict[str, bool]]:
    if value is None:
        return None, {}
    binary: dict[str, bool] = {}
    for output in value:
        flag = output.parameters.get("binary_data")
        if flag is not None:
            binary[output.name] = bool(flag)
    return tuple(output.name for output in value), binary


def _timeout(value: Any) -> float | None:
    """``parameters.timeout``: microseconds, as Triton's; 0 or absent: the default."""
    if value is None or value == 0:
        return None
    limit_us = int(MAX_DURATION_MS * 1000)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < limit_us:
        raise RequestError(
            f"parameters.timeout must be microseconds, an integer in [0, {limit_us}), got {value!r}"
        )
    return value / 1e6


def render_infer(parsed: ParsedInfer, response: InferResponse) -> tuple[bytes, dict[str, str]]:
    """The response body and its headers."""
    outputs: list[dict[str, Any]] = []
    chunks: list[memoryview] = []
    for tensor in response.outputs:
        entry: dict[str, Any] = {
            "name": tensor.name,
            "datatype": tensor.datatype,
            "shape": list(tensor.shape),
        }
        if parsed.binary.get(tensor.name, parsed.binary_default):
            raw = np.ascontiguousarray(tensor.array).reshape(-1).view(np.uint8).data
            entry["parameters"] = {"binary_data_size": raw.nbytes}
            chunks.append(raw)
        else:
            entry["data"] = _json_data(tensor)
        outputs.append(entry)
    document: dict[str, Any] = {"model_name": response.model, "model_version": response.version}
    if response.id is not None:
        document["id"] = response.id
    document["outputs"] = outputs
    header = json.dumps(document, separators=(",", ":")).encode()
    if not chunks:
        return header, {"Content-Type": JSON_TYPE}
    headers = {"Content-Type": BINARY_TYPE, HEADER_LENGTH: str(len(header))}
    return b"".join([header, *chunks]), headers


def _json_data(tensor: Tensor) -> list[Any]:
    data: list[Any] = tensor.array.reshape(-1).tolist()
    if tensor.array.dtype.kind == "f" and not all(map(math.isfinite, data)):
        # JSON has no NaN or infinity; Python's json would write invalid tokens
        raise RequestError(
            f"output {tensor.name!r} holds NaN or infinity, which JSON cannot carry: "
            "ask for it as binary data (parameters.binary_data)"
        )
    return data
