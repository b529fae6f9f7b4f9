"""``ipuserve gateway`` as a command: its variables, usage errors, a clean stop that
answers what is under way; and a model that raises, through it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import urllib.request
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.gateway.conftest import gateway_argv, start_gateway
from tests.helpers import (
    Processes,
    add_expected,
    add_inputs,
    fn_worker_argv,
    start_broker,
    start_worker,
)

pytestmark = pytest.mark.slow


def test_options_are_read_from_their_variables(processes: Processes) -> None:
    broker = start_broker(processes, metrics=False)
    argv = gateway_argv(broker)
    del argv[argv.index("--http") : argv.index("--http") + 2]
    env = {**os.environ, "IPUSERVE_GATEWAY_HTTP": "0.0.0.0:0"}
    refused = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert refused.returncode != 0 and "--http 0.0.0.0:0 is reachable" in refused.stderr


def test_tls_cert_without_key_is_a_usage_error(processes: Processes) -> None:
    broker = start_broker(processes, metrics=False)
    argv = gateway_argv(broker, "--tls-cert", __file__)
    refused = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--tls-cert and --tls-key go together" in refused.stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_it_cleanly(processes: Processes, signum: signal.Signals) -> None:
    broker = start_broker(processes, metrics=False)
    gateway = start_gateway(processes, broker)
    with urllib.request.urlopen(gateway.url + "/v2/health/live", timeout=60) as response:
        assert response.status == 200
    gateway.proc.popen.send_signal(signum)
    assert gateway.proc.wait() == 0, gateway.proc.output()
    assert "stopping: closing the doors" in gateway.proc.output()


def _add_input(name: str, array: np.ndarray[Any, Any]) -> httpclient.InferInput:
    tensor = httpclient.InferInput(name, list(array.shape), "FP32")
    tensor.set_data_from_numpy(array, binary_data=True)
    return tensor


def test_a_stop_answers_the_requests_under_way(processes: Processes) -> None:
    broker = start_broker(processes, metrics=False)
    worker = start_worker(processes, broker, fn_worker_argv("add", "--delay-ms", "1500"))
    gateway = start_gateway(processes, broker)
    inputs = add_inputs(rows=2, seed=4)
    answers: list[Any] = []

    def call() -> None:
        # plain urllib: tritonclient's gevent client must stay on the thread it was made on
        body = json.dumps({"inputs": [
            {"name": n, "datatype": "FP32", "shape": list(a.shape), "data": a.ravel().tolist()}
            for n, a in inputs.items()
        ]}).encode()  # fmt: skip
        try:
            with urllib.request.urlopen(gateway.url + "/v2/models/add/infer", body, 60) as r:
                [z] = json.loads(r.read())["outputs"]
            answers.append(np.array(z["data"], np.float32).reshape(z["shape"]))
        except Exception as exc:  # reported below, with the processes' output
            answers.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    worker.wait_for("running a job")  # the request is under way in the fabric
    gateway.proc.terminate()
    caller.join(timeout=60)
    assert gateway.proc.wait() == 0
    [answer] = answers
    assert isinstance(answer, np.ndarray), answer
    np.testing.assert_allclose(answer, add_expected(inputs), rtol=1e-6)


def test_a_model_that_raises_is_500_with_the_fabrics_message(processes: Processes) -> None:
    broker = start_broker(processes, metrics=False)
    start_worker(processes, broker, fn_worker_argv("fail"))
    gateway = start_gateway(processes, broker)
    with httpclient.InferenceServerClient(gateway.host_port, network_timeout=60) as client:
        with pytest.raises(InferenceServerException) as caught:
            client.infer("fail", [_add_input("x", add_inputs()["x"])])
        assert caught.value.status() == "500"
        assert "this model always fails" in caught.value.message()


def test_a_request_past_its_timeout_parameter_is_504(processes: Processes) -> None:
    broker = start_broker(processes, metrics=False)
    start_worker(processes, broker, fn_worker_argv("add", "--delay-ms", "3000"))
    gateway = start_gateway(processes, broker)
    tensors = [_add_input(name, array) for name, array in add_inputs().items()]
    client = httpclient.InferenceServerClient(gateway.host_port, network_timeout=60)
    with client, pytest.raises(InferenceServerException) as caught:
        client.infer("add", tensors, timeout=300_000)  # parameters.timeout, in µs
    assert caught.value.status() == "504", caught.value.message()
    assert "timeout of 300 ms" in caught.value.message()  # microseconds, as Triton's
