"""The worker batches along the dimension that holds the model's compiled batch, or
refuses to start: batching along another one packs samples into rows the model
computes differently, and answers come back silently wrong."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from ipuserve import protocol as wire
from ipuserve.errors import ConfigError
from ipuserve.runtime.popef import examples
from ipuserve.runtime.popef.builder import GraphBuilder
from ipuserve.runtime.popef.reader import load_model
from ipuserve.worker.backend import WorkItem, WorkResult
from ipuserve.worker.model_checks import choose_batching_dim
from ipuserve.worker.runner_backend import RunnerBackend
from tests.helpers import Processes, RawClient, runner_worker_argv, start_broker, write_example


def s8d1(tmp_path: Path) -> str:
    """``simple`` compiled for batches of 8 along dimension 1: its I/O is [4, 8]."""
    return write_example(tmp_path / "s8d1.popef", "simple", "--batch-size", "8", "--batch-dim", "1")


@pytest.mark.slow
def test_a_worker_without_batching_dim_batches_where_the_model_holds_its_batch(
    processes: Processes, tmp_path: Path
) -> None:
    path = s8d1(tmp_path)
    data = examples.tensor_arrays(load_model([path]))
    broker = start_broker(processes)
    worker = processes.start("worker", runner_worker_argv(path)(broker.backend))
    worker.wait_for(r"holds its batch of 8 along dimension 1 .*--batching-dim 1")
    worker.wait_for(r"registered with")
    rng = np.random.default_rng(0)
    same = rng.standard_normal((4, 1)).astype(np.float32)
    requests = [{"tensor_A": same, "tensor_B": same} for _ in range(12)]
    for width in (1, 3, 8, 13):
        shape = (4, width)
        requests.append(
            {
                "tensor_A": rng.standard_normal(shape).astype(np.float32),
                "tensor_B": rng.standard_normal(shape).astype(np.float32),
            }
        )
    with RawClient(broker.frontend) as client:
        (info,) = client.models()
        sent = {client.request("simple", inputs): inputs for inputs in requests}
        replies = [client.recv() for _ in sent]
        wrong = client.call("simple", {"tensor_A": same.T, "tensor_B": same.T})
    assert info.spec.batching_dim == 1
    assert len(replies) == len(requests)
    for reply in replies:
        assert isinstance(reply, wire.Reply), reply
        inputs = sent[reply.request_id]
        want = examples.reference("simple", inputs, data, batch_dim=1)["output"]
        got = reply.tensors.arrays()["output"]
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # a (1, 4) request is not one sample of this model: refused, not misread
    assert isinstance(wrong, wire.ErrorReply), wrong
    assert wrong.code == "INVALID_INPUT"


def test_a_worker_told_the_wrong_batching_dim_refuses_to_start(tmp_path: Path) -> None:
    path = s8d1(tmp_path)
    argv = ["worker", "--broker", "tcp://127.0.0.1:1", "--model", path, "--batching-dim", "0"]
    result = subprocess.run(
        [sys.executable, "-m", "ipuserve", *argv], capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert (
        f"Error: cannot serve {path}: --batching-dim 0 is not where model 'simple' holds its "
        "compiled batch size 8: its tensor 'tensor_A' of shape [4, 8] holds 4 along "
        "dimension 0; dimension 1 holds 8 in every input and output: pass --batching-dim 1"
    ) in result.stderr


@pytest.mark.parametrize(
    ("builder", "dim"),
    [
        (examples.simple(batch_size=1), 0),  # [1, 4]: batch size 1, the common case
        (examples.simple(batch_size=4), 0),  # [4, 4]: both hold 4; 0 comes first
        (examples.simple(batch_size=1, batch_dim=1), 1),  # [4, 1]
        (examples.noop(batch_size=1, elements=1, batch_dim=1), 0),  # [1, 1]
        (examples.branches(batch_size=1), 0),  # [1] beside [1, 4], [1, 8], [1, 3]
        (examples.mlp(batch_size=2, input_size=3, hidden_size=5, outputs=7), 0),
    ],
)
def test_without_batching_dim_the_dimension_holding_the_batch_is_chosen(
    builder: GraphBuilder, dim: int
) -> None:
    assert choose_batching_dim(builder.build(), None) == dim


def test_choosing_dimension_0_among_several_holding_the_batch_is_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="ipuserve.worker.model_checks"):
        assert choose_batching_dim(examples.simple(batch_size=4).build(), None) == 0
    [record] = caplog.records
    assert record.getMessage() == (
        "model 'simple': dimensions 0 and 1 all hold 4 in every input and output; batching "
        "requests along dimension 0 (the default): pass --batching-dim if the batch is held "
        "along another"
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ipuserve.worker.model_checks"):
        assert choose_batching_dim(examples.simple(batch_size=1).build(), None) == 0
    assert not caplog.records  # [1, 4]: only dimension 0 holds the batch


def test_a_model_whose_batch_dimension_is_ambiguous_needs_batching_dim() -> None:
    g = GraphBuilder("cube", batch_size=4, batch_dim=1)
    g.output("y", g.identity(g.input("x", (3, 4, 4))))
    model = g.build()
    with pytest.raises(ConfigError) as caught:
        choose_batching_dim(model, None)
    assert str(caught.value) == (
        "cannot tell which dimension of model 'cube' holds its batch of 4: dimensions 1 and "
        "2 all hold 4 in every input and output: pass --batching-dim with the one that "
        "holds the batch"
    )
    assert choose_batching_dim(model, 2) == 2


def odd_model() -> GraphBuilder:
    """Batch 4 held along dimension 1 of x and y, along none of w and z."""
    g = GraphBuilder("odd", batch_size=4, batch_dim=1)
    g.output("y", g.identity(g.input("x", (3, 4))))
    g.output("z", g.identity(g.input("w", (3, 5), batched=False)), batched=False)
    return g


def test_a_model_without_a_shared_batch_dimension_is_served_without_dynamic_batching(
    tmp_path: Path,
) -> None:
    model = odd_model().build()
    assert choose_batching_dim(model, None) is None
    with pytest.raises(ConfigError) as caught:
        choose_batching_dim(model, 1)
    assert "no dimension holds 4 in every input and output" in str(caught.value)
    assert "x [3, 4]: 1; w [3, 5]: none" in str(caught.value)
    assert "leave --batching-dim out to serve it without dynamic batching" in str(caught.value)
    path = tmp_path / "odd.popef"
    odd_model().write(path)
    backend = RunnerBackend([str(path)])
    try:
        (spec,) = backend.describe()
        assert spec.batching_dim is None and not spec.groupable
        rng = np.random.default_rng(1)
        given = {
            "x": rng.standard_normal((3, 4)).astype(np.float32),
            "w": rng.standard_normal((3, 5)).astype(np.float32),
        }
        outcomes: list[object] = []
        finished = threading.Event()
        backend.submit(
            WorkItem(b"j", "odd", given), lambda _job, out: (outcomes.append(out), finished.set())
        )
        assert finished.wait(30)
        (outcome,) = outcomes
        assert isinstance(outcome, WorkResult), outcome
        np.testing.assert_array_equal(outcome.outputs["y"], given["x"])
        np.testing.assert_array_equal(outcome.outputs["z"], given["w"])
    finally:
        backend.close()
