"""The front door is as guarded as the fabric: bearer tokens on every call but the
probes (401 with what is wrong), loopback only without TLS unless --insecure, HTTPS
with a certificate made here."""

from __future__ import annotations

import asyncio
import json
import ssl
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.http.aio as aiohttpclient
from tritonclient.utils import InferenceServerException

from tests.gateway.conftest import (
    Fabric,
    GatewayProc,
    gateway_argv,
    mlp_input,
    self_signed,
    start_gateway,
    started_gateway,
    wait_ready,
)
from tests.helpers import Processes, runner_worker_argv, start_worker, wait_until, write_example
from tests.integration.test_curve import KeyDirs, start_curve_broker

pytestmark = pytest.mark.slow

TOKEN = "s3cret-infer-token"


def _get(url: str, headers: dict[str, str] | None = None, **kwargs: Any) -> tuple[int, Any]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=60, **kwargs) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


@pytest.fixture(scope="module")
def guarded(fabric: Fabric, tmp_path_factory: pytest.TempPathFactory) -> GatewayProc:
    tokens = tmp_path_factory.mktemp("tokens") / "infer.tokens"
    tokens.write_text(f"# the test's tokens\n\n{TOKEN}\nanother-token\n")
    started = start_gateway(fabric.procs, fabric.broker, "--infer-tokens", str(tokens))
    wait_ready(started)  # the probe needs no token
    return started


@pytest.mark.parametrize(
    ("authorization", "message"),
    [
        (None, "missing Authorization header"),
        ("Basic dXNlcjpwYXNz", "not a bearer token"),
        ("Bearer wrong-token", "unknown bearer token"),
    ],
    ids=["missing", "not-bearer", "unknown"],
)
def test_calls_without_a_valid_token_are_401(
    guarded: GatewayProc, authorization: str | None, message: str
) -> None:
    headers = {} if authorization is None else {"Authorization": authorization}
    for path in ("/v2", "/v2/models/mlp", "/v2/models/mlp/ready", "/v2/models/stats"):
        status, answer = _get(guarded.url + path, headers)
        assert status == 401 and message in answer["error"], (path, answer)
    with httpclient.InferenceServerClient(guarded.host_port) as client:
        tensor = httpclient.InferInput("input", [1, 64], "FP32")
        tensor.set_data_from_numpy(mlp_input(1))
        with pytest.raises(InferenceServerException) as caught:
            client.infer("mlp", [tensor], headers=headers)
        assert caught.value.status() == "401" and message in caught.value.message()


def test_probes_need_no_token_and_a_valid_token_is_served(
    fabric: Fabric, guarded: GatewayProc
) -> None:
    assert _get(guarded.url + "/v2/health/live")[0] == 200
    assert _get(guarded.url + "/v2/health/ready")[0] == 200
    with httpclient.InferenceServerClient(guarded.host_port) as client:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        x = mlp_input(3, seed=5)
        tensor = httpclient.InferInput("input", [3, 64], "FP32")
        tensor.set_data_from_numpy(x)
        result = client.infer("mlp", [tensor], headers=headers)
        want = fabric.models["mlp"].reference({"input": x})
        np.testing.assert_allclose(result.as_numpy("probs"), want["probs"], rtol=1e-5, atol=1e-5)
        assert client.get_model_metadata("mlp", headers={"Authorization": "Bearer another-token"})


@pytest.mark.parametrize("door", ["--http", "--grpc"])
def test_without_tls_only_loopback_unless_insecure(fabric: Fabric, door: str) -> None:
    argv = gateway_argv(fabric.broker)
    argv[argv.index(door) + 1] = "0.0.0.0:0"
    refused = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0
    assert f"{door} 0.0.0.0:0 is reachable from other hosts" in refused.stderr
    assert "--insecure" in refused.stderr and "--tls-cert" in refused.stderr
    insecure = start_gateway(
        fabric.procs, fabric.broker, door, "0.0.0.0:0", "--insecure", name="insecure"
    )  # the last --http / --grpc wins
    assert "security INSECURE plaintext" in insecure.proc.output()
    assert _get(insecure.url + "/v2/health/live")[0] == 200
    insecure.proc.terminate()
    assert insecure.proc.wait() == 0


def test_https_with_a_self_signed_certificate(fabric: Fabric, tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    gateway = start_gateway(
        fabric.procs, fabric.broker, "--tls-cert", str(cert), "--tls-key", str(key), name="tls"
    )
    assert gateway.url.startswith("https://") and "security TLS" in gateway.proc.output()
    trusting = ssl.create_default_context(cafile=str(cert))
    ready = lambda: _get(gateway.url + "/v2/health/ready", context=trusting)[0] == 200  # noqa: E731
    wait_until(ready, timeout=60)
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        _get(gateway.url + "/v2", context=ssl.create_default_context())  # not trusted
    plain = gateway.url.replace("https://", "http://")
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        _get(plain + "/v2")  # no plaintext on a TLS door
    x = mlp_input(4, seed=9)

    async def infer() -> np.ndarray[Any, Any]:
        # the asyncio client: the gevent one's TLS path trips Python's deprecation warnings
        client = aiohttpclient.InferenceServerClient(
            gateway.host_port, ssl=True, ssl_context=trusting
        )
        try:
            tensor = aiohttpclient.InferInput("input", [4, 64], "FP32")
            tensor.set_data_from_numpy(x, binary_data=True)
            result = await client.infer("mlp", [tensor])
            out: np.ndarray[Any, Any] = result.as_numpy("logits")
            return out
        finally:
            await client.close()

    want = fabric.models["mlp"].reference({"input": x})["logits"]
    np.testing.assert_allclose(asyncio.run(infer()), want, rtol=1e-5, atol=1e-5)


@pytest.fixture
def keys(tmp_path: Path) -> KeyDirs:
    """Keys made by ``ipuserve keys generate``, as tests/integration/test_curve.py does."""
    root = tmp_path / "keys"
    for folder in ("clients", "workers", "admins"):
        (root / folder).mkdir(parents=True)
    made = KeyDirs(root)
    made.generate("broker")
    for name, folder in (("client", "clients"), ("worker", "workers"), ("admin", "admins")):
        made.generate(name, into=folder)
    return made


def test_a_gateway_with_curve_keys_reaches_a_broker_with_keys(
    processes: Processes, keys: KeyDirs, tmp_path: Path
) -> None:
    """--curve-secret-key and --broker-public-key from their variables, as a
    deployment gives them; the model answers through the gateway (noop: output = input)."""
    model = write_example(tmp_path / "noop.popef", "noop", "--batch-size", "4", "--elements", "8")
    broker = start_curve_broker(processes, keys)
    worker_args = ("--name", "noop", *keys.peer_options("worker"))
    start_worker(processes, broker, runner_worker_argv(model, args=worker_args))
    env = {
        "IPUSERVE_GATEWAY_CURVE_SECRET_KEY": str(keys.secret("client")),
        "IPUSERVE_GATEWAY_BROKER_PUBLIC_KEY": str(keys.broker_public),
    }
    argv = gateway_argv(broker)
    proc = processes.start("gateway-curve", argv, env)
    gateway = started_gateway(proc, argv)
    given = np.random.default_rng(3).standard_normal((3, 8)).astype(np.float32)
    tensor = httpclient.InferInput("input", [3, 8], "FP32")
    tensor.set_data_from_numpy(given)
    with httpclient.InferenceServerClient(gateway.host_port, network_timeout=60) as client:
        result = client.infer("noop", [tensor])
    np.testing.assert_array_equal(result.as_numpy("output"), given)
