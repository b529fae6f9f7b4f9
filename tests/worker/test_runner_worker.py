"""A real `ipuserve worker` (ModelRunner backend) behind a real broker."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ipuserve import protocol as wire
from tests.helpers import (
    Processes,
    RawClient,
    runner_worker_argv,
    start_broker,
    start_worker,
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
