"""A lone request of one whole batch skips the queues (runtime/model_runner/direct.py).

Real runners on the simulated device, results against the examples' numpy references;
whether a run went the direct way is read from the replica's count of direct runs."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import ipuserve.runtime as model_runtime
from ipuserve.errors import DeviceFaultError, RuntimeUsageError
from ipuserve.runtime.popef import examples
from ipuserve.runtime.popef.types import Model
from tests.helpers import wait_until

from .conftest import WAIT_S, assert_matches, counts, reference, rows

BATCH = 16


def worker_config(**fields: Any) -> model_runtime.ModelRunnerConfig:
    """The configuration RunnerBackend gives its runner (worker/runner_backend.py)."""
    config = model_runtime.ModelRunnerConfig(
        batching_dim=0,
        is_batch_size_timeout_enabled=True,
        flush_on_waiting_outputs=True,
        validate_io_params=False,
        max_look_ahead="0",
        ring_buffer_size_multiplier=4,
    )
    for name, value in fields.items():
        setattr(config, name, value)
    return config


@pytest.fixture(scope="module")
def mlp16() -> Model:
    return examples.build("mlp", batch_size=BATCH)


def features(model: Model) -> int:
    return int(model.metadata.anchors()[0].tensorInfo().shape()[1])


def idle(runner: model_runtime.ModelRunner) -> model_runtime.ModelRunner:
    """Wait until the device waits for its next run's input: a request is then lone
    (a caller that comes back sooner, while the device still finishes the run that
    answered it, takes the queues)."""
    replica = runner._replicas[0]
    wait_until(lambda: replica.waiting_for() == "input", timeout=WAIT_S)
    return runner


def direct_runs(runner: model_runtime.ModelRunner) -> int:
    direct = runner._replicas[0]._direct
    assert direct is not None
    return direct.runs


def test_a_lone_whole_batch_runs_without_the_queues(mlp16: Model) -> None:
    with model_runtime.ModelRunner(mlp16, config=worker_config()) as runner:
        for seed in range(5):
            inputs = {"input": rows(BATCH, features(mlp16), seed)}
            assert_matches(idle(runner).execute(inputs), reference("mlp", mlp16, inputs))
            assert direct_runs(runner) == seed + 1
            trace = runner.getTimeTrace({})
            assert 0 < trace["computation_duration_us"] <= trace["request_duration_us"]
        stats = counts(runner)
    assert (stats["batches"], stats["request"], stats["padded_samples"]) == (5, 5, 0)


def test_a_partial_batch_still_goes_through_the_queues(mlp16: Model) -> None:
    with model_runtime.ModelRunner(mlp16, config=worker_config()) as runner:
        inputs = {"input": rows(3, features(mlp16), 1)}
        assert_matches(idle(runner).execute(inputs), reference("mlp", mlp16, inputs))
        assert direct_runs(runner) == 0


@pytest.mark.parametrize("look_ahead", ["unlimited", "1"])
def test_with_look_ahead_every_request_goes_through_the_queues(
    mlp16: Model, look_ahead: str
) -> None:
    config = worker_config(max_look_ahead=look_ahead)
    with model_runtime.ModelRunner(mlp16, config=config) as runner:
        inputs = {"input": rows(BATCH, features(mlp16), 2)}
        assert_matches(runner.execute(inputs), reference("mlp", mlp16, inputs))
        assert runner._replicas[0]._direct is None


def test_requests_behind_a_direct_one_are_queued_and_all_answered_right(mlp16: Model) -> None:
    """A burst: the first whole batch may go direct, the rest (partial or whole) queue
    behind it; every request gets its own rows back."""
    with model_runtime.ModelRunner(mlp16, config=worker_config()) as runner:
        sizes = [BATCH, 5, BATCH, 11, 1, BATCH, 15, BATCH]
        for round_ in range(3):
            batches = [
                {"input": rows(n, features(mlp16), 10 * round_ + i)} for i, n in enumerate(sizes)
            ]
            futures = [runner.executeAsync(b) for b in batches]
            for data, future in zip(batches, futures, strict=True):
                assert_matches(future.result(WAIT_S), reference("mlp", mlp16, data))
        assert counts(runner)["request"] == 3 * len(sizes)
        assert direct_runs(runner) <= 3 * sizes.count(BATCH)


def test_the_direct_path_takes_only_what_the_device_reads_as_is(mlp16: Model) -> None:
    """Outputs given by the caller, or a non-contiguous input: the queues handle them."""
    with model_runtime.ModelRunner(mlp16, config=worker_config()) as runner:
        data = rows(BATCH, features(mlp16), 3)
        expected = reference("mlp", mlp16, {"input": data})
        given = {
            out.name: np.empty(out.shape, out.numpy_data_type())
            for out in runner.getExecuteOutputs()
        }
        idle(runner).execute({"input": data}, given)
        assert_matches(given, expected)
        strided = np.asfortranarray(data)
        assert_matches(idle(runner).execute({"input": strided}), expected)
        assert direct_runs(runner) == 0
        assert_matches(idle(runner).execute({"input": data}), expected)
        assert direct_runs(runner) == 1


@pytest.mark.parametrize("auto_reset", [False, True])
def test_a_device_fault_fails_the_direct_request_like_any_other(
    mlp16: Model, auto_reset: bool
) -> None:
    device = model_runtime.DeviceManager().getDevice(1)
    config = worker_config(replica_to_device={0: device}, auto_reset=auto_reset)
    inputs = {"input": rows(BATCH, features(mlp16), 4)}
    try:
        with model_runtime.ModelRunner(mlp16, config=config) as runner:
            assert_matches(idle(runner).execute(inputs), reference("mlp", mlp16, inputs))
            device.injectFault()
            with pytest.raises(DeviceFaultError, match="application runtime error"):
                idle(runner).execute(inputs)
            assert direct_runs(runner) == 2
            if auto_reset:
                assert_matches(idle(runner).execute(inputs), reference("mlp", mlp16, inputs))
                assert direct_runs(runner) == 3
            else:
                with pytest.raises(RuntimeUsageError, match="auto_reset"):
                    runner.execute(inputs)
    finally:
        device.detach()
