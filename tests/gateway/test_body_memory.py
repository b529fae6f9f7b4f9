"""A request costs what its tensors cost: hostile bodies against a real gateway
process, whose peak resident size (``VmHWM``) is read from /proc before and after.

Each case runs on a fresh gateway, beside an honest client whose answer is checked
against the model's numpy reference. The bound is the issue's (3x the tensor bytes the
request declares, plus 32 MiB, never 256 MiB) plus the bytes the gateway must hold to
read the request at all: the body as sent (HTTP), or what grpcio holds of a message
while it receives it (gRPC), both bounded by --max-body-bytes.
"""

from __future__ import annotations

import gzip
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.http as httpclient

from ipuserve.gateway.proto import inference_pb2 as pb
from tests.gateway.conftest import Fabric, GatewayProc, mlp_input, start_gateway, wait_ready

pytestmark = pytest.mark.slow

MIB = 1 << 20
#: the declared tensor of every case: the mlp's [1, 64] FP32
DECLARED = 64 * 4


def _peak(gateway: GatewayProc) -> int:
    for line in Path(f"/proc/{gateway.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc")  # pragma: no cover


def _honest(fabric: Fabric, gateway: GatewayProc) -> None:
    x = mlp_input(2, seed=7)
    client = httpclient.InferenceServerClient(gateway.host_port, network_timeout=120.0)
    given = httpclient.InferInput("input", list(x.shape), "FP32")
    given.set_data_from_numpy(x)
    result = client.infer("mlp", [given])
    want = fabric.models["mlp"].reference({"input": x})["probs"]
    np.testing.assert_allclose(result.as_numpy("probs"), want, rtol=1e-5)


def _http(gateway: GatewayProc, body: bytes, **headers: str) -> tuple[int, str]:
    url = gateway.url + "/v2/models/mlp/infer"
    request = urllib.request.Request(url, body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, ""
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())["error"]


def _nested_gzip_bomb() -> tuple[bytes, dict[str, str]]:
    rows = b"[" + b",".join([b"[0]"] * (60 * MIB // 4)) + b"]"
    body = b'{"inputs":[{"name":"input","datatype":"FP32","shape":[1,64],"data":' + rows + b"}]}"
    return gzip.compress(body, 9), {"Content-Encoding": "gzip"}


def _flat_list() -> tuple[bytes, dict[str, str]]:
    data = b"[" + b"0," * (30 * MIB) + b"0]"
    body = b'{"inputs":[{"name":"input","datatype":"FP32","shape":[1,64],"data":' + data + b"}]}"
    return body, {}


def _grpc_bools(gateway: GatewayProc) -> tuple[int, str]:
    msg = pb.ModelInferRequest(model_name="mlp")
    tensor = msg.inputs.add(name="input", datatype="BOOL", shape=[1, 64])
    tensor.contents.bool_contents.extend(np.zeros(66_000_000, dtype=bool).tolist())
    raw = msg.SerializeToString()
    del msg, tensor
    assert gateway.grpc is not None
    with grpc.insecure_channel(
        gateway.grpc, options=[("grpc.max_send_message_length", -1)]
    ) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        try:
            call(raw, timeout=120)
        except grpc.RpcError as exc:
            return len(raw), f"{exc.code().name}: {exc.details()}"  # type: ignore[attr-defined]
    return len(raw), "OK"


def _measured(
    fabric: Fabric, send: Callable[[GatewayProc], tuple[int, str]]
) -> tuple[int, str, int]:
    """(peak rise, answer, bytes received) of ``send`` on a fresh gateway, with an
    honest client served beside it."""
    gateway = start_gateway(fabric.procs, fabric.broker, name="gateway-memory")
    try:
        wait_ready(gateway)
        _honest(fabric, gateway)  # everything imported and warm
        before = _peak(gateway)
        answers: list[tuple[int, str]] = []
        hostile = threading.Thread(target=lambda: answers.append(send(gateway)))
        hostile.start()
        _honest(fabric, gateway)
        hostile.join()
        _honest(fabric, gateway)
        rise = _peak(gateway) - before
        [(size, answer)] = answers
        print(f"peak RSS rise {rise / MIB:.1f} MiB for {size} bytes received: {answer[:120]}")
        return rise, answer, size
    finally:
        gateway.proc.terminate()
        gateway.proc.wait()


def _within(rise: int, received: int) -> None:
    assert rise <= min(256 * MIB, received + 3 * DECLARED + 32 * MIB), (rise, received)


def test_a_nested_json_gzip_bomb_costs_little(fabric: Fabric) -> None:
    body, headers = _nested_gzip_bomb()

    def send(gateway: GatewayProc) -> tuple[int, str]:
        status, error = _http(gateway, body, **headers)
        return len(body), f"{status} {error}"

    rise, answer, size = _measured(fabric, send)
    assert answer.startswith("413 ") and "compression bomb" in answer, answer
    _within(rise, size)


def test_a_flat_list_longer_than_its_shape_costs_its_body(fabric: Fabric) -> None:
    body, headers = _flat_list()

    def send(gateway: GatewayProc) -> tuple[int, str]:
        status, error = _http(gateway, body, **headers)
        return len(body), f"{status} {error}"

    rise, answer, size = _measured(fabric, send)
    assert answer.startswith("400 ") and "holds 64 elements, data has" in answer, answer
    _within(rise, size)


def test_66m_typed_bools_over_grpc_cost_their_message(fabric: Fabric) -> None:
    rise, answer, size = _measured(fabric, _grpc_bools)
    assert answer.startswith("INVALID_ARGUMENT") and "holds 64 elements" in answer, answer
    # grpcio holds a message about three times over as it hands it to Python (its
    # slices, their join, the bytes); the gateway adds nothing that grows with it
    _within(rise, 3 * size)
