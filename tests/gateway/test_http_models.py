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
