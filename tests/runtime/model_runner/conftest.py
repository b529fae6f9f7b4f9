"""Models and a runner factory for the ModelRunner tests.

Models are built in memory from the example builders; references are the
examples' plain-numpy functions, independent of the runtime's kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import ipuserve.runtime as model_runtime
from ipuserve.runtime.popef import examples
from ipuserve.runtime.popef.types import Model

#: Generous upper bounds on waits, so a bug fails a test instead of hanging it.
WAIT_S = 30.0


@pytest.fixture
def make_runner() -> Iterator[Callable[..., model_runtime.ModelRunner]]:
    runners: list[model_runtime.ModelRunner] = []

    def make(
        model: Model | Any, config: model_runtime.ModelRunnerConfig | None = None, **fields: Any
    ) -> model_runtime.ModelRunner:
        config = config or model_runtime.ModelRunnerConfig()
        for name, value in fields.items():
            setattr(config, name, value)
        runner = model_runtime.ModelRunner(model, config=config)
        runners.append(runner)
        return runner

    yield make
    for runner in runners:
        runner.close()


@pytest.fixture(scope="session")
def simple() -> Model:
    return examples.build("simple", batch_size=2)


@pytest.fixture(scope="session")
def mlp() -> Model:
    return examples.build("mlp", batch_size=16, input_size=32, hidden_size=48)


@pytest.fixture(scope="session")
def branches() -> Model:
    return examples.build("branches")


def reference(name: str, model: Model, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return examples.reference(name, inputs, examples.tensor_arrays(model))


def assert_matches(got: Any, expected: dict[str, np.ndarray]) -> None:
    assert set(got) >= set(expected)
    for name, want in expected.items():
        np.testing.assert_allclose(
            np.asarray(got[name]), want, rtol=1e-5, atol=1e-6, err_msg=f"output {name!r}"
        )


def rows(n: int, features: int, seed: int, dtype: Any = np.float32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, features)).astype(dtype)


def counts(runner: model_runtime.ModelRunner, replica_id: int = 0) -> dict[str, float]:
    info: dict[str, float] = {}
    runner.getMonitoringStatisticsTotalCount(info, replica_id=replica_id)
    return {k.removesuffix("_monitoring_statistics_count"): v for k, v in info.items()}
