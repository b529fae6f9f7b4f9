"""compose.yaml end to end: a broker and two workers in containers, clients on the host.

Everything runs under CURVE with the keys compose.yaml's one-shot `keys` service
makes into its volume: the host-side clients use the client key and the broker's
public key copied out of it (conftest.py, ``host_keys``), and a client without
them is refused and counted.

The image bakes ``/models/mlp.popef`` with ``ipuserve model example mlp`` and its
default seed; the host builds the same example in memory, so it knows the weights
and checks every result against the plain-numpy reference. Requests go through
the published frontend port from the Python client and from ``ipuserve infer``,
through the gateway's published HTTP port in the Open Inference Protocol's JSON,
and from the one-shot ``client`` job inside the compose network. A model is loaded at
run time from the repository volume through the gateway and served. Last, one worker
container is paused (so it certainly holds requests) and killed (SIGKILL: no
drain): every request, those it held included, must still succeed.

Skipped when no Docker engine is reachable (see conftest.py); .ci/run runs it for
real. The tests share one stack (module scope) and run in file order: the kill
comes last.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from ipuserve import protocol as wire
from ipuserve.client import Client
from ipuserve.errors import HandshakeRefusedError
from ipuserve.runtime.popef import examples
from tests.compose.conftest import SERVING, WORKERS, HostKeys
from tests.compose.harness import ComposeProject, ContainerState, metric_total, poll

pytestmark = [pytest.mark.compose, pytest.mark.timeout(900)]

MODEL = "mlp"
REQUESTS = 24
READY_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 60.0
"""Generous: requests held by a killed worker wait out the broker's liveness window."""

Array = npt.NDArray[Any]


@pytest.fixture(scope="module")
def weights() -> dict[str, Array]:
    """The mlp example's tensor data, built on the host exactly as the image built it."""
    return examples.tensor_arrays(examples.build(MODEL))


@pytest.fixture(scope="module")
def client(frontend: str, host_keys: HostKeys) -> Iterator[Client]:
    with Client(
        frontend,
        timeout=REQUEST_TIMEOUT_S,
        curve_secret_key=host_keys.client_secret,
        broker_public_key=host_keys.broker_public,
    ) as connected:
        yield connected


def served_by(client: Client, workers: int) -> wire.ModelInfo:
    """Wait until the broker lists MODEL with exactly ``workers`` workers; its entry."""

    def listed() -> wire.ModelInfo | None:
        for info in client.models(timeout=5):
            if info.spec.name == MODEL and len(info.workers) == workers:
                return info
        return None

    return poll(
        listed,
        timeout=READY_TIMEOUT_S,
        interval=0.5,
        what=f"{MODEL} served by {workers} workers",
        diagnose=lambda: repr(client.models(timeout=5)),
    )


def request_batches(spec: wire.ModelSpec, count: int, seed: int) -> list[dict[str, Array]]:
    """``count`` random requests; of varied sizes when the model batches dynamically."""
    rng = np.random.default_rng(seed)
    batches = []
    for index in range(count):
        inputs = {}
        for tensor in spec.inputs:
            shape = list(tensor.shape)
            if spec.batching_dim is not None:
                shape[spec.batching_dim] = 1 + index % spec.batch_size
            inputs[tensor.name] = rng.standard_normal(shape).astype(tensor.dtype)
        batches.append(inputs)
    return batches


def check_results(
    futures: list[Future[Any]], requests: list[dict[str, Array]], weights: dict[str, Array]
) -> None:
    for index, (future, inputs) in enumerate(zip(futures, requests, strict=True)):
        outputs = future.result(timeout=REQUEST_TIMEOUT_S + 10)
        expected = examples.reference(MODEL, inputs, weights)
        assert set(outputs) == set(expected), f"request {index}: outputs {sorted(outputs)}"
        for name, want in expected.items():
            np.testing.assert_allclose(
                outputs[name],
                want,
                rtol=1e-4,
                atol=1e-5,
                err_msg=f"request {index}, output {name!r}",
            )


def send_all(client: Client, requests: list[dict[str, Array]]) -> list[Future[Any]]:
    return [client.infer_async(MODEL, inputs) for inputs in requests]


def worker_load(client: Client, container: ContainerState) -> wire.WorkerLoad | None:
    """The broker's entry for the worker running in ``container`` (ids are hostname:pid)."""
    for model in client.models(timeout=5):
        for load in model.workers:
            if model.spec.name == MODEL and load.worker_id.startswith(container.hostname + ":"):
                return load
    return None


def test_stack_is_healthy(stack: ComposeProject) -> None:
    status = stack.health()
    assert sorted(status.values()) == ["healthy"] * SERVING, status
    services = sorted(c.service for c in stack.containers())
    assert services == ["broker", "gateway", "keys", "repository-worker"] + ["worker"] * WORKERS
    (keys,) = stack.containers("keys")
    assert (keys.status, keys.exit_code) == ("exited", 0)


def test_a_host_client_without_keys_is_refused_and_counted(frontend: str, metrics_url: str) -> None:
    """The broker runs with keys: a plaintext client completes no handshake, learns
    it at once (not at its 60 s timeout) with the keys to give, and the refusal
    shows in the metrics."""
    family = "ipuserve_broker_refused_handshakes_total"
    refused = metric_total(metrics_url, family)
    named = "curve_secret_key and broker_public_key"  # whichever way the broker drops it
    with (
        Client(frontend, timeout=60) as plain,
        pytest.raises(HandshakeRefusedError, match=named),
    ):
        plain.models()
    poll(
        lambda: True if metric_total(metrics_url, family) > refused else None,
        timeout=READY_TIMEOUT_S,
        interval=0.2,
        what=f"{family} to count the plaintext client",
    )


def test_host_client_gets_correct_results(
    client: Client, weights: dict[str, Array], metrics_url: str
) -> None:
    info = served_by(client, WORKERS)
    requests = request_batches(info.spec, REQUESTS, seed=1)
    check_results(send_all(client, requests), requests, weights)
    # The blocking call too, with exactly one compiled batch.
    full = {t.name: np.ones(t.shape, t.dtype) for t in info.spec.inputs}
    check_results([client.infer_async(MODEL, full)], [full], weights)
    # The published metrics endpoint counted them.
    assert metric_total(metrics_url, "ipuserve_broker_replies_total") >= REQUESTS + 1


def test_ipuserve_infer_on_the_host(
    frontend: str, host_keys: HostKeys, weights: dict[str, Array], tmp_path: Path
) -> None:
    """The CLI a user types on the host, against the published port, with the keys."""
    batch = np.random.default_rng(4).standard_normal((5, 784)).astype(np.float32)
    np.save(tmp_path / "input.npy", batch)
    argv = [
        sys.executable,
        "-m",
        "ipuserve",
        "infer",
        "--broker",
        frontend,
        "--model",
        MODEL,
        "--input",
        f"input={tmp_path / 'input.npy'}",
        "--output",
        str(tmp_path / "out.npz"),
        "--curve-secret-key",
        str(host_keys.client_secret),
        "--broker-public-key",
        str(host_keys.broker_public),
    ]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    with np.load(tmp_path / "out.npz") as saved:
        outputs = {name: saved[name] for name in saved.files}
    expected = examples.reference(MODEL, {"input": batch}, weights)
    assert set(outputs) == set(expected)
    for name, want in expected.items():
        np.testing.assert_allclose(outputs[name], want, rtol=1e-4, atol=1e-5, err_msg=name)


def http_json(url: str, body: Any = None, *, token: str) -> Any:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
    request = urllib.request.Request(url, data, headers)
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
        return json.loads(response.read())


def test_requests_through_the_gateway_match_numpy(
    client: Client, gateway_url: str, gateway_token: str, weights: dict[str, Array]
) -> None:
    """The gateway service, from the host, in the Open Inference Protocol's JSON (no
    ipuserve client): ready, the model described, every answer equal to numpy's."""
    info = served_by(client, WORKERS)
    with urllib.request.urlopen(f"{gateway_url}/v2/health/ready", timeout=10) as response:
        assert response.status == 200
    metadata = http_json(f"{gateway_url}/v2/models/{MODEL}", token=gateway_token)
    assert [i["name"] for i in metadata["inputs"]] == [t.name for t in info.spec.inputs]
    requests = request_batches(info.spec, 8, seed=5)
    for index, inputs in enumerate(requests):
        tensors = [
            {"name": n, "datatype": "FP32", "shape": list(a.shape), "data": a.ravel().tolist()}
            for n, a in inputs.items()
        ]
        answer = http_json(
            f"{gateway_url}/v2/models/{MODEL}/infer",
            {"id": f"r{index}", "inputs": tensors},
            token=gateway_token,
        )
        assert answer["id"] == f"r{index}"
        expected = examples.reference(MODEL, inputs, weights)
        outputs = {o["name"]: o for o in answer["outputs"]}
        assert set(outputs) == set(expected), f"request {index}: {sorted(outputs)}"
        for name, want in expected.items():
            assert outputs[name]["datatype"] == "FP32"
            got = np.array(outputs[name]["data"], np.float32).reshape(outputs[name]["shape"])
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=name)


def post(url: str, body: Any = None, *, token: str) -> bytes:
    """POST ``body`` as JSON; the response's body (the repository calls answer none)."""
    data = json.dumps(body or {}).encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
    request = urllib.request.Request(url, data, headers)
    with urllib.request.urlopen(request, timeout=READY_TIMEOUT_S) as response:
        assert response.status == 200
        return bytes(response.read())


def repository_states(gateway_url: str, name: str, token: str) -> dict[str, str]:
    """Version -> state of ``name`` in the gateway's repository index (Triton's)."""
    index = json.loads(post(f"{gateway_url}/v2/repository/index", token=token))
    return {e["version"]: e["state"] for e in index if e["name"] == name}


def test_a_model_loaded_at_run_time_through_the_gateway_serves_traffic(
    gateway_url: str, gateway_token: str
) -> None:
    """The repository worker starts with nothing loaded; through the gateway (Triton's
    repository extension, the gateway's key an admin's) `simple` is loaded from the
    shared volume the image filled (latest: version 2, weights of seed 2), answers as
    numpy says naming version 2, and is unloaded again."""
    name = "simple"
    assert repository_states(gateway_url, name, gateway_token) == {
        "1": "UNAVAILABLE",
        "2": "UNAVAILABLE",
    }
    post(
        f"{gateway_url}/v2/repository/models/{name}/load", token=gateway_token
    )  # returns once READY
    assert repository_states(gateway_url, name, gateway_token) == {"1": "UNAVAILABLE", "2": "READY"}
    weights = examples.tensor_arrays(examples.build(name, seed=2))
    rng = np.random.default_rng(7)
    for index in range(16):
        inputs = {
            t: rng.standard_normal((1, 4)).astype(np.float32) for t in ("tensor_A", "tensor_B")
        }
        tensors = [
            {"name": n, "datatype": "FP32", "shape": list(a.shape), "data": a.ravel().tolist()}
            for n, a in inputs.items()
        ]
        answer = http_json(
            f"{gateway_url}/v2/models/{name}/infer", {"inputs": tensors}, token=gateway_token
        )
        assert answer["model_version"] == "2"
        expected = examples.reference(name, inputs, weights)
        outputs = {o["name"]: o for o in answer["outputs"]}
        assert set(outputs) == set(expected), f"request {index}: {sorted(outputs)}"
        for output, want in expected.items():
            got = np.array(outputs[output]["data"], np.float32).reshape(outputs[output]["shape"])
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=output)
    post(
        f"{gateway_url}/v2/repository/models/{name}/unload", token=gateway_token
    )  # returns once drained
    assert repository_states(gateway_url, name, gateway_token) == {
        "1": "UNAVAILABLE",
        "2": "UNAVAILABLE",
    }


def test_one_shot_client_job(stack: ComposeProject) -> None:
    """`compose --profile client run client`: ipuserve bench from inside the network."""
    output = stack.run_job(
        "client",
        env={
            "IPUSERVE_BENCH_REQUESTS": "40",
            "IPUSERVE_BENCH_WARMUP_S": "0",
            "IPUSERVE_BENCH_CONCURRENCY": "4",
            "IPUSERVE_BENCH_AS_JSON": "1",
        },
    )
    report = json.loads(output[output.index("{") : output.rindex("}") + 1])
    assert report["model"] == MODEL
    assert report["requests"] == 40
    assert report["ok"] == 40, report["errors"]


def test_requests_survive_a_killed_worker(
    stack: ComposeProject, client: Client, weights: dict[str, Array], metrics_url: str
) -> None:
    """A worker that dies holding requests: the broker re-sends them to the other one.

    The victim is paused first, so it certainly holds requests it will never
    answer when it is killed (a running worker might finish them all first).
    """
    info = served_by(client, WORKERS)
    victim = stack.containers("worker")[0]
    requeued = metric_total(metrics_url, "ipuserve_broker_requeued_total")
    stack.pause(victim)
    requests = request_batches(info.spec, REQUESTS, seed=2)
    futures = send_all(client, requests)

    def victim_holds_requests() -> wire.WorkerLoad | None:
        load = worker_load(client, victim)
        return load if load is not None and load.in_flight > 0 else None

    poll(
        victim_holds_requests,
        timeout=READY_TIMEOUT_S,
        interval=0.05,
        what=f"the broker to dispatch requests to {victim.name}",
        diagnose=lambda: repr(client.models(timeout=5)),
    )
    stack.kill(victim)
    check_results(futures, requests, weights)
    assert metric_total(metrics_url, "ipuserve_broker_requeued_total") > requeued

    # The broker has dropped the dead worker (that is how its requests came back)
    # unless the restart policy brought the container back; either way MODEL stays
    # served and new requests succeed.
    after = request_batches(info.spec, REQUESTS, seed=3)
    check_results(send_all(client, after), after, weights)
    if stack.state(victim.id).status != "running":
        assert worker_load(client, victim) is None
        # counted a heartbeat interval after the drop: a BYE may still be on its way
        poll(
            lambda: metric_total(metrics_url, "ipuserve_broker_workers_lost_total") >= 1 or None,
            timeout=READY_TIMEOUT_S,
            interval=0.2,
            what="the dead worker counted lost",
            diagnose=lambda: repr(metric_total(metrics_url, "ipuserve_broker_workers_lost_total")),
        )
