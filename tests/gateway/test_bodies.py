"""Client mistakes in request bodies, against a real gateway: each is a 400 (gRPC
INVALID_ARGUMENT) or a 413 naming what is wrong, never a 500, on both doors; the
request parameters the fabric does not honour are refused; echoed names are bounded.
"""

from __future__ import annotations

import gzip
import json
import urllib.error
import urllib.request
import zlib
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.http as httpclient

from ipuserve.gateway.proto import inference_pb2 as pb
from tests.gateway.conftest import Fabric, GatewayProc, mlp_input

INFER = "/v2/models/mlp/infer"


def _post(gateway: GatewayProc, body: bytes, **headers: str) -> tuple[int, str]:
    """(status, error message or body) of a plain POST to the mlp's infer."""
    request = urllib.request.Request(gateway.url + INFER, body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())["error"]


def _json(data: Any, shape: Any = (1, 64), datatype: str = "FP32", **extra: Any) -> bytes:
    entry = {"name": "input", "datatype": datatype, "shape": shape, "data": data}
    return json.dumps({"inputs": [entry], **extra}).encode()


def _zeros(shape: list[int] | tuple[int, ...] = (1, 64)) -> list[float]:
    return [0.0] * int(np.prod(shape))


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (_json([None, *_zeros()[1:]]), "data[0, 0] is not FP32 (float, got null)"),
        (_json([0.0, "0.5", *_zeros()[2:]]), "data[0, 1] is not FP32 (float, got str)"),
        (_json([0.0, 0.0, True, *_zeros()[3:]]), "data[0, 2] is not FP32 (float, got bool)"),
        (_json([[0.0] * 63 + [1e39]]), "data[0, 63] is not FP32 (float <= 3.40"),
        (_json(_zeros()[1:]), "shape [1, 64] holds 64 elements, data has 63"),
        (_json([_zeros()[:32], _zeros()[:32]]), "lists nested as the shape [1, 64]"),
        (_json([0], shape=[1] * 65), "shape has 65 dimensions; at most 8"),
        (_json([], shape=[0, 2**70]), "shape must be a list of integers in [0, "),
        (_json([], shape=[-1, 64]), "shape must be a list of integers in [0, "),
        (_json([], shape=[2**30, 64]), "over the gateway's limit"),
        (b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "must be a JSON object"),
        (
            b'{"inputs": [], "parameters": {"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}",
            "nested too deeply",
        ),
        (_json(_zeros(), parameters={"sequence_id": 7}), "'sequence_id' is not supported"),
        (_json(_zeros(), parameters={"sequence_start": True}), "'sequence_start' is not supp"),
        (_json(_zeros(), parameters={"priority": 2}), "'priority' is not supported"),
    ],
    ids=[
        "null",
        "string",
        "bool",
        "fp32-range",
        "short",
        "ragged",
        "65-dims",
        "2**70",
        "negative",
        "over-the-limit",
        "deep-inputs",
        "deep-parameters",
        "sequence_id",
        "sequence_start",
        "priority",
    ],
)
def test_a_malformed_json_body_is_refused_by_name(
    gateway: GatewayProc, body: bytes, message: str
) -> None:
    status, error = _post(gateway, body, **{"Content-Type": "application/json"})
    assert (status, message) == (413 if "limit" in message else 400, message), error
    assert message in error


@pytest.mark.parametrize(
    ("datatype", "data", "message"),
    [
        ("INT8", [1, 300], "data[1] is not INT8 (int <= 127)"),
        ("UINT8", [1, -1], "data[1] is not UINT8 (int >= 0)"),
        ("UINT64", [1, 2**64], "out of UINT64's range"),
        ("BOOL", [1, 0], "data[0] is not BOOL (bool, got int)"),
        ("BYTES", ["a", "b"], "BYTES is not supported"),
    ],
)
def test_values_outside_the_datatype_are_400(
    gateway: GatewayProc, datatype: str, data: list[Any], message: str
) -> None:
    body = json.dumps(
        {"inputs": [{"name": "input", "datatype": datatype, "shape": [2], "data": data}]}
    ).encode()
    status, error = _post(gateway, body)
    assert status == 400 and message in error, error


def test_the_header_length_takes_ascii_digits_only(gateway: GatewayProc) -> None:
    body = _json(_zeros())
    for given in ("1_12", "\u00b2", "+12", "0x1"):  # int() would take 1_12 and +12
        status, error = _post(gateway, body, **{"Inference-Header-Content-Length": given})
        assert status == 400 and "must be a byte count" in error, (given, error)


def test_compressed_bodies_are_inflated_within_the_limits(
    fabric: Fabric, gateway: GatewayProc
) -> None:
    x = mlp_input(2)
    body = _json(x.tolist(), shape=[2, 64], outputs=[{"name": "probs"}])
    want = fabric.models["mlp"].reference({"input": x})["probs"]
    for encoding, packed in (("gzip", gzip.compress(body)), ("deflate", zlib.compress(body))):
        status, text = _post(gateway, packed, **{"Content-Encoding": encoding})
        assert status == 200, text
        [probs] = json.loads(text)["outputs"]
        np.testing.assert_allclose(np.reshape(probs["data"], (2, -1)), want, rtol=1e-5)
    status, error = _post(gateway, b"not gzip at all", **{"Content-Encoding": "gzip"})
    assert status == 400 and "not valid gzip data" in error
    status, error = _post(gateway, gzip.compress(body)[:-20], **{"Content-Encoding": "gzip"})
    assert status == 400 and "not one complete gzip stream" in error
    status, error = _post(gateway, body, **{"Content-Encoding": "br"})
    assert status == 400 and "Content-Encoding 'br' is not supported" in error
    bomb = gzip.compress(b" " * (8 << 20))  # 8 MiB of spaces: 1,000 to 1
    status, error = _post(gateway, bomb, **{"Content-Encoding": "gzip"})
    assert status == 413 and "refused as a compression bomb" in error


def test_triton_client_compression_works(fabric: Fabric, gateway: GatewayProc) -> None:
    x = mlp_input(3)
    want = fabric.models["mlp"].reference({"input": x})["probs"]
    client = httpclient.InferenceServerClient(gateway.host_port)
    for algorithm in ("gzip", "deflate"):
        given = httpclient.InferInput("input", list(x.shape), "FP32")
        given.set_data_from_numpy(x, binary_data=False)
        result = client.infer("mlp", [given], request_compression_algorithm=algorithm)
        np.testing.assert_allclose(result.as_numpy("probs"), want, rtol=1e-5)


def test_a_long_model_name_is_404_with_a_short_message(gateway: GatewayProc) -> None:
    name = "m" * 5_000
    request = urllib.request.Request(f"{gateway.url}/v2/models/{name}", method="GET")
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=60)
    with caught.value as exc:
        message = json.loads(exc.read())["error"]
    assert exc.code == 404 and "mmm…" in message and len(message) < 600, message


# ---------------------------------------------------------------- gRPC


def _grpc(gateway: GatewayProc, method: str, message: bytes) -> grpc.RpcError:
    assert gateway.grpc is not None
    with grpc.insecure_channel(
        gateway.grpc, options=[("grpc.max_send_message_length", -1)]
    ) as channel:
        call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")
        with pytest.raises(grpc.RpcError) as caught:
            call(message, timeout=60)
    return caught.value


def _infer_message(**fields: Any) -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(model_name="mlp", **fields)
    msg.inputs.add(name="input", datatype="FP32", shape=[1, 64])
    return msg


def test_grpc_garbage_is_invalid_argument(gateway: GatewayProc) -> None:
    error = _grpc(gateway, "ModelInfer", b"\xff\xfe garbage \x00\x01")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid ModelInferRequest" in (error.details() or "")


def test_grpc_shapes_counts_and_parameters_are_checked_first(gateway: GatewayProc) -> None:
    msg = _infer_message()
    msg.inputs[0].contents.fp32_contents.extend([0.0] * 63)
    cases: list[tuple[pb.ModelInferRequest, str]] = [(msg, "holds 64 elements, data has 63")]
    msg = _infer_message()
    msg.inputs[0].shape[:] = [1] * 65
    cases.append((msg, "shape has 65 dimensions"))
    msg = _infer_message()
    msg.inputs[0].shape[:] = [2**20, 2**20]
    cases.append((msg, "holds more than"))
    for key, value in (("sequence_id", "int64_param"), ("priority", "uint64_param")):
        msg = _infer_message()
        msg.parameters[key].MergeFrom(pb.InferParameter(**{value: 3}))
        cases.append((msg, f"{key!r} is not supported by the gateway"))
    for message, fragment in cases:
        error = _grpc(gateway, "ModelInfer", message.SerializeToString())
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        assert fragment in (error.details() or ""), error.details()


def test_grpc_long_model_name_is_not_found_with_a_short_message(gateway: GatewayProc) -> None:
    message = pb.ModelMetadataRequest(name="m" * 100_000).SerializeToString()
    error = _grpc(gateway, "ModelMetadata", message)
    assert error.code() == grpc.StatusCode.NOT_FOUND, error
    assert "mmm…" in (error.details() or "") and len(error.details() or "") < 600
