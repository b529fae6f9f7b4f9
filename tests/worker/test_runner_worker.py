"""A real `ipuserve worker` (ModelRunner backend) behind a real broker."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ipuserve import protocol as wire
from ipuserve.runtime.popef import examples
from ipuserve.runtime.popef.reader import load_model
from tests.helpers import (
    Processes,
    RawClient,
    runner_worker_argv,
    scrape,
    start_broker,
    start_worker,
    time_scale_for_run,
    wait_until,
    write_example,
)

pytestmark = pytest.mark.slow
pytest.importorskip("ipuserve.worker.runner_backend")


@pytest.fixture
def mlp(tmp_path: Path) -> str:
    return write_example(tmp_path / "mlp.popef", "mlp")


def test_requests_of_any_batch_size_share_the_runner_and_sigterm_exits_0(
    processes: Processes, mlp: str
) -> None:
    broker = start_broker(processes)
    worker = start_worker(processes, broker, runner_worker_argv(mlp))
    rng = np.random.default_rng(0)
    with RawClient(broker.frontend) as client:
        (info,) = client.models()
        assert info.spec.name == "mlp" and info.spec.batching_dim == 0
        sizes = {
            client.request("mlp", {"input": rng.standard_normal((rows, 784), np.float32)}): rows
            for rows in (1, 5, 16, 23)
        }
        for _ in sizes:
            reply = client.recv()
            assert isinstance(reply, wire.Reply), reply
            outputs = reply.tensors.arrays()
            rows = sizes[reply.request_id]
            assert outputs["logits"].shape == outputs["probs"].shape == (rows, 10)
            np.testing.assert_allclose(outputs["probs"].sum(axis=1), 1.0, rtol=1e-5)
            assert {"device_us", "worker_queue_us", "worker_us", "broker_queue_us"} <= set(
                reply.timing
            )
        bad = client.call("mlp", {"input": np.zeros((2, 783), np.float32)})
        assert isinstance(bad, wire.ErrorReply) and bad.code == "INVALID_INPUT"
    worker.terminate()
    assert worker.wait() == 0


def test_requests_expiring_behind_a_busy_device_are_answered_and_never_run(
    processes: Processes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before the runtime window the worker put its whole credit (63 jobs) into the
    runtime's queues: every request ran, however late, while its client had long been
    told DEADLINE_EXCEEDED. Now the worker keeps what the device will not reach soon,
    and answers what expires there."""
    model = write_example(tmp_path / "simple.popef", "simple", "--batch-size", "4")
    monkeypatch.setenv("IPUSERVE_SIM_TIME_SCALE", time_scale_for_run(model, 0.2))  # a batch
    broker = start_broker(processes)
    argv = runner_worker_argv(model, args=("--metrics-port", "0", "--metrics-host", "127.0.0.1"))
    worker = start_worker(processes, broker, argv)
    metrics_url = worker.wait_for(r"metrics on (http://127\.0\.0\.1:\d+/metrics)")[1]
    rng = np.random.default_rng(3)
    sent = 16
    with RawClient(broker.frontend) as client:
        inputs = {
            client.request("simple", arrays, timeout_ms=500): arrays
            for arrays in (
                {n: rng.standard_normal((4, 4), np.float32) for n in ("tensor_A", "tensor_B")}
                for _ in range(sent)
            )
        }
        replies = [client.recv() for _ in range(sent)]
    data = examples.tensor_arrays(load_model([model]))
    codes = []
    for reply in replies:
        if isinstance(reply, wire.Reply):
            want = examples.reference("simple", inputs[reply.request_id], data)["output"]
            np.testing.assert_allclose(reply.tensors.arrays()["output"], want, rtol=1e-5)
        else:
            assert isinstance(reply, wire.ErrorReply), reply
            codes.append(reply.code)
    assert set(codes) == {"DEADLINE_EXCEEDED"} and len(codes) >= sent // 2
    in_flight = 'ipuserve_worker_in_flight{model="simple",version="1"}'
    wait_until(lambda: scrape(metrics_url)[in_flight] == 0, timeout=30)  # all 16, the old way
    metrics = scrape(metrics_url)
    runs = metrics['ipuserve_runtime_batches_total{model="simple",replica="0",version="1"}']
    assert runs <= sent // 2  # it was 16: every expired request ran too
    jobs = 'ipuserve_worker_jobs_total{model="simple",outcome="%s",version="1"}'
    # every job is counted as answered, those that expired waiting too (they were not)
    assert metrics[jobs % "ok"] + metrics[jobs % "DEADLINE_EXCEEDED"] == sent
