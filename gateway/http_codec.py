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
from dataclasses import dataclass
from typing import Any

import numpy as np

from ipuserve.errors import RequestError
from ipuserve.gateway.service import InferRequest, InferResponse
from ipuserve.gateway.tensors import Tensor, from_buffer, from_list
from ipuserve.limits import MAX_DURATION_MS

HEADER_LENGTH = "Inference-Header-Content-Length"
JSON_TYPE = "application/json"
BINARY_TYPE = "application/octet-stream"


@dataclass(frozen=True)
class ParsedInfer:
    request: InferRequest
    #: output name -> binary or not, as the request asked; absent: ``binary_default``
    binary: dict[str, bool]
    binary_default: bool


def parse_infer(
    body: bytes, header_length: str | None, model: str, version: str | None
) -> ParsedInfer:
    """The request in ``body``; :class:`RequestError` (400) saying what is malformed."""
    view = memoryview(body)
    json_end = _json_length(header_length, len(body))
    header = body if json_end == len(body) else view[:json_end]  # all JSON: no copy
    document = _object(_load(header), "the request body")
    parameters = _object(document.get("parameters", {}), "parameters")
    inputs = _list(document.get("inputs"), "inputs")
    tensors: list[Tensor] = []
    offset = json_end
    for i, item in enumerate(inputs):
        tensor, offset = _input(_object(item, f"inputs[{i}]"), view, offset)
        tensors.append(tensor)
    if offset != len(body):
        raise RequestError(
            f"{len(body) - offset} bytes of binary data follow the inputs' binary_data_size "
            f"(the body has {len(body) - json_end} bytes after the JSON header)"
        )
    outputs, binary = _outputs(document.get("outputs"))
    request_id = document.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise RequestError(f"id must be a string, got {request_id!r}")
    request = InferRequest(
        model=model,
        version=version,
        id=request_id,
        inputs=tuple(tensors),
        outputs=outputs,
        timeout_s=_timeout(parameters.get("timeout")),
    )
    return ParsedInfer(request, binary, bool(parameters.get("binary_data_output", False)))


def _json_length(header: str | None, size: int) -> int:
    if header is None:
        return size
    try:
        length = int(header)
    except ValueError:
        length = -1
    if not 0 <= length <= size:
        raise RequestError(
            f"{HEADER_LENGTH} must be a byte count within the body ({size} bytes), got {header!r}"
        )
    return length


def _load(raw: memoryview | bytes) -> Any:
    try:
        return json.loads(raw if isinstance(raw, bytes) else bytes(raw))
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(f"the request body is not valid JSON: {exc}") from exc


def _object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise RequestError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise RequestError(f"{what} must be a JSON list, got {type(value).__name__}")
    return value


def _input(item: dict[str, Any], body: memoryview, offset: int) -> tuple[Tensor, int]:
    name, datatype, shape = item.get("name"), item.get("datatype"), item.get("shape")
    if not isinstance(name, str) or not isinstance(datatype, str):
        raise RequestError(f"an input needs a string name and datatype, got {item!r:.200}")
    size = _object(item.get("parameters", {}), f"parameters of input {name!r}").get(
        "binary_data_size"
    )
    if size is None:
        if "data" not in item:
            raise RequestError(f"input {name!r} has neither data nor binary_data_size")
        return from_list(name, datatype, shape, item["data"]), offset
    if not isinstance(size, int) or size < 0 or offset + size > len(body):
        raise RequestError(
            f"input {name!r}: binary_data_size {size!r} does not fit the "
            f"{len(body) - offset} bytes of binary data left"
        )
    return from_buffer(name, datatype, shape, body[offset : offset + size]), offset + size


def _outputs(value: Any) -> tuple[tuple[str, ...] | None, dict[str, bool]]:
    if value is None:
        return None, {}
    names: list[str] = []
    binary: dict[str, bool] = {}
    for i, item in enumerate(_list(value, "outputs")):
        output = _object(item, f"outputs[{i}]")
        name = output.get("name")
        if not isinstance(name, str):
            raise RequestError(f"outputs[{i}] needs a string name")
        names.append(name)
        flag = _object(output.get("parameters", {}), f"parameters of output {name!r}").get(
            "binary_data"
        )
        if flag is not None:
            binary[name] = bool(flag)
    return tuple(names), binary


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
