"""The gateway's gRPC door, driven by Triton's own client (tritonclient.grpc and its
asyncio twin) against a real gateway process, broker and worker on loopback.

The `add` model (tests/fn_worker.py): x, y FP32 [-1, 8] -> z = x + 2y; `echo`: x UINT8
[-1, 4] -> y = x. Results are checked against numpy. Our generated messages and
tritonclient's are imported side by side here, which is itself the proof that the two
registries (`ipuserve.oip` and `inference`) do not collide.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from ipuserve.gateway.proto import inference_pb2 as pb
from tests.helpers import (
    BrokerProc,
    Processes,
    add_expected,
    add_inputs,
    fn_worker_argv,
    start_broker,
    start_worker,
    wait_until,
)

grpcclient = pytest.importorskip("tritonclient.grpc")
grpcclient_aio = pytest.importorskip("tritonclient.grpc.aio")
from tritonclient.utils import InferenceServerException  # noqa: E402

GATEWAY = Path(__file__).with_name("grpc_gateway.py")
LISTENING = r"gateway gRPC listening on (\S+):(\d+) \((TLS|plaintext)\)"
#: the plain gateway's body limit: small, so the oversized test sends little
MAX_BODY = 1 << 20
ECHO_BYTES = 4
INFER_PATH = "/inference.GRPCInferenceService/ModelInfer"
ALIAS_PATH = "/ipuserve.oip.GRPCInferenceService/ModelInfer"


def start_gateway(procs: Processes, broker: BrokerProc, *args: str) -> str:
    """A gateway process serving gRPC only; its HOST:PORT once it listens."""
    argv = [sys.executable, str(GATEWAY), "--broker", broker.frontend, *args]
    found = procs.start("gateway", argv).wait_for(LISTENING)
    return f"{found[1]}:{found[2]}"


@pytest.fixture(scope="module")
def fabric() -> Iterator[tuple[Processes, BrokerProc, str]]:
    """One broker, one worker serving `add` and `echo`, one gateway: shared by the
    module's tests, which only read from them."""
    procs = Processes()
    try:
        broker = start_broker(procs)
        argv = fn_worker_argv("add", "--model", "echo", "--echo-bytes", str(ECHO_BYTES))
        start_worker(procs, broker, argv)
        address = start_gateway(procs, broker, "--max-body-bytes", str(MAX_BODY))
        with grpcclient.InferenceServerClient(address) as triton:
            wait_until(triton.is_server_ready, timeout=30)  # its client reached the broker
        yield procs, broker, address
    finally:
        procs.close()
        print(f"--- output of the module's processes ---\n{procs.output()}")


@pytest.fixture
def gateway(fabric: tuple[Processes, BrokerProc, str]) -> str:
    return fabric[2]


@pytest.fixture
def client(gateway: str) -> Iterator[Any]:
    with grpcclient.InferenceServerClient(gateway) as triton:
        yield triton


def add_request(rows: int = 2, seed: int = 0) -> tuple[list[Any], dict[str, np.ndarray]]:
    given = add_inputs(rows=rows, seed=seed)
    inputs = []
    for name, array in given.items():
        tensor = grpcclient.InferInput(name, list(array.shape), "FP32")
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs, given


def refused(call: Any) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        call()
    return caught.value


# ---------------------------------------------------------------- health and metadata


def test_health(client: Any) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("add")
    assert client.is_model_ready("add", "1")
    assert not client.is_model_ready("add", "2")
    assert not client.is_model_ready("nobody-serves-this")


def test_server_metadata(client: Any) -> None:
    meta = client.get_server_metadata(as_json=True)
    assert meta["name"] == "ipuserve"
    assert meta["version"]
    assert {"binary_tensor_data", "statistics"} <= set(meta["extensions"])


def test_model_metadata(client: Any) -> None:
    meta = client.get_model_metadata("add")
    assert meta.name == "add"
    assert list(meta.versions) == ["1"]
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [
        ("x", "FP32", [-1, 8]),
        ("y", "FP32", [-1, 8]),
    ]
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.outputs] == [("z", "FP32", [-1, 8])]


def test_model_metadata_of_an_unknown_model_is_not_found(client: Any) -> None:
    error = refused(lambda: client.get_model_metadata("nobody-serves-this"))
    assert error.status() == "StatusCode.NOT_FOUND"
    assert "nobody-serves-this" in error.message()


# ---------------------------------------------------------------- inference


def test_infer_raw_contents(client: Any) -> None:
    inputs, given = add_request(rows=3, seed=1)
    result = client.infer(
        "add", inputs, request_id="req-42", outputs=[grpcclient.InferRequestedOutput("z")]
    )
    np.testing.assert_allclose(result.as_numpy("z"), add_expected(given), rtol=1e-6)
    response = result.get_response()
    assert response.id == "req-42"
    assert (response.model_name, response.model_version) == ("add", "1")
    assert [o.name for o in response.outputs] == ["z"]


def test_infer_many_with_the_asyncio_client(gateway: str) -> None:
    async def run() -> None:
        async with grpcclient_aio.InferenceServerClient(gateway) as triton:
            requests = [add_request(rows=1 + i % 4, seed=i) for i in range(24)]
            results = await asyncio.gather(
                *(
                    triton.infer("add", inputs, request_id=str(i))
                    for i, (inputs, _) in enumerate(requests)
                )
            )
            for i, ((_, given), result) in enumerate(zip(requests, results, strict=True)):
                assert result.get_response().id == str(i)
                np.testing.assert_allclose(result.as_numpy("z"), add_expected(given), rtol=1e-6)
            assert await triton.is_server_ready()

    asyncio.run(run())


def test_infer_an_unknown_model_is_not_found(client: Any) -> None:
    inputs, _ = add_request()
    error = refused(lambda: client.infer("nobody-serves-this", inputs))
    assert error.status() == "StatusCode.NOT_FOUND"
    assert "no worker serves model 'nobody-serves-this'" in error.message()


def test_a_wrong_datatype_is_an_invalid_argument(client: Any) -> None:
    inputs, given = add_request()
    inputs[0] = grpcclient.InferInput("x", list(given["x"].shape), "FP64")
    inputs[0].set_data_from_numpy(given["x"].astype(np.float64))
    error = refused(lambda: client.infer("add", inputs))
    assert error.status() == "StatusCode.INVALID_ARGUMENT"
    assert "input 'x' of model 'add' must be FP32, got FP64" in error.message()


def test_a_wrong_shape_is_an_invalid_argument(client: Any) -> None:
    inputs, _ = add_request()
    inputs[1] = grpcclient.InferInput("y", [2, 7], "FP32")
    inputs[1].set_data_from_numpy(np.zeros((2, 7), np.float32))
    error = refused(lambda: client.infer("add", inputs))
    assert error.status() == "StatusCode.INVALID_ARGUMENT"
    assert "input 'y' of model 'add' must have shape [-1, 8]" in error.message()
    assert "got [2, 7]" in error.message()


def test_an_oversized_message_is_resource_exhausted(client: Any) -> None:
    rows = MAX_BODY // (8 * 4) + 1  # x alone is just over the limit
    inputs, _ = add_request(rows=rows)
    error = refused(lambda: client.infer("add", inputs))
    assert error.status() == "StatusCode.RESOURCE_EXHAUSTED"
    assert str(MAX_BODY) in error.message()
    assert client.is_server_live()  # and the gateway goes on


def test_the_timeout_parameter_bounds_the_request(
    fabric: tuple[Processes, BrokerProc, str], client: Any
) -> None:
    """tritonclient's `timeout=` (µs, a request parameter) is the fabric's deadline; a
    worker that takes 5 s makes the request fail DEADLINE_EXCEEDED from the gateway."""
    procs, broker, _ = fabric
    start_worker(procs, broker, fn_worker_argv("fail", "--delay-ms", "5000"))
    wait_until(lambda: bool(client.is_model_ready("fail")))  # the gateway heard of it
    tensor = grpcclient.InferInput("x", [1, 8], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 8), np.float32))
    error = refused(lambda: client.infer("fail", [tensor], timeout=300_000, client_timeout=20))
    assert error.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert "timeout of 300 ms" in error.message()  # the gateway's words, not the client's


def test_statistics(client: Any) -> None:
    inputs, _ = add_request(rows=2)
    before = client.get_inference_statistics("add", as_json=True)["model_stats"][0]
    for _ in range(3):
        client.infer("add", inputs)
    stats = client.get_inference_statistics("add", as_json=True)["model_stats"]
    assert [(s["name"], s["version"]) for s in stats] == [("add", "1")]
    success = stats[0]["inference_stats"]["success"]
    old = before["inference_stats"].get("success", {})
    assert int(success["count"]) - int(old.get("count", 0)) == 3
    assert int(success["ns"]) > int(old.get("ns", 0))
    assert int(stats[0]["inference_count"]) - int(before.get("inference_count", 0)) == 6
    everything = client.get_inference_statistics(as_json=True)["model_stats"]
    assert {"add", "echo"} <= {s["name"] for s in everything}
    error = refused(lambda: client.get_inference_statistics("nobody-serves-this"))
    assert error.status() == "StatusCode.NOT_FOUND"


# ---------------------------------------------------------------- typed contents


@pytest.fixture(params=[INFER_PATH, ALIAS_PATH], ids=["inference", "ipuserve.oip"])
def model_infer(gateway: str, request: pytest.FixtureRequest) -> Iterator[Any]:
    """ModelInfer through a bare grpc channel with our own messages, at the
    specification's path and at the one a client generated from our .proto calls."""
    with grpc.insecure_channel(gateway) as channel:
        yield channel.unary_unary(
            request.param,
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelInferResponse.FromString,
        )


def test_typed_contents_in_typed_contents_out(model_infer: Any) -> None:
    given = add_inputs(rows=2, seed=3)
    request = pb.ModelInferRequest(model_name="add", id="typed")
    for name, array in given.items():
        tensor = request.inputs.add(name=name, datatype="FP32", shape=array.shape)
        tensor.contents.fp32_contents.extend(array.ravel().tolist())
    response = model_infer(request, timeout=20)
    assert response.id == "typed"
    assert not response.raw_output_contents
    (out,) = response.outputs
    assert (out.name, out.datatype, list(out.shape)) == ("z", "FP32", [2, 8])
    got = np.array(out.contents.fp32_contents, np.float32).reshape(2, 8)
    np.testing.assert_allclose(got, add_expected(given), rtol=1e-6)


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


# ---------------------------------------------------------------- tokens and TLS


def test_tokens_guard_every_call_but_the_health_probes(
    fabric: tuple[Processes, BrokerProc, str], tmp_path: Path
) -> None:
    procs, broker, _ = fabric
    tokens = tmp_path / "infer.tokens"
    tokens.write_text("# the infer role\ns3cret-token\n")
    address = start_gateway(procs, broker, "--infer-tokens", str(tokens))
    inputs, given = add_request()
    with grpcclient.InferenceServerClient(address) as triton:
        assert triton.is_server_live()
        wait_until(triton.is_server_ready, timeout=30)  # open, like the HTTP health paths
        missing = refused(lambda: triton.infer("add", inputs))
        assert missing.status() == "StatusCode.UNAUTHENTICATED"
        assert "missing Authorization header" in missing.message()
        wrong = refused(lambda: triton.infer("add", inputs, headers={"authorization": "Bearer x"}))
        assert wrong.status() == "StatusCode.UNAUTHENTICATED"
        assert "unknown bearer token" in wrong.message()
        meta = refused(lambda: triton.get_model_metadata("add"))
        assert meta.status() == "StatusCode.UNAUTHENTICATED"
        good = {"authorization": "Bearer s3cret-token"}
        result = triton.infer("add", inputs, headers=good)
        np.testing.assert_allclose(result.as_numpy("z"), add_expected(given), rtol=1e-6)
        assert triton.is_model_ready("add", headers=good)


def _self_signed(folder: Path) -> tuple[Path, Path]:
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls(fabric: tuple[Processes, BrokerProc, str], tmp_path: Path) -> None:
    procs, broker, _ = fabric
    cert, key = _self_signed(tmp_path)
    address = start_gateway(procs, broker, "--tls-cert", str(cert), "--tls-key", str(key))
    port = address.rsplit(":", 1)[1]
    inputs, given = add_request()
    with grpcclient.InferenceServerClient(
        f"localhost:{port}", ssl=True, root_certificates=str(cert)
    ) as triton:
        result = triton.infer("add", inputs)
        np.testing.assert_allclose(result.as_numpy("z"), add_expected(given), rtol=1e-6)
    with grpcclient.InferenceServerClient(f"localhost:{port}") as plaintext:
        error = refused(lambda: plaintext.get_server_metadata(client_timeout=10))
        assert error.status() == "StatusCode.UNAVAILABLE"
