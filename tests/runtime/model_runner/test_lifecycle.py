"""Closing a runner stops every thread it started and releases its devices."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

import ipuserve.runtime as model_runtime
from ipuserve.errors import ClosedError
from ipuserve.runtime.popef.types import Model

from .conftest import WAIT_S, reference, rows

NO_WAIT = model_runtime.DeviceWaitConfig(model_runtime.DeviceWaitStrategy.NO_WAIT)


def runtime_threads() -> set[threading.Thread]:
    """Every live thread: a runner may leave none of its own behind, whatever its name."""
    return set(threading.enumerate())


def test_close_leaves_no_thread_behind(mlp: Model) -> None:
    before = runtime_threads()
    config = model_runtime.ModelRunnerConfig(replication_factor=2, batching_dim=0)
    with model_runtime.ModelRunner(mlp, config=config) as runner:
        runner.execute({"input": rows(16, 32, 0)}, replica_id=1)
        assert len(runtime_threads() - before) >= 4  # device + prefetch thread per replica
    assert runtime_threads() == before
    everything = model_runtime.DeviceManager().getSpecificDevice(6, wait_config=NO_WAIT)
    everything.detach()


def test_garbage_collection_closes_the_runner(mlp: Model) -> None:
    before = runtime_threads()
    runner = model_runtime.ModelRunner(mlp)
    runner.execute({"input": rows(16, 32, 1)})
    del runner
    gc.collect()
    assert runtime_threads() == before
    model_runtime.DeviceManager().getSpecificDevice(0, wait_config=NO_WAIT).detach()


def test_close_fails_requests_still_in_flight(mlp: Model) -> None:
    config = model_runtime.ModelRunnerConfig(batching_dim=0, timeout_ns=0)  # never flushes
    runner = model_runtime.ModelRunner(mlp, config=config)
    pending = runner.executeAsync({"input": rows(3, 32, 2)})
    runner.close()
    with pytest.raises(ClosedError, match="closed before this request completed"):
        pending.result(WAIT_S)


def test_a_runner_per_thread_of_its_own(mlp: Model) -> None:
    """Two runners on one host hold different IPUs and run side by side."""
    with model_runtime.ModelRunner(mlp) as first, model_runtime.ModelRunner(mlp) as second:
        data = {"input": rows(16, 32, 3)}
        np.testing.assert_array_equal(first.execute(data)["logits"], second.execute(data)["logits"])


def test_a_runner_returns_with_every_replica_loaded(mlp: Model) -> None:
    """The first request once paid the load program (at a large time scale, seconds
    after a worker had joined the broker). Inside the runner: no public API says it."""
    config = model_runtime.ModelRunnerConfig(replication_factor=2, batching_dim=0)
    with model_runtime.ModelRunner(mlp, config=config) as runner:
        assert [replica.session._needs_load for replica in runner._replicas] == [False, False]
        np.testing.assert_allclose(
            runner.execute({"input": rows(16, 32, 4)})["logits"],
            reference("mlp", mlp, {"input": rows(16, 32, 4)})["logits"],
            rtol=1e-5,
            atol=1e-6,
        )
