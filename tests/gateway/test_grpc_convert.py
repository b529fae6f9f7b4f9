"""gateway/grpc_convert.py: the pure translations between the gRPC messages and the
service's types, checked without a server (the wire behaviour is in test_grpc.py)."""

from __future__ import annotations

import numpy as np
import pytest

from ipuserve.errors import DeadlineExceeded, InvalidInputError
from ipuserve.gateway import grpc_convert as convert
from ipuserve.gateway.proto import inference_pb2 as pb
from ipuserve.gateway.service import InferResponse
from ipuserve.gateway.tensors import Tensor


def _raw_request(array: np.ndarray, datatype: str) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="m", model_version="1", id="r")
    request.inputs.add(name="x", datatype=datatype, shape=array.shape)
    request.raw_input_contents.append(array.astype(array.dtype.newbyteorder("<")).tobytes())
    return request


def test_raw_inputs_become_read_only_views_of_the_received_bytes() -> None:
    array = np.arange(6, dtype=np.float16).reshape(2, 3)
    request = _raw_request(array, "FP16")
    raw = request.raw_input_contents[0]
    tensor = convert._raw_input(request.inputs[0], raw)
    assert np.shares_memory(tensor.array, np.frombuffer(raw, np.uint8))
    assert not tensor.array.flags.writeable
    np.testing.assert_array_equal(tensor.array, array)
    parsed = convert.infer_request(request, None, 1 << 20)
    assert (parsed.model, parsed.version, parsed.id, parsed.outputs) == ("m", "1", "r", None)
    assert parsed.inputs[0].shape == (2, 3)


def test_empty_version_and_id_are_none_and_requested_outputs_kept() -> None:
    request = _raw_request(np.zeros(2, np.int32), "INT32")
    request.model_version, request.id = "", ""
    request.outputs.add(name="b")
    request.outputs.add(name="a")
    parsed = convert.infer_request(request, None, 1 << 20)
    assert (parsed.version, parsed.id, parsed.outputs) == (None, None, ("b", "a"))


def test_raw_entries_must_match_the_inputs() -> None:
    request = _raw_request(np.zeros(2, np.int32), "INT32")
    request.inputs.add(name="y", datatype="INT32", shape=[2])
    with pytest.raises(InvalidInputError, match=r"2 input\(s\) but 1 raw_input_contents"):
        convert.infer_request(request, None, 1 << 20)


@pytest.mark.parametrize(
    ("remaining", "micros", "expected"),
    [
        (None, None, None),
        (2.0, None, 2.0),
        (None, 500_000, 0.5),
        (2.0, 500_000, 0.5),
        (0.25, 500_000, 0.25),
        (None, 0, None),  # Triton's 0: no timeout
    ],
)
def test_the_timeout_is_the_earlier_of_deadline_and_parameter(
    remaining: float | None, micros: int | None, expected: float | None
) -> None:
    request = _raw_request(np.zeros(1, np.int8), "INT8")
    if micros is not None:
        request.parameters["timeout"].int64_param = micros
    assert convert.infer_request(request, remaining, 1 << 20).timeout_s == expected


@pytest.mark.parametrize("remaining", [0.0, -1.0])
def test_a_deadline_already_past_is_deadline_exceeded(remaining: float) -> None:
    request = _raw_request(np.zeros(1, np.int8), "INT8")
    with pytest.raises(DeadlineExceeded, match="deadline had passed"):
        convert.infer_request(request, remaining, 1 << 20)


def test_a_timeout_parameter_that_is_not_microseconds_is_refused() -> None:
    request = _raw_request(np.zeros(1, np.int8), "INT8")
    request.parameters["timeout"].string_param = "1s"
    with pytest.raises(InvalidInputError, match="microseconds"):
        convert.infer_request(request, None, 1 << 20)
    request.parameters["timeout"].int64_param = -5
    with pytest.raises(InvalidInputError, match="negative"):
        convert.infer_request(request, None, 1 << 20)


@pytest.mark.parametrize(
    ("datatype", "values"),
    [
        ("BOOL", [True, False, True]),
        ("INT8", [-128, 0, 127]),
        ("INT16", [-32768, 1, 32767]),
        ("INT64", [-(2**63), 0, 2**63 - 1]),
        ("UINT16", [0, 1, 65535]),
        ("UINT32", [0, 1, 2**32 - 1]),
        ("UINT64", [0, 1, 2**64 - 1]),
        ("FP64", [0.5, -1e300, 3.0]),
    ],
)
def test_typed_contents_round_trip(datatype: str, values: list[object]) -> None:
    request = pb.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name="x", datatype=datatype, shape=[3])
    getattr(tensor.contents, convert.TYPED_FIELDS[datatype]).extend(values)
    assert convert.wants_typed_outputs(request)
    (parsed,) = convert.infer_request(request, None, 1 << 20).inputs
    assert parsed.array.tolist() == values
    answer = InferResponse("m", "1", None, (Tensor("y", datatype, (3,), parsed.array),))
    (out,) = convert.infer_response(answer, typed=True).outputs
    assert list(getattr(out.contents, convert.TYPED_FIELDS[datatype])) == values


def test_a_response_is_raw_unless_asked_typed_and_fp16_is_always_raw() -> None:
    half = np.array([1.5, -2.0], np.float16)
    single = np.array([1.5, -2.0], np.float32)
    answer = InferResponse(
        "m", "1", "id", (Tensor("a", "FP32", (2,), single), Tensor("b", "FP16", (2,), half))
    )
    for typed in (False, True):  # FP16 has no typed field: raw, for every output
        msg = convert.infer_response(answer, typed=typed)
        assert msg.raw_output_contents == [single.tobytes(), half.tobytes()]
        assert not msg.outputs[0].HasField("contents")
    assert (msg.model_name, msg.model_version, msg.id) == ("m", "1", "id")


def test_big_endian_outputs_go_out_little_endian() -> None:
    array = np.array([1, 2], dtype=">i4")
    answer = InferResponse("m", "1", None, (Tensor("a", "INT32", (2,), array),))
    (raw,) = convert.infer_response(answer, typed=False).raw_output_contents
    assert raw == np.array([1, 2], "<i4").tobytes()
