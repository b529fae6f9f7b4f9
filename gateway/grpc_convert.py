"""The gRPC messages of the Open Inference Protocol to the service's types and back.

Pure functions, no I/O: :mod:`ipuserve.gateway.grpc_server` calls them around
:class:`~ipuserve.gateway.service.InferenceService`. A request's tensors arrive in one
of two forms, and each is checked here against its own datatype and shape before the
service checks them against the model:

- ``raw_input_contents``: one little-endian byte string per input, in the order of
  ``inputs`` (tritonclient's default). Each becomes a read-only numpy view of the
  received bytes, with no copy of its own.
- typed ``contents``: a repeated field per datatype (``fp32_contents``, ...). FP16 has
  no field of its own, so FP16 travels only raw.

The response mirrors the request: typed ``contents`` when every input came typed
(and no output is FP16), ``raw_output_contents`` otherwise. tritonclient reads only
the raw form, and sends it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ipuserve.errors import DeadlineExceeded, InvalidInputError
from ipuserve.gateway import service as svc
from ipuserve.gateway.proto import inference_pb2 as pb
from ipuserve.gateway.tensors import (
    Tensor,
    check_budget,
    check_shape,
    from_buffer,
    from_values,
    shown,
    to_dtype,
)

#: each datatype's field of InferTensorContents (INT8 and INT16 ride int32, as the
#: specification says; a value out of the datatype's range is refused, not wrapped)
TYPED_FIELDS: dict[str, str] = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}
_ALL_FIELDS = (*sorted(set(TYPED_FIELDS.values())), "bytes_contents")
#: Triton's per-request timeout parameter, in microseconds (tritonclient's ``timeout=``)
TIMEOUT_PARAMETER = "timeout"


# ---------------------------------------------------------------- requests


def infer_request(
    msg: pb.ModelInferRequest, time_remaining: float | None, max_tensor_bytes: int
) -> svc.InferRequest:
    """The service's request for a ModelInferRequest. ``time_remaining`` is what is
    left of the call's gRPC deadline (tritonclient's ``client_timeout``), if it has one;
    the request's timeout is the earlier of it and the ``timeout`` parameter. The
    declared shapes are checked, and their bytes against ``max_tensor_bytes`` (413),
    before any tensor is converted."""
    svc.check_parameters((key, _value(p)) for key, p in msg.parameters.items())
    declared = [(t.name, t.datatype, check_shape(t.name, tuple(t.shape))) for t in msg.inputs]
    check_budget(declared, max_tensor_bytes)
    if msg.raw_input_contents:
        inputs = _raw_inputs(msg.inputs, msg.raw_input_contents)
    else:
        inputs = tuple(_typed_input(tensor) for tensor in msg.inputs)
    outputs = tuple(output.name for output in msg.outputs) or None
    return svc.InferRequest(
        model=msg.model_name,
        version=msg.model_version or None,
        id=msg.id or None,
        inputs=inputs,
        outputs=outputs,
        timeout_s=_timeout(msg.parameters, time_remaining),
    )


def _value(param: pb.InferParameter) -> object:
    kind = param.WhichOneof("parameter_choice")
    return None if kind is None else getattr(param, kind)


def wants_typed_outputs(msg: pb.ModelInferRequest) -> bool:
    """The client sent typed contents, so it reads them: answer in the same form."""
    return bool(msg.inputs) and not msg.raw_input_contents


def _raw_inputs(
    tensors: Sequence[pb.ModelInferRequest.InferInputTensor], raws: Sequence[bytes]
) -> tuple[Tensor, ...]:
    if len(raws) != len(tensors):
        raise InvalidInputError(
            f"the request has {len(tensors)} input(s) but {len(raws)} raw_input_contents "
            "entries; when raw_input_contents is used it holds one entry per input, in order"
        )
    return tuple(_raw_input(tensor, raw) for tensor, raw in zip(tensors, raws, strict=True))


def _raw_input(tensor: pb.ModelInferRequest.InferInputTensor, raw: bytes) -> Tensor:
    if tensor.HasField("contents"):
        raise InvalidInputError(
            f"input {shown(tensor.name)} has both contents and a raw_input_contents entry; "
            "a request uses one form for all its inputs"
        )
    return from_buffer(tensor.name, tensor.datatype, tuple(tensor.shape), raw)


def _typed_input(tensor: pb.ModelInferRequest.InferInputTensor) -> Tensor:
    to_dtype(tensor.datatype)  # an unknown datatype or BYTES: refused by name first
    field = TYPED_FIELDS.get(tensor.datatype)
    if field is None:
        raise InvalidInputError(
            f"input {shown(tensor.name)} is {tensor.datatype}, which has no typed contents "
            "field: send it in raw_input_contents"
        )
    others = [name for name in _ALL_FIELDS if name != field and getattr(tensor.contents, name)]
    if others:  # a value in another datatype's field is a mistake, not data to drop
        raise InvalidInputError(
            f"input {shown(tensor.name)} is {tensor.datatype}, whose values go in "
            f"contents.{field}, but contents.{others[0]} is set"
        )
    values = getattr(tensor.contents, field)
    return from_values(tensor.name, tensor.datatype, tuple(tensor.shape), values)


def _timeout(
    parameters: Mapping[str, pb.InferParameter], time_remaining: float | None
) -> float | None:
    """The earlier of the call's deadline and Triton's ``timeout`` parameter (µs; 0 is
    none, as in Triton)."""
    if time_remaining is not None and time_remaining <= 0:
        raise DeadlineExceeded("the call's deadline had passed when the gateway received it")
    timeouts = [] if time_remaining is None else [time_remaining]
    if TIMEOUT_PARAMETER in parameters:
        param = parameters[TIMEOUT_PARAMETER]
        kind = param.WhichOneof("parameter_choice")
        if kind not in ("int64_param", "uint64_param"):
            raise InvalidInputError(
                f"parameter {TIMEOUT_PARAMETER!r} is microseconds as an integer "
                f"(int64_param), got {kind or 'no value'}"
            )
        micros = getattr(param, kind)
        if micros < 0:
            raise InvalidInputError(
                f"parameter {TIMEOUT_PARAMETER!r} is {micros} µs; it cannot be negative"
            )
        if micros:
            timeouts.append(micros / 1e6)
    return min(timeouts) if timeouts else None


# ---------------------------------------------------------------- responses


def infer_response(response: svc.InferResponse, typed: bool) -> pb.ModelInferResponse:
    """The ModelInferResponse for the service's answer; ``typed`` as
    :func:`wants_typed_outputs` decided, overruled by any FP16 output (raw only)."""
    typed = typed and all(out.datatype in TYPED_FIELDS for out in response.outputs)
    msg = pb.ModelInferResponse(
        model_name=response.model, model_version=response.version, id=response.id or ""
    )
    for tensor in response.outputs:
        out = msg.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
        if typed:
            values = getattr(out.contents, TYPED_FIELDS[tensor.datatype])
            values.extend(tensor.array.ravel().tolist())
        else:
            msg.raw_output_contents.append(_le_bytes(tensor.array))
    return msg


def _le_bytes(array: np.ndarray[Any, Any]) -> bytes:
    """The array's values as little-endian bytes in row-major order (the wire's form)."""
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return array.tobytes(order="C")


def model_metadata(meta: svc.ModelMetadata) -> pb.ModelMetadataResponse:
    return pb.ModelMetadataResponse(
        name=meta.name,
        versions=meta.versions,
        platform=meta.platform,
        inputs=_tensor_metadata(meta.inputs),
        outputs=_tensor_metadata(meta.outputs),
    )


def _tensor_metadata(
    tensors: Iterable[svc.TensorMetadata],
) -> list[pb.ModelMetadataResponse.TensorMetadata]:
    return [
        pb.ModelMetadataResponse.TensorMetadata(name=t.name, datatype=t.datatype, shape=t.shape)
        for t in tensors
    ]


def server_metadata(meta: svc.ServerMetadata) -> pb.ServerMetadataResponse:
    return pb.ServerMetadataResponse(
        name=meta.name, version=meta.version, extensions=meta.extensions
    )


def statistics(stats: Iterable[svc.ModelStatistics]) -> pb.ModelStatisticsResponse:
    return pb.ModelStatisticsResponse(model_stats=[_model_statistics(s) for s in stats])


def _model_statistics(s: svc.ModelStatistics) -> pb.ModelStatistics:
    return pb.ModelStatistics(
        name=s.name,
        version=s.version,
        last_inference=s.last_inference_ms,
        inference_count=s.inference_count,
        execution_count=s.execution_count,
        inference_stats=pb.InferStatistics(
            success=_duration(s.success),
            fail=_duration(s.fail),
            queue=_duration(s.queue),
            compute_input=_duration(s.compute_input),
            compute_infer=_duration(s.compute_infer),
            compute_output=_duration(s.compute_output),
            cache_hit=pb.StatisticDuration(),
            cache_miss=pb.StatisticDuration(),
        ),
    )


def _duration(d: svc.Duration) -> pb.StatisticDuration:
    return pb.StatisticDuration(count=d.count, ns=d.ns)
