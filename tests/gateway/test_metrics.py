"""The gateway's statistics and ``/metrics``, in one process and across several.

In one process the counters are read back exactly as recorded. Two real gateway
processes sharing a ``PROMETHEUS_MULTIPROC_DIR`` (as ``--processes N``'s children do)
answer for each other: statistics read from either, over HTTP or gRPC, count the
requests both served, and still count a process killed -9. ``/metrics`` parses as
Prometheus text, counts inference calls by door, model and status, needs the infer
token when tokens are configured, and counts the refusals by door.
"""

from __future__ import annotations

import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from ipuserve.client import Timing
from ipuserve.errors import ConfigError
from ipuserve.gateway.metrics import MULTIPROC_ENV, multiprocess_dir
from ipuserve.gateway.stats import Duration, Statistics
from tests.gateway.conftest import (
    Fabric,
    GatewayProc,
    gateway_argv,
    mlp_input,
    start_gateway,
    started_gateway,
    wait_ready,
)

TOKEN = "metrics-test-token"
REQUESTS = "ipuserve_gateway_requests_total"
REFUSALS = "ipuserve_gateway_token_refusals_total"
INFERENCES = "ipuserve_gateway_inference_requests_total"

Page = dict[tuple[str, frozenset[tuple[str, str]]], float]


# ---------------------------------------------------------------- in one process


def test_statistics_read_back_what_was_recorded() -> None:
    stats = Statistics()  # this test process has no PROMETHEUS_MULTIPROC_DIR
    timing = Timing(
        total_us=900.0, broker_queue_us=10.0, worker_queue_us=30.0, device_us=200.0, worker_us=500.0
    )
    before_ms = int(time.time() * 1e3)
    stats.succeeded("m", "1", 4, 0.002, timing)
    stats.succeeded("m", "1", 2, 0.003, timing)
    stats.failed("m", "1", 0.001)
    stats.failed("m", "2", 0.5)
    snapshot = stats.snapshot()
    one = snapshot.of_version("m", "1")
    assert (one.name, one.version) == ("m", "1")
    assert (one.inference_count, one.execution_count) == (6, 2)
    assert one.success == Duration(2, 5_000_000)
    assert one.fail == Duration(1, 1_000_000)
    assert one.queue == Duration(2, 80_000)  # (10 + 30) µs twice
    assert one.compute_input == Duration(2, 540_000)  # (500 - 30 - 200) µs twice
    assert one.compute_infer == Duration(2, 400_000)
    assert one.compute_output == Duration(2, 0)
    assert before_ms <= one.last_inference_ms <= int(time.time() * 1e3)
    two = snapshot.of_version("m", "2")
    assert two.fail == Duration(1, 500_000_000)
    assert (two.execution_count, two.success) == (0, Duration(0, 0))
    assert snapshot.names() == ["m"] and sorted(snapshot.versions("m")) == ["1", "2"]
    never = snapshot.of_version("other", "1")
    assert (never.execution_count, never.fail.count, never.last_inference_ms) == (0, 0, 0)
    # the same counts, as the page shows them
    assert stats.metrics.value(INFERENCES, model="m", version="1", outcome="success") == 2


def test_a_multiprocess_dir_the_library_does_not_use_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """This process imported prometheus_client without the variable: setting it now
    would leave the counts in the process, so it is refused rather than half-obeyed."""
    monkeypatch.setenv(MULTIPROC_ENV, str(tmp_path))
    with pytest.raises(ConfigError, match="set after prometheus_client was imported"):
        multiprocess_dir()
    monkeypatch.setenv(MULTIPROC_ENV, str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="is not a directory"):
        multiprocess_dir()
    monkeypatch.delenv(MULTIPROC_ENV)
    assert multiprocess_dir() is None


# ---------------------------------------------------------------- real processes


def _get(url: str, token: str | None = None) -> tuple[int, str]:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read().decode()


def _page(gateway: GatewayProc, token: str | None = None) -> Page:
    """``/metrics`` parsed by prometheus-client's own parser."""
    status, text = _get(gateway.url + "/metrics", token)
    assert status == 200, text
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _value(page: Page, name: str, **labels: str) -> float:
    """The sum of the page's ``name`` samples whose labels include ``labels``."""
    wanted = set(labels.items())
    return sum(v for (n, have), v in page.items() if n == name and wanted <= have)


def _http_infer(client: Any, fabric: Fabric, samples: int, seed: int, **kwargs: Any) -> None:
    x = mlp_input(samples, seed)
    tensor = httpclient.InferInput("input", [samples, 64], "FP32")
    tensor.set_data_from_numpy(x, binary_data=True)
    result = client.infer("mlp", [tensor], **kwargs)
    want = fabric.models["mlp"].reference({"input": x})["probs"]
    np.testing.assert_allclose(result.as_numpy("probs"), want, rtol=1e-5, atol=1e-5)


def _grpc_infer(client: Any, fabric: Fabric, x: np.ndarray[Any, Any], **kwargs: Any) -> None:
    tensor = grpcclient.InferInput("input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    result = client.infer("mlp", [tensor], **kwargs)
    want = fabric.models["mlp"].reference({"input": x})["probs"]
    np.testing.assert_allclose(result.as_numpy("probs"), want, rtol=1e-5, atol=1e-5)


def _auth() -> dict[str, str]:
    """A fresh header dict each call: tritonclient's HTTP client adds its own to it."""
    return {"authorization": f"Bearer {TOKEN}"}  # gRPC metadata keys are lower case


def _refused(call: Any) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        call()
    return caught.value


def _mlp_http_stats(gateway: GatewayProc) -> dict[str, Any]:
    with httpclient.InferenceServerClient(gateway.host_port, network_timeout=60.0) as client:
        [stats] = client.get_inference_statistics("mlp")["model_stats"]
    return dict(stats)


def _mlp_grpc_stats(gateway: GatewayProc) -> dict[str, Any]:
    assert gateway.grpc is not None
    with grpcclient.InferenceServerClient(gateway.grpc) as client:
        [stats] = client.get_inference_statistics("mlp", as_json=True)["model_stats"]
    return dict(stats)


def _counts(stats: dict[str, Any]) -> tuple[int, int, int, int]:
    """(success count, execution_count, inference_count, fail count); gRPC's JSON
    writes 64-bit integers as strings and leaves zeros out."""
    inference = stats["inference_stats"]
    return (
        int(inference.get("success", {}).get("count", 0)),
        int(stats.get("execution_count", 0)),
        int(stats.get("inference_count", 0)),
        int(inference.get("fail", {}).get("count", 0)),
    )


@pytest.mark.slow
def test_two_gateway_processes_answer_for_each_other(fabric: Fabric, tmp_path: Path) -> None:
    shared = tmp_path / "prometheus"
    shared.mkdir()
    env = {MULTIPROC_ENV: str(shared)}
    argv = gateway_argv(fabric.broker)
    a = started_gateway(fabric.procs.start("gateway-a", argv, env), argv)
    b = started_gateway(fabric.procs.start("gateway-b", argv, env), argv)
    wait_ready(a)
    wait_ready(b)
    k, through_b = 5, 3  # requests through A (HTTP, 2 samples) and B (gRPC, 3 samples)
    with httpclient.InferenceServerClient(a.host_port, network_timeout=60.0) as client:
        for i in range(k):
            _http_infer(client, fabric, 2, seed=i)
    assert b.grpc is not None
    b_began_ms = int(time.time() * 1e3)  # after A's last request
    with grpcclient.InferenceServerClient(b.grpc) as client:
        for i in range(through_b):
            _grpc_infer(client, fabric, mlp_input(3, seed=10 + i))
        wrong = _refused(lambda: _grpc_infer(client, fabric, np.zeros((1, 63), np.float32)))
        assert wrong.status() == "StatusCode.INVALID_ARGUMENT"
    want = (k + through_b, k + through_b, 2 * k + 3 * through_b, 1)
    assert _counts(_mlp_http_stats(a)) == want
    assert _counts(_mlp_grpc_stats(a)) == want
    assert _counts(_mlp_http_stats(b)) == want
    assert _counts(_mlp_grpc_stats(b)) == want
    assert _mlp_http_stats(a)["last_inference"] >= b_began_ms  # B's, the latest of all
    page = _page(a)  # A's page shows B's calls too
    assert _value(page, REQUESTS, door="http", model="mlp", code="200") == k
    assert _value(page, REQUESTS, door="grpc", model="mlp", code="OK") == through_b
    assert _value(page, REQUESTS, door="grpc", model="mlp", code="INVALID_ARGUMENT") == 1
    assert _value(page, INFERENCES, model="mlp", version="1", outcome="success") == want[0]

    b.proc.kill()  # kill -9: what B counted stays counted
    assert _counts(_mlp_http_stats(a)) == want
    assert _counts(_mlp_grpc_stats(a)) == want
    with httpclient.InferenceServerClient(a.host_port, network_timeout=60.0) as client:
        _http_infer(client, fabric, 1, seed=99)
    success, executions, samples, failures = _counts(_mlp_http_stats(a))
    assert (success, executions, samples, failures) == (want[0] + 1, want[1] + 1, want[2] + 1, 1)


@pytest.mark.slow
def test_metrics_page_needs_the_token_and_counts_calls_and_refusals(
    fabric: Fabric, tmp_path: Path
) -> None:
    tokens = tmp_path / "infer.tokens"
    tokens.write_text(f"{TOKEN}\n")
    gateway = start_gateway(
        fabric.procs, fabric.broker, "--infer-tokens", str(tokens), name="gateway-metrics"
    )
    wait_ready(gateway)  # the probe needs no token: nothing refused yet
    with httpclient.InferenceServerClient(gateway.host_port, network_timeout=60.0) as client:
        for i in range(3):
            _http_infer(client, fabric, 1, seed=i, headers=_auth())
        bad = httpclient.InferInput("input", [1, 63], "FP32")
        bad.set_data_from_numpy(np.zeros((1, 63), np.float32))
        assert _refused(lambda: client.infer("mlp", [bad], headers=_auth())).status() == "400"
    assert gateway.grpc is not None
    with grpcclient.InferenceServerClient(gateway.grpc) as client:
        for i in range(2):
            _grpc_infer(client, fabric, mlp_input(2, seed=i), headers=_auth())
    before = _page(gateway, TOKEN)
    assert _value(before, REFUSALS, door="http") == 0
    assert _value(before, REFUSALS, door="grpc") == 0

    status, text = _get(gateway.url + "/metrics")  # no token: refused, and counted
    assert status == 401 and "missing Authorization header" in text
    assert _get(gateway.url + "/metrics", "wrong-token")[0] == 401
    with httpclient.InferenceServerClient(gateway.host_port, network_timeout=60.0) as client:
        assert _refused(lambda: _http_infer(client, fabric, 1, seed=0)).status() == "401"
    with grpcclient.InferenceServerClient(gateway.grpc) as client:
        error = _refused(lambda: _grpc_infer(client, fabric, mlp_input(1)))
        assert error.status() == "StatusCode.UNAUTHENTICATED"

    page = _page(gateway, TOKEN)
    assert _value(page, REFUSALS, door="http") == 3
    assert _value(page, REFUSALS, door="grpc") == 1
    assert _value(page, REQUESTS, door="http", model="mlp", code="200") == 3
    assert _value(page, REQUESTS, door="http", model="mlp", code="400") == 1
    assert _value(page, REQUESTS, door="http", model="mlp", code="401") == 1
    assert _value(page, REQUESTS, door="grpc", model="mlp", code="OK") == 2
    # the gRPC door refuses a call without a token before it reads the message, so the
    # model it names is never known: counted under model=""
    assert _value(page, REQUESTS, door="grpc", model="", code="UNAUTHENTICATED") == 1
    # the statistics extension's counters are on the page too
    assert _value(page, INFERENCES, model="mlp", version="1", outcome="success") == 5
    assert _value(page, INFERENCES, model="mlp", version="1", outcome="fail") == 1
    assert _value(page, "ipuserve_gateway_inference_samples_total", model="mlp") == 7
    gateway.proc.terminate()
    assert gateway.proc.wait() == 0
    assert "refused 4 calls without a valid token" in gateway.proc.output()


@pytest.mark.slow
def test_a_made_up_model_name_adds_no_series(fabric: Fabric) -> None:
    gateway = start_gateway(fabric.procs, fabric.broker, name="gateway-made-up")
    wait_ready(gateway)
    with httpclient.InferenceServerClient(gateway.host_port, network_timeout=60.0) as client:
        tensor = httpclient.InferInput("input", [1, 64], "FP32")
        tensor.set_data_from_numpy(mlp_input(1))
        for name in ("made-up-1", "made-up-2"):
            assert _refused(lambda n=name: client.infer(n, [tensor])).status() == "404"
    page = _page(gateway)
    assert _value(page, REQUESTS, door="http", model="", code="404") == 2
    assert not [labels for (_n, labels) in page if ("model", "made-up-1") in labels]


def test_an_unusable_multiprocess_dir_stops_the_gateway(fabric: Fabric, tmp_path: Path) -> None:
    argv = gateway_argv(fabric.broker)
    env = {MULTIPROC_ENV: str(tmp_path / "missing")}
    refused = subprocess.run(
        argv, capture_output=True, text=True, timeout=60, env={**os.environ, **env}
    )
    assert refused.returncode != 0
    assert "is not a directory" in refused.stderr, refused.stderr
