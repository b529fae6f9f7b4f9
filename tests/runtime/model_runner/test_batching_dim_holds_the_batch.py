"""batching_dim must be the dimension that holds the compiled batch (spec 3.6): packing
samples along another dimension whose extent merely agrees across the tensors would
run the model's maths on the wrong rows, so the ModelRunner refuses it up front."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import ipuserve.runtime as model_runtime
from ipuserve.errors import ConfigError
from ipuserve.runtime.model_runner.io_plan import batch_dims
from ipuserve.runtime.popef import examples
from tests.runtime.model_runner.conftest import WAIT_S

MakeRunner = Callable[..., model_runtime.ModelRunner]


def test_a_batching_dim_that_does_not_hold_the_batch_is_refused() -> None:
    """simple, batch 8 along dimension 1: every tensor is [4, 8], so dimension 0 agrees
    (4 everywhere) but is the weights' dimension, not the batch."""
    model = examples.build("simple", batch_size=8, batch_dim=1)
    with pytest.raises(ConfigError) as caught:
        model_runtime.ModelRunner(model, config=model_runtime.ModelRunnerConfig(batching_dim=0))
    assert str(caught.value) == (
        "ModelRunnerConfig.batching_dim=0: the model was compiled for batches of 8, but "
        "tensor 'tensor_A' of shape [4, 8] has 4 along dimension 0; the batch is along "
        "dimension 1 of every execute input and output: set batching_dim to it"
    )


def test_the_dimension_that_holds_the_batch_gives_the_reference_results(
    make_runner: MakeRunner,
) -> None:
    model = examples.build("simple", batch_size=8, batch_dim=1)
    runner = make_runner(
        model,
        batching_dim=1,
        is_batch_size_timeout_enabled=True,
        batch_size_timeout_ns=0,
        flush_on_waiting_outputs=True,
    )
    one = np.arange(4, dtype=np.float32).reshape(4, 1)
    inputs = {"tensor_A": one, "tensor_B": one}
    futures = [runner.executeAsync(inputs) for _ in range(12)]
    want = examples.reference("simple", inputs, examples.tensor_arrays(model), batch_dim=1)
    for future in futures:
        np.testing.assert_allclose(
            future.result(WAIT_S)["output"], want["output"], rtol=1e-6, atol=1e-6
        )


def test_batch_size_1_models_batch_on_dimension_0(make_runner: MakeRunner) -> None:
    model = examples.build("simple", batch_size=1)
    runner = make_runner(model, batching_dim=0)
    inputs = {"tensor_A": np.ones((3, 4), np.float32), "tensor_B": np.zeros((3, 4), np.float32)}
    got = runner.execute(inputs)
    want = examples.reference("simple", inputs, examples.tensor_arrays(model))
    np.testing.assert_allclose(got["output"], want["output"], rtol=1e-6)


@pytest.mark.parametrize(
    ("shapes", "batch", "dims"),
    [
        ([(4, 8), (4, 8)], 8, [1]),
        ([(8, 8)], 8, [0, 1]),
        ([(1, 4), (1,), ()], 1, [0]),
        ([(3, 4), (3, 5)], 4, []),
        ([], 4, []),
    ],
)
def test_batch_dims(shapes: list[tuple[int, ...]], batch: int, dims: list[int]) -> None:
    assert batch_dims(shapes, batch) == dims
