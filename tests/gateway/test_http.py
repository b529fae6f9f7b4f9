"""The HTTP door against Triton's own Python client (``tritonclient.http``, sync and
asyncio): health, metadata, JSON and binary infer checked against numpy, requested
outputs, the request id, statistics; and each refusal with its status and message."""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.http.aio as aiohttpclient
from tritonclient.utils import InferenceServerException

from tests.gateway.conftest import Fabric, GatewayProc, mlp_input
from tests.helpers import scrape, wait_until

pytestmark = pytest.mark.slow


_OPEN: list[httpclient.InferenceServerClient] = []


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    """The test's clients closed after it (an unclosed socket fails the run)."""
    yield
    while _OPEN:
        _OPEN.pop().close()


def _client(gateway: GatewayProc) -> httpclient.InferenceServerClient:
    client = httpclient.InferenceServerClient(gateway.host_port, network_timeout=60.0)
    _OPEN.append(client)
    return client


def _input(name: str, array: np.ndarray[Any, Any], *, binary: bool) -> httpclient.InferInput:
    datatype = {"float32": "FP32", "int32": "INT32", "float64": "FP64"}[array.dtype.name]
    tensor = httpclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


def _raw(
    gateway: GatewayProc, method: str, path: str, body: bytes | None = None, **headers: str
) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) of a plain HTTP call (no client library between)."""
    request = urllib.request.Request(gateway.url + path, body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


def test_health_and_server_metadata(gateway: GatewayProc) -> None:
    client = _client(gateway)
    assert client.is_server_live()
    assert client.is_server_ready()
    meta = client.get_server_metadata()
    assert meta["name"] == "ipuserve"
    assert {"binary_tensor_data", "statistics"} <= set(meta["extensions"])
    assert client.is_model_ready("mlp")
    assert client.is_model_ready("mlp", "1")
    assert not client.is_model_ready("nosuchmodel")
    assert not client.is_model_ready("mlp", "2")


def test_model_metadata_shows_the_batching_dimension_as_minus_one(gateway: GatewayProc) -> None:
    client = _client(gateway)
    meta = client.get_model_metadata("mlp")
    assert meta["name"] == "mlp" and meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 64]}]
    assert meta["outputs"] == [
        {"name": "logits", "datatype": "FP32", "shape": [-1, 10]},
        {"name": "probs", "datatype": "FP32", "shape": [-1, 10]},
    ]
    assert client.get_model_metadata("mlp", "1") == meta
    simple = client.get_model_metadata("simple")
    assert [t["name"] for t in simple["inputs"]] == ["tensor_A", "tensor_B"]


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_infer_matches_numpy(fabric: Fabric, gateway: GatewayProc, binary: bool) -> None:
    client = _client(gateway)
    mlp = fabric.models["mlp"]
    for samples in (1, 5, 16):
        x = mlp_input(samples, seed=samples)
        outputs = [
            httpclient.InferRequestedOutput(name, binary_data=binary)
            for name in ["logits", "probs"]
        ]
        result = client.infer(
            "mlp", [_input("input", x, binary=binary)], outputs=outputs, request_id=f"r{samples}"
        )
        for name, want in mlp.reference({"input": x}).items():
            np.testing.assert_allclose(result.as_numpy(name), want, rtol=1e-5, atol=1e-5)
        response = result.get_response()
        assert response["id"] == f"r{samples}"
        assert response["model_name"] == "mlp" and response["model_version"] == "1"


def test_infer_two_inputs_all_outputs_by_default_in_binary(
    fabric: Fabric, gateway: GatewayProc
) -> None:
    client = _client(gateway)
    rng = np.random.default_rng(7)
    a, b = (rng.standard_normal((3, 4)).astype(np.float32) for _ in range(2))
    # no outputs named: tritonclient asks for every output as binary data
    result = client.infer(
        "simple", [_input("tensor_A", a, binary=True), _input("tensor_B", b, binary=False)]
    )
    want = fabric.models["simple"].reference({"tensor_A": a, "tensor_B": b})
    for name, array in want.items():
        np.testing.assert_allclose(result.as_numpy(name), array, rtol=1e-5, atol=1e-5)


def test_requested_outputs_are_the_only_ones_sent(gateway: GatewayProc) -> None:
    body = {
        "inputs": [
            {"name": "input", "datatype": "FP32", "shape": [1, 64], "data": [0.5] * 64},
        ],
        "outputs": [{"name": "probs"}],
    }
    status, answer = _raw(gateway, "POST", "/v2/models/mlp/infer", json.dumps(body).encode())
    assert status == 200
    assert [o["name"] for o in answer["outputs"]] == ["probs"]
    body["outputs"] = [{"name": "nosuchoutput"}]
    status, answer = _raw(gateway, "POST", "/v2/models/mlp/infer", json.dumps(body).encode())
    assert status == 400 and "no output 'nosuchoutput'" in answer["error"]


def test_nested_json_data_is_row_major(fabric: Fabric, gateway: GatewayProc) -> None:
    x = mlp_input(2, seed=3)
    body = {
        "id": "nested",
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [2, 64], "data": x.tolist()}],
    }
    status, answer = _raw(gateway, "POST", "/v2/models/mlp/infer", json.dumps(body).encode())
    assert status == 200 and answer["id"] == "nested"
    want = fabric.models["mlp"].reference({"input": x})
    assert [o["name"] for o in answer["outputs"]] == sorted(want)
    for output in answer["outputs"]:
        got = np.array(output["data"], dtype=np.float32).reshape(output["shape"])
        np.testing.assert_allclose(got, want[output["name"]], rtol=1e-5, atol=1e-5)


def test_asyncio_client_infers_concurrently(fabric: Fabric, gateway: GatewayProc) -> None:
    mlp = fabric.models["mlp"]

    async def run() -> None:
        client = aiohttpclient.InferenceServerClient(gateway.host_port)
        try:
            assert await client.is_server_ready()
            inputs = [mlp_input(1 + i % 4, seed=100 + i) for i in range(24)]

            async def one(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
                tensor = aiohttpclient.InferInput("input", list(x.shape), "FP32")
                tensor.set_data_from_numpy(x, binary_data=True)
                result = await client.infer("mlp", [tensor])
                out: np.ndarray[Any, Any] = result.as_numpy("logits")
                return out

            results = await asyncio.gather(*(one(x) for x in inputs))
            for x, got in zip(inputs, results, strict=True):
                want = mlp.reference({"input": x})["logits"]
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        finally:
            await client.close()

    asyncio.run(run())


def test_statistics_count_what_was_served(gateway: GatewayProc) -> None:
    client = _client(gateway)
    before = client.get_inference_statistics("simple")["model_stats"][0]
    a = np.ones((2, 4), np.float32)
    client.infer("simple", [_input("tensor_A", a, binary=True), _input("tensor_B", a, binary=True)])
    [after] = client.get_inference_statistics("simple")["model_stats"]
    assert after["name"] == "simple" and after["version"] == "1"
    assert after["inference_count"] == before["inference_count"] + 2
    assert after["execution_count"] == before["execution_count"] + 1
    success = after["inference_stats"]["success"]
    assert success["count"] == before["inference_stats"]["success"]["count"] + 1
    assert success["ns"] > before["inference_stats"]["success"]["ns"]
    assert after["last_inference"] > 0
    assert client.get_inference_statistics("simple", "1")["model_stats"] == [after]
    every = client.get_inference_statistics()["model_stats"]
    assert {"mlp", "simple"} <= {s["name"] for s in every}


# ---------------------------------------------------------------- refusals


def _refused(call: Any) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        call()
    return caught.value


def test_unknown_model_is_404(gateway: GatewayProc) -> None:
    client = _client(gateway)
    x = mlp_input(1)
    error = _refused(lambda: client.infer("nosuchmodel", [_input("input", x, binary=True)]))
    assert error.status() == "404"
    assert "no worker serves model 'nosuchmodel'" in error.message()
    error = _refused(lambda: client.get_model_metadata("nosuchmodel"))
    assert error.status() == "404"
    error = _refused(lambda: client.get_model_metadata("mlp", "2"))
    assert error.status() == "404" and "no version '2'" in error.message()
    error = _refused(lambda: client.get_inference_statistics("nosuchmodel"))
    assert error.status() == "404"


def test_wrong_datatype_is_400(gateway: GatewayProc) -> None:
    client = _client(gateway)
    x = mlp_input(1).astype(np.float64)
    error = _refused(lambda: client.infer("mlp", [_input("input", x, binary=True)]))
    assert error.status() == "400"  # the broker's check, worded by it
    assert "input 'input' of model 'mlp' must be float32, got float64" in error.message()


def test_wrong_shape_is_400(gateway: GatewayProc) -> None:
    client = _client(gateway)
    x = np.zeros((2, 63), np.float32)
    error = _refused(lambda: client.infer("mlp", [_input("input", x, binary=False)]))
    assert error.status() == "400"
    assert (
        "input 'input' of model 'mlp' must have shape (16, 64) (dimension 0 may be any size "
        ">= 1), got (2, 63)" in error.message()
    )


def test_unknown_input_and_bytes_datatype_are_400(gateway: GatewayProc) -> None:
    client = _client(gateway)
    error = _refused(lambda: client.infer("mlp", [_input("x", mlp_input(1), binary=True)]))
    assert error.status() == "400"  # the broker's check: the misspelt name first
    assert "model 'mlp' has no input 'x'; its inputs are input (missing: input)" in error.message()
    body = {"inputs": [{"name": "input", "datatype": "BYTES", "shape": [1], "data": ["a"]}]}
    status, answer = _raw(gateway, "POST", "/v2/models/mlp/infer", json.dumps(body).encode())
    assert status == 400 and "BYTES is not supported" in answer["error"]


def test_an_input_given_twice_is_400(gateway: GatewayProc) -> None:
    """The one check of names the gateway keeps: its wire can name an input twice, the
    fabric's cannot carry it."""
    tensor = {"name": "input", "datatype": "FP32", "shape": [1, 64], "data": [0.0] * 64}
    body = json.dumps({"inputs": [tensor, tensor]}).encode()
    status, answer = _raw(gateway, "POST", "/v2/models/mlp/infer", body)
    assert status == 400
    assert answer["error"] == "input 'input' of model 'mlp' given twice: name each input once"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"inputs": [', "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'{"inputs": 3}', "inputs must be a JSON list"),
        (b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64]}]}', "neither data"),
        (
            b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": [1]}]}',
            "holds 64 elements, data has 1",
        ),
    ],
    ids=["truncated", "not-an-object", "inputs-not-a-list", "no-data", "short-data"],
)
def test_malformed_body_is_400(gateway: GatewayProc, body: bytes, message: str) -> None:
    status, answer = _raw(
        gateway, "POST", "/v2/models/mlp/infer", body, **{"Content-Type": "application/json"}
    )
    assert status == 400 and message in answer["error"], answer


def test_binary_sizes_that_do_not_add_up_are_400(gateway: GatewayProc) -> None:
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "datatype": "FP32",
                    "shape": [1, 64],
                    "parameters": {"binary_data_size": 256},
                }
            ]
        }
    ).encode()
    for extra, message in ((b"\0" * 255, "does not fit"), (b"\0" * 260, "4 bytes of binary data")):
        status, answer = _raw(
            gateway,
            "POST",
            "/v2/models/mlp/infer",
            header + extra,
            **{"Inference-Header-Content-Length": str(len(header))},
        )
        assert status == 400 and message in answer["error"], answer


def test_timeout_parameter_is_microseconds_and_checked(gateway: GatewayProc) -> None:
    body = {
        "parameters": {"timeout": -5},
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": [0.0] * 64}],
    }
    status, answer = _raw(gateway, "POST", "/v2/models/mlp/infer", json.dumps(body).encode())
    assert status == 400 and "parameters.timeout must be microseconds" in answer["error"]
    body["parameters"] = {"timeout": 30_000_000}
    status, _answer = _raw(gateway, "POST", "/v2/models/mlp/infer", json.dumps(body).encode())
    assert status == 200


def test_unknown_path_is_a_json_404(gateway: GatewayProc) -> None:
    status, answer = _raw(gateway, "GET", "/v2/nothing/here")
    assert status == 404 and "error" in answer


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_request_and_response(
    fabric: Fabric, gateway: GatewayProc, algorithm: str
) -> None:
    client = _client(gateway)
    x = mlp_input(3, seed=21)
    result = client.infer(
        "mlp",
        [_input("input", x, binary=True)],
        request_compression_algorithm=algorithm,
        response_compression_algorithm=algorithm,
    )
    want = fabric.models["mlp"].reference({"input": x})["logits"]
    np.testing.assert_allclose(result.as_numpy("logits"), want, rtol=1e-5, atol=1e-5)


def test_a_version_path_routes_to_that_version_and_the_reply_names_it(
    fabric: Fabric, gateway: GatewayProc
) -> None:
    x = mlp_input(3, seed=11)
    tensor = {"name": "input", "datatype": "FP32", "shape": [3, 64], "data": x.ravel().tolist()}
    body = json.dumps({"inputs": [tensor]}).encode()
    status, answer = _raw(gateway, "POST", "/v2/models/mlp/versions/1/infer", body)
    assert status == 200 and answer["model_version"] == "1"
    for output in answer["outputs"]:
        got = np.asarray(output["data"], np.float32).reshape(output["shape"])
        want = fabric.models["mlp"].reference({"input": x})[output["name"]]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    status, refused = _raw(gateway, "POST", "/v2/models/mlp/versions/2/infer", body)
    assert status == 404 and "model 'mlp' has no version 2 (versions: 1)" in refused["error"]


def test_the_server_lists_the_repository_extension(gateway: GatewayProc) -> None:
    status, meta = _raw(gateway, "GET", "/v2")
    assert status == 200 and "model_repository" in meta["extensions"]


# ---------------------------------------------------------------- manners


def _answered(gateway: GatewayProc, code: str) -> float:
    """HTTP inference calls of mlp the gateway counted with status ``code``."""
    labels = ('door="http"', 'model="mlp"', f'code="{code}"')
    return sum(
        value
        for key, value in scrape(gateway.url + "/metrics").items()
        if key.startswith("ipuserve_gateway_requests_total{") and all(x in key for x in labels)
    )


def test_a_client_hanging_up_mid_body_is_counted_as_499_not_500(gateway: GatewayProc) -> None:
    """aiohttp raises ConnectionResetError in the handler's read when the client
    leaves: a hang-up (nginx's and Triton's 499), not an error of ours, and no
    traceback in the log."""
    before = {code: _answered(gateway, code) for code in ("499", "500")}
    since = len(gateway.proc.lines)
    host, port = gateway.host_port.rsplit(":", 1)
    body = json.dumps(
        {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": [0.5] * 64}]}
    ).encode()
    head = (
        f"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: {host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head + body[: len(body) // 2])
    wait_until(lambda: _answered(gateway, "499") == before["499"] + 1, timeout=30)
    assert _answered(gateway, "500") == before["500"]
    logged = "\n".join(gateway.proc.lines[since:])
    assert "Traceback" not in logged and "unexpected error" not in logged, logged


def test_the_server_header_names_ipuserve_only(gateway: GatewayProc) -> None:
    for path, status in (("/v2/health/live", 200), ("/v2", 200), ("/v2/nothing/here", 404)):
        request = urllib.request.Request(gateway.url + path)
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                got, server = response.status, response.headers["Server"]
        except urllib.error.HTTPError as exc:
            with exc:
                got, server = exc.code, exc.headers["Server"]
        assert (got, server) == (status, "ipuserve"), path


def test_a_malformed_request_is_a_400_logged_in_one_line_without_a_traceback(
    gateway: GatewayProc,
) -> None:
    """aiohttp's parser refuses it before any route; its log is the gateway's INFO line."""
    since = len(gateway.proc.lines)
    host, port = gateway.host_port.rsplit(":", 1)
    head = f"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: {host}\r\nContent-Length: 1_2\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode())
        answer = sock.makefile("rb").readline()
    assert answer.split()[1] == b"400", answer
    line = gateway.proc.wait_for(r"refused a malformed request \(400\): (.*)", since=since)
    assert "Content-Length" in line[1]
    logged = "\n".join(gateway.proc.lines[since:])
    assert "Traceback" not in logged and "Error handling request" not in logged, logged
