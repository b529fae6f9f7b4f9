"""The gateway's picture of the fleet follows it: a model whose worker starts after the
gateway is served (the miss asks the fabric), and one whose worker stops is no longer
ready."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import numpy as np
import pytest

from tests.gateway.conftest import GatewayProc, start_gateway
from tests.helpers import (
    Processes,
    add_expected,
    add_inputs,
    fn_worker_argv,
    restart_broker,
    start_broker,
    start_worker,
    wait_until,
)

pytestmark = pytest.mark.slow


def _call(gateway: GatewayProc, path: str, body: bytes | None = None) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(gateway.url + path, body, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


def test_models_come_and_go(processes: Processes) -> None:
    broker = start_broker(processes, metrics=False)
    gateway = start_gateway(processes, broker)
    inputs = add_inputs(rows=3, seed=8)
    body = json.dumps({"inputs": [
        {"name": n, "datatype": "FP32", "shape": list(a.shape), "data": a.ravel().tolist()}
        for n, a in inputs.items()
    ]}).encode()  # fmt: skip
    status, answer = _call(gateway, "/v2/models/add/infer", body)
    assert status == 404 and "no worker serves model 'add'" in answer["error"]

    worker = start_worker(processes, broker, fn_worker_argv("add"))
    wait_until(lambda: _call(gateway, "/v2/models/add/ready")[0] == 200, timeout=60)
    status, answer = _call(gateway, "/v2/models/add/infer", body)
    assert status == 200, answer
    [z] = answer["outputs"]
    got = np.array(z["data"], np.float32).reshape(z["shape"])
    np.testing.assert_allclose(got, add_expected(inputs), rtol=1e-6)

    worker.kill()
    wait_until(lambda: _call(gateway, "/v2/models/add/ready")[0] == 503, timeout=60)


def test_a_model_served_moments_ago_is_unavailable_not_unknown(processes: Processes) -> None:
    """A broker restarted (kill -9) knows no model until the workers are back, and says
    UNKNOWN_MODEL: the gateway, which saw the model served moments ago, answers 503
    (come back), not 404 (no such model)."""
    broker = start_broker(processes, metrics=False)
    worker = start_worker(processes, broker, fn_worker_argv("add"))
    gateway = start_gateway(processes, broker)
    inputs = add_inputs(rows=2, seed=9)
    body = json.dumps({"inputs": [
        {"name": n, "datatype": "FP32", "shape": list(a.shape), "data": a.ravel().tolist()}
        for n, a in inputs.items()
    ]}).encode()  # fmt: skip
    wait_until(lambda: _call(gateway, "/v2/models/add/ready")[0] == 200, timeout=60)
    status, answer = _call(gateway, "/v2/models/add/infer", body)
    assert status == 200, answer

    worker.kill()
    restart_broker(processes, broker)  # no start-up grace: it refuses unknown models
    status, answer = _call(gateway, "/v2/models/add/infer", body)
    assert status == 503, answer
    assert "no worker serves model 'add'" in answer["error"]
    assert "served moments ago" in answer["error"]
