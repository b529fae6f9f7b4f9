"""Every misuse gets an exception naming the tensor and saying what was expected."""

from __future__ import annotations

import numpy as np
import pytest

import ipuserve.runtime as model_runtime
from ipuserve.errors import ClosedError, ReplicaError, TensorError
from ipuserve.runtime.popef.types import Model

from .conftest import rows


@pytest.fixture
def runner(make_runner, simple: Model) -> model_runtime.ModelRunner:
    return make_runner(simple, replication_factor=2)


def good() -> dict[str, np.ndarray]:
    return {"tensor_A": rows(2, 4, 0), "tensor_B": rows(2, 4, 1)}


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({"tensor_A": rows(2, 4, 0)}, r"missing input tensor\(s\): tensor_B float32 \[N\*2, 4\]"),
        (
            {**good(), "tensor_C": rows(2, 4, 0)},
            r"unknown input tensor 'tensor_C'.*tensor_A, tensor_B",
        ),
        (
            {**good(), "tensor_A": rows(2, 4, 0, np.float64)},
            r"input 'tensor_A': expected dtype float32, got float64",
        ),
        (
            {**good(), "tensor_B": rows(2, 5, 0)},
            r"input 'tensor_B': expected float32 \[N\*2, 4\].*"
            r"got float32 \[2, 5\]",
        ),
        (
            {**good(), "tensor_A": np.zeros((2, 4, 1), np.float32)},
            r"input 'tensor_A'.*got float32 "
            r"\[2, 4, 1\]",
        ),
        (
            {"tensor_A": rows(3, 4, 0), "tensor_B": rows(3, 4, 1)},
            r"input 'tensor_A'.*3 along dimension 0, not a multiple of the compiled batch 2",
        ),
        (
            {"tensor_A": rows(2, 4, 0), "tensor_B": rows(4, 4, 1)},
            r"inputs disagree on the batch size: tensor_A has 2, tensor_B has 4",
        ),
        (
            {"tensor_A": "not a tensor", "tensor_B": rows(2, 4, 1)},
            r"input 'tensor_A': expected a numpy",
        ),
    ],
)
def test_bad_inputs(runner: model_runtime.ModelRunner, inputs, message: str) -> None:
    with pytest.raises(TensorError, match=message):
        runner.execute(inputs)
    with pytest.raises(TensorError, match=message):
        runner.executeAsync(inputs)


def test_bad_outputs(runner: model_runtime.ModelRunner) -> None:
    with pytest.raises(TensorError, match=r"missing output tensor\(s\): output"):
        runner.execute(good(), {})
    with pytest.raises(TensorError, match=r"output 'output'.*got float32 \[4, 4\]"):
        runner.execute(good(), {"output": np.zeros((4, 4), np.float32)})
    frozen = np.zeros((2, 4), np.float32)
    frozen.flags.writeable = False
    with pytest.raises(TensorError, match="expected a writable numpy array"):
        runner.execute(good(), {"output": frozen})


@pytest.mark.parametrize("replica_id", [2, -1, 7])
def test_bad_replica_id(runner: model_runtime.ModelRunner, replica_id: int) -> None:
    with pytest.raises(
        ReplicaError,
        match=rf"replica_id {replica_id} is out of range: "
        r"replication_factor is 2 \(replicas 0\.\.1\)",
    ):
        runner.execute(good(), replica_id=replica_id)


def test_numpy_integer_replica_ids_pick_that_replica(runner: model_runtime.ModelRunner) -> None:
    """A replica id from numpy (np.arange, an array's element) is an integer: keyword or
    positional (C++'s execute(input, replica_id)), it must reach that replica, where it
    once ran on replica 0 without a word (positional) or was refused (keyword)."""
    assert runner.execute(good(), replica_id=np.int64(1)) is not None
    assert runner.execute(good(), np.int32(1)) is not None  # the outputs, not "written"
    runner.executeAsync(good(), np.uint8(1)).wait()
    counts = [
        runner.getMonitoringStatisticsTotalCount({}, replica_id=r)[
            "request_monitoring_statistics_count"
        ]
        for r in (0, np.int64(1))
    ]
    assert counts == [0, 3]
    with pytest.raises(ReplicaError, match="replica_id True is out of range"):
        runner.execute(good(), replica_id=True)


def test_output_data_that_is_neither_outputs_nor_a_replica_id_is_refused(
    runner: model_runtime.ModelRunner,
) -> None:
    with pytest.raises(TensorError, match=r"output_data must be a mapping.*got str"):
        runner.execute(good(), "output")


def test_raw_buffers_are_viewed_not_copied(runner: model_runtime.ModelRunner) -> None:
    data = good()
    flat = {name: memoryview(array.tobytes()) for name, array in data.items()}
    np.testing.assert_allclose(runner.execute(flat)["output"], runner.execute(data)["output"])


def test_calls_after_close(runner: model_runtime.ModelRunner) -> None:
    runner.close()
    with pytest.raises(ClosedError, match="closed"):
        runner.execute(good())
    with pytest.raises(ClosedError):
        runner.executeAsync(good())
    runner.close()  # idempotent
