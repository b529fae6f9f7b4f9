"""The gateway's gRPC door, driven by Triton's own client (tritonclient.grpc and its
asyncio twin) against a real ``ipuserve gateway``, broker and workers on loopback
(tests/gateway/conftest.py): the example ``mlp`` and ``simple`` models, results checked
against their numpy references, plus a FunctionBackend ``echo`` (x UINT8 [-1, 4] -> y)
for the typed integer contents.

Our generated messages and tritonclient's are imported side by side here, which is
itself the proof that the two registries (``ipuserve.oip`` and ``inference``) do not
collide.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcclient_aio
from tritonclient.utils import InferenceServerException

from ipuserve.gateway.proto import inference_pb2 as pb
from tests.gateway.conftest import (
    Fabric,
    GatewayProc,
    gateway_argv,
    mlp_input,
    self_signed,
    start_gateway,
)
from tests.helpers import fn_worker_argv, start_worker, wait_until

pytestmark = pytest.mark.slow

ECHO_BYTES = 4
INFER_PATH = "/inference.GRPCInferenceService/ModelInfer"
ALIAS_PATH = "/ipuserve.oip.GRPCInferenceService/ModelInfer"
CLOSE = {"rtol": 1e-5, "atol": 1e-5}


def _ready(address: str, *models: str, **client: Any) -> None:
    """Wait until the gateway at ``address`` reached a broker and hears of ``models``."""
    with grpcclient.InferenceServerClient(address, **client) as triton:
        wait_until(triton.is_server_ready, timeout=30)
        for model in models:
            wait_until(lambda m=model: bool(triton.is_model_ready(m)), timeout=30)


@pytest.fixture(scope="module")
def address(fabric: Fabric, gateway: GatewayProc) -> str:
    """The module gateway's gRPC HOST:PORT, once it serves mlp, simple and echo."""
    argv = fn_worker_argv("echo", "--echo-bytes", str(ECHO_BYTES))
    start_worker(fabric.procs, fabric.broker, argv, name="worker-echo")
    assert gateway.grpc is not None
    _ready(gateway.grpc, "mlp", "simple", "echo")
    return gateway.grpc


@pytest.fixture
def client(address: str) -> Iterator[Any]:
    with grpcclient.InferenceServerClient(address) as triton:
        yield triton


def _input(name: str, array: np.ndarray[Any, Any]) -> Any:
    datatype = {"float32": "FP32", "float64": "FP64", "uint8": "UINT8"}[array.dtype.name]
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def refused(call: Any) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        call()
    return caught.value


# ---------------------------------------------------------------- health and metadata


def test_health(client: Any) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("mlp")
    assert client.is_model_ready("mlp", "1")
    assert not client.is_model_ready("mlp", "2")
    assert not client.is_model_ready("nobody-serves-this")


def test_server_metadata(client: Any) -> None:
    meta = client.get_server_metadata(as_json=True)
    assert meta["name"] == "ipuserve"
    assert meta["version"]
    assert {"binary_tensor_data", "statistics"} <= set(meta["extensions"])


def test_model_metadata(client: Any) -> None:
    meta = client.get_model_metadata("mlp")
    assert (meta.name, list(meta.versions), meta.platform) == ("mlp", ["1"], "ipuserve")
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [
        ("input", "FP32", [-1, 64])
    ]
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.outputs] == [
        ("logits", "FP32", [-1, 10]),
        ("probs", "FP32", [-1, 10]),
    ]
    assert client.get_model_metadata("mlp", "1") == meta


def test_what_is_not_served_is_unimplemented(client: Any) -> None:
    error = refused(lambda: client.get_system_shared_memory_status())
    assert error.status() == "StatusCode.UNIMPLEMENTED"


def test_model_metadata_of_an_unknown_model_is_not_found(client: Any) -> None:
    error = refused(lambda: client.get_model_metadata("nobody-serves-this"))
    assert error.status() == "StatusCode.NOT_FOUND"
    assert "nobody-serves-this" in error.message()
    version = refused(lambda: client.get_model_metadata("mlp", "2"))
    assert version.status() == "StatusCode.NOT_FOUND"
    assert "has no version '2'" in version.message()


# ---------------------------------------------------------------- inference


def test_infer_raw_contents_matches_numpy(fabric: Fabric, client: Any) -> None:
    mlp = fabric.models["mlp"]
    for samples in (1, 5, 16):
        x = mlp_input(samples, seed=samples)
        result = client.infer("mlp", [_input("input", x)], request_id=f"r{samples}")
        for name, want in mlp.reference({"input": x}).items():
            np.testing.assert_allclose(result.as_numpy(name), want, **CLOSE)
        response = result.get_response()
        assert response.id == f"r{samples}"
        assert (response.model_name, response.model_version) == ("mlp", "1")
        assert len(response.raw_output_contents) == 2


def test_requested_outputs_are_the_only_ones_sent(fabric: Fabric, client: Any) -> None:
    x = mlp_input(3, seed=9)
    result = client.infer(
        "mlp", [_input("input", x)], outputs=[grpcclient.InferRequestedOutput("probs")]
    )
    assert [o.name for o in result.get_response().outputs] == ["probs"]
    want = fabric.models["mlp"].reference({"input": x})["probs"]
    np.testing.assert_allclose(result.as_numpy("probs"), want, **CLOSE)
    assert result.as_numpy("logits") is None


def test_two_inputs_and_every_output_unasked(fabric: Fabric, client: Any) -> None:
    rng = np.random.default_rng(7)
    a, b = (rng.standard_normal((3, 4)).astype(np.float32) for _ in range(2))
    result = client.infer("simple", [_input("tensor_A", a), _input("tensor_B", b)])
    want = fabric.models["simple"].reference({"tensor_A": a, "tensor_B": b})
    np.testing.assert_allclose(result.as_numpy("output"), want["output"], **CLOSE)
    assert [o.name for o in result.get_response().outputs] == ["output"]  # all, unasked


def test_infer_many_with_the_asyncio_client(fabric: Fabric, address: str) -> None:
    mlp = fabric.models["mlp"]
    inputs = [mlp_input(1 + i % 4, seed=100 + i) for i in range(24)]

    async def run() -> list[Any]:
        async with grpcclient_aio.InferenceServerClient(address) as triton:
            assert await triton.is_server_ready()
            return await asyncio.gather(
                *(
                    triton.infer("mlp", [_input("input", x)], request_id=str(i))
                    for i, x in enumerate(inputs)
                )
            )

    results = asyncio.run(run())
    for i, (x, result) in enumerate(zip(inputs, results, strict=True)):
        assert result.get_response().id == str(i)
        want = mlp.reference({"input": x})["logits"]
        np.testing.assert_allclose(result.as_numpy("logits"), want, **CLOSE)


def test_infer_an_unknown_model_is_not_found(client: Any) -> None:
    error = refused(lambda: client.infer("nobody-serves-this", [_input("input", mlp_input(1))]))
    assert error.status() == "StatusCode.NOT_FOUND"
    assert "no worker serves model 'nobody-serves-this'" in error.message()


def test_a_wrong_datatype_is_an_invalid_argument(client: Any) -> None:
    x = mlp_input(1).astype(np.float64)
    error = refused(lambda: client.infer("mlp", [_input("input", x)]))
    assert error.status() == "StatusCode.INVALID_ARGUMENT"
    assert "input 'input' of model 'mlp' must be float32, got float64" in error.message()


def test_a_wrong_shape_is_an_invalid_argument(client: Any) -> None:
    x = np.zeros((2, 63), np.float32)
    error = refused(lambda: client.infer("mlp", [_input("input", x)]))
    assert error.status() == "StatusCode.INVALID_ARGUMENT"
    assert "input 'input' of model 'mlp' must have shape (16, 64)" in error.message()
    assert "got (2, 63)" in error.message()


def test_an_oversized_message_is_resource_exhausted(fabric: Fabric) -> None:
    limit = 1 << 20
    small = start_gateway(fabric.procs, fabric.broker, "--max-body-bytes", str(limit))
    assert small.grpc is not None
    x = mlp_input(limit // (64 * 4) + 1)  # just over the limit
    with grpcclient.InferenceServerClient(small.grpc) as triton:
        error = refused(lambda: triton.infer("mlp", [_input("input", x)]))
        assert error.status() == "StatusCode.RESOURCE_EXHAUSTED"
        assert str(limit) in error.message()  # grpcio: "larger than max (N vs. LIMIT)"
        assert triton.is_server_live()  # and the gateway goes on


def test_the_timeout_parameter_bounds_the_request(fabric: Fabric, client: Any) -> None:
    """tritonclient's ``timeout=`` (µs, a request parameter) is the fabric's deadline: a
    worker that takes 5 s makes the request fail DEADLINE_EXCEEDED from the gateway
    (the client's own deadline, 20 s, is far off)."""
    start_worker(fabric.procs, fabric.broker, fn_worker_argv("fail", "--delay-ms", "5000"))
    wait_until(lambda: bool(client.is_model_ready("fail")))  # the gateway heard of it
    tensor = grpcclient.InferInput("x", [1, 8], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 8), np.float32))
    error = refused(lambda: client.infer("fail", [tensor], timeout=300_000, client_timeout=20))
    assert error.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert "timeout of 300 ms" in error.message()  # the gateway's words, not the client's


def test_statistics(client: Any) -> None:
    x = mlp_input(2)
    before = client.get_inference_statistics("mlp", as_json=True)["model_stats"][0]
    for _ in range(3):
        client.infer("mlp", [_input("input", x)])
    stats = client.get_inference_statistics("mlp", as_json=True)["model_stats"]
    assert [(s["name"], s["version"]) for s in stats] == [("mlp", "1")]
    success = stats[0]["inference_stats"]["success"]
    old = before["inference_stats"].get("success", {})
    assert int(success["count"]) - int(old.get("count", 0)) == 3
    assert int(success["ns"]) > int(old.get("ns", 0))
    assert int(stats[0]["inference_count"]) - int(before.get("inference_count", 0)) == 6
    everything = client.get_inference_statistics(as_json=True)["model_stats"]
    assert {"mlp", "simple", "echo"} <= {s["name"] for s in everything}
    error = refused(lambda: client.get_inference_statistics("nobody-serves-this"))
    assert error.status() == "StatusCode.NOT_FOUND"


# ---------------------------------------------------------------- typed contents


@pytest.fixture(params=[INFER_PATH, ALIAS_PATH], ids=["inference", "ipuserve.oip"])
def model_infer(address: str, request: pytest.FixtureRequest) -> Iterator[Any]:
    """ModelInfer through a bare grpc channel with our own messages, at the
    specification's path and at the one a client generated from our .proto calls."""
    with grpc.insecure_channel(address) as channel:
        yield channel.unary_unary(
            request.param,
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelInferResponse.FromString,
        )


def test_typed_contents_in_typed_contents_out(fabric: Fabric, model_infer: Any) -> None:
    rng = np.random.default_rng(3)
    given = {
        name: rng.standard_normal((2, 4)).astype(np.float32) for name in ("tensor_A", "tensor_B")
    }
    request = pb.ModelInferRequest(model_name="simple", id="typed")
    for name, array in given.items():
        tensor = request.inputs.add(name=name, datatype="FP32", shape=array.shape)
        tensor.contents.fp32_contents.extend(array.ravel().tolist())
    response = model_infer(request, timeout=20)
    assert response.id == "typed"
    assert not response.raw_output_contents
    (out,) = response.outputs
    assert (out.name, out.datatype, list(out.shape)) == ("output", "FP32", [2, 4])
    got = np.array(out.contents.fp32_contents, np.float32).reshape(2, 4)
    want = fabric.models["simple"].reference(given)["output"]
    np.testing.assert_allclose(got, want, **CLOSE)


def test_typed_uint8_rides_uint_contents(model_infer: Any) -> None:
    request = pb.ModelInferRequest(model_name="echo")
    tensor = request.inputs.add(name="x", datatype="UINT8", shape=[2, ECHO_BYTES])
    tensor.contents.uint_contents.extend([0, 1, 2, 255, 7, 8, 9, 10])
    (out,) = model_infer(request, timeout=20).outputs
    assert out.datatype == "UINT8"
    assert list(out.contents.uint_contents) == [0, 1, 2, 255, 7, 8, 9, 10]


@pytest.mark.parametrize(
    ("datatype", "fill", "message"),
    [
        ("UINT8", lambda c: c.uint_contents.extend([1, 2, 3, 300] * 2), "x"),
        ("UINT8", lambda c: c.fp32_contents.extend([1.0] * 8), "contents.uint_contents"),
        ("UINT8", lambda c: c.uint_contents.extend([1, 2, 3]), "8 elements"),
        ("FP16", lambda c: None, "raw_input_contents"),
        ("BYTES", lambda c: c.bytes_contents.extend([b"ab"] * 8), "BYTES is not supported"),
    ],
    ids=["out-of-range", "wrong-field", "too-few", "fp16-typed", "bytes"],
)
def test_bad_typed_contents_are_invalid_arguments(
    model_infer: Any, datatype: str, fill: Any, message: str
) -> None:
    request = pb.ModelInferRequest(model_name="echo")
    tensor = request.inputs.add(name="x", datatype=datatype, shape=[2, ECHO_BYTES])
    fill(tensor.contents)
    with pytest.raises(grpc.RpcError) as caught:
        model_infer(request, timeout=20)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in caught.value.details()


def test_raw_contents_of_the_wrong_size_are_invalid(model_infer: Any) -> None:
    request = pb.ModelInferRequest(model_name="echo")
    request.inputs.add(name="x", datatype="UINT8", shape=[1, ECHO_BYTES])
    request.raw_input_contents.append(b"\x01\x02\x03")
    with pytest.raises(grpc.RpcError) as caught:
        model_infer(request, timeout=20)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "got 3" in caught.value.details()


def test_a_grpc_port_in_use_is_an_error_not_a_shared_port(
    fabric: Fabric, gateway: GatewayProc
) -> None:
    """grpcio sets SO_REUSEPORT by default, which would let a second gateway bind the
    same port and take half its connections; the gateway turns it off."""
    assert gateway.grpc is not None
    argv = gateway_argv(fabric.broker, "--grpc", gateway.grpc)  # the last --grpc wins
    second = fabric.procs.start("gateway-same-port", argv)
    found = second.wait_for(r"cannot serve gRPC on '\S+'|ipuserve gateway: http", timeout=60)
    assert found[0] == f"cannot serve gRPC on '{gateway.grpc}'"
    assert second.wait() != 0


# ---------------------------------------------------------------- tokens and TLS


def test_tokens_guard_every_call_but_the_health_probes(fabric: Fabric, tmp_path: Path) -> None:
    tokens = tmp_path / "infer.tokens"
    tokens.write_text("# the infer role\ns3cret-token\n")
    guarded = start_gateway(fabric.procs, fabric.broker, "--infer-tokens", str(tokens))
    assert guarded.grpc is not None
    x = mlp_input(2, seed=5)
    inputs = [_input("input", x)]
    with grpcclient.InferenceServerClient(guarded.grpc) as triton:
        assert triton.is_server_live()
        wait_until(triton.is_server_ready, timeout=30)  # open, like the HTTP health paths
        missing = refused(lambda: triton.infer("mlp", inputs))
        assert missing.status() == "StatusCode.UNAUTHENTICATED"
        assert "missing Authorization header" in missing.message()
        wrong = refused(lambda: triton.infer("mlp", inputs, headers={"authorization": "Bearer x"}))
        assert wrong.status() == "StatusCode.UNAUTHENTICATED"
        assert "unknown bearer token" in wrong.message()
        for call in (triton.get_model_metadata, triton.is_model_ready):
            assert refused(lambda c=call: c("mlp")).status() == "StatusCode.UNAUTHENTICATED"
        good = {"authorization": "Bearer s3cret-token"}
        result = triton.infer("mlp", inputs, headers=good)
        want = fabric.models["mlp"].reference({"input": x})["logits"]
        np.testing.assert_allclose(result.as_numpy("logits"), want, **CLOSE)
        assert triton.is_model_ready("mlp", headers=good)


def test_tls(fabric: Fabric, tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    tls = start_gateway(fabric.procs, fabric.broker, "--tls-cert", str(cert), "--tls-key", str(key))
    assert tls.grpc is not None
    port = tls.grpc.rsplit(":", 1)[1]
    x = mlp_input(3, seed=11)
    with grpcclient.InferenceServerClient(
        f"localhost:{port}", ssl=True, root_certificates=str(cert)
    ) as triton:
        result = triton.infer("mlp", [_input("input", x)], client_timeout=30)
        want = fabric.models["mlp"].reference({"input": x})["logits"]
        np.testing.assert_allclose(result.as_numpy("logits"), want, **CLOSE)
    with grpcclient.InferenceServerClient(f"localhost:{port}") as plaintext:
        error = refused(lambda: plaintext.get_server_metadata(client_timeout=10))
        assert error.status() == "StatusCode.UNAVAILABLE"
