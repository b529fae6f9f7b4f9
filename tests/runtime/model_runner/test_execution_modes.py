"""Every execution flavour of spec listing 3.2, with its memory-sharing guarantees."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import ipuserve.runtime as model_runtime
from ipuserve.runtime.popef import examples
from ipuserve.runtime.popef.types import DataType, Model

from .conftest import WAIT_S, assert_matches, reference, rows


def simple_inputs(seed: int = 0) -> dict[str, np.ndarray]:
    return {"tensor_A": rows(2, 4, seed), "tensor_B": rows(2, 4, seed + 1)}


def as_view(inputs: dict[str, np.ndarray]) -> model_runtime.InputMemoryView:
    view = model_runtime.InputMemoryView()
    for name, array in inputs.items():
        view[name] = array
    return view


def test_descriptions(make_runner, simple: Model) -> None:
    runner = make_runner(simple)
    inputs = runner.getExecuteInputs()
    assert [(d.name, d.shape, d.size_in_bytes) for d in inputs] == [
        ("tensor_A", [2, 4], 32),
        ("tensor_B", [2, 4], 32),
    ]
    assert all(d.numpy_data_type() == np.float32 and d.data_type is DataType.F32 for d in inputs)
    assert not any(d.popef_contains_tensor_data for d in inputs)
    assert [d.name for d in runner.getExecuteOutputs()] == ["output"]
    model_inputs = {d.name: d for d in runner.getModelInputs()}
    assert model_inputs["weights"].popef_contains_tensor_data
    assert {d.name for d in runner.getModelOutputs()} == {"output", "run_count"}
    assert runner.config().replication_factor == 1


def test_sync_library_allocated(make_runner, simple: Model) -> None:
    runner = make_runner(simple)
    inputs = simple_inputs()
    result = runner.execute(as_view(inputs))
    desc = runner.getExecuteOutputs()[0]
    output = np.frombuffer(result[desc.name], dtype=desc.numpy_data_type()).reshape(desc.shape)
    np.testing.assert_allclose(output, reference("simple", simple, inputs)["output"], rtol=1e-6)


def test_sync_user_allocated(make_runner, simple: Model) -> None:
    runner = make_runner(simple)
    inputs = simple_inputs(2)
    out = model_runtime.OutputMemoryView()
    out["output"] = np.zeros((2, 4), np.float32)
    assert runner.execute(as_view(inputs), out) is None
    assert_matches(out, reference("simple", simple, inputs))


def test_async_library_allocated(make_runner, simple: Model) -> None:
    runner = make_runner(simple)
    inputs = simple_inputs(4)
    future = runner.executeAsync(as_view(inputs))
    future.wait()
    output = np.frombuffer(future["output"], dtype=np.float32).reshape(2, 4)
    np.testing.assert_allclose(output, reference("simple", simple, inputs)["output"], rtol=1e-6)


def test_async_user_allocated(make_runner, simple: Model) -> None:
    runner = make_runner(simple)
    inputs = simple_inputs(6)
    target = np.zeros((2, 4), np.float32)
    future = runner.executeAsync(as_view(inputs), model_runtime.OutputMemoryView(output=target))
    future.wait(WAIT_S)
    np.testing.assert_allclose(target, reference("simple", simple, inputs)["output"], rtol=1e-6)


def test_numpy_dicts_sync(make_runner, simple: Model) -> None:
    runner = make_runner(simple)
    inputs = simple_inputs(8)
    assert_matches(runner.execute(inputs), reference("simple", simple, inputs))
    outputs = {"output": np.zeros((2, 4), np.float32)}
    runner.execute(inputs, outputs)
    assert_matches(outputs, reference("simple", simple, inputs))


def test_library_allocated_future_memory_semantics(make_runner, simple: Model) -> None:
    """Listing 3.2: numpy() and copy=True are copies; copy=False is a view of the library buffer."""
    runner = make_runner(simple)
    inputs = simple_inputs(10)
    future = runner.executeAsync(inputs)
    future.wait(WAIT_S)
    py_array = future["output"]
    tensor = py_array.numpy()
    tensor_copy = np.array(py_array, copy=True)
    tensor_view = np.array(py_array, copy=False)
    assert not np.shares_memory(tensor_view, tensor_copy)
    assert not np.shares_memory(tensor, tensor_copy)
    assert not np.shares_memory(tensor, tensor_view)
    assert np.shares_memory(tensor_view, py_array)
    np.testing.assert_allclose(tensor, reference("simple", simple, inputs)["output"], rtol=1e-6)


def test_user_allocated_future_memory_semantics(make_runner, simple: Model) -> None:
    """Listing 3.2: numpy() and copy=False are views of the user's array; copy=True is not."""
    runner = make_runner(simple)
    inputs = simple_inputs(12)
    numpy_output = {"output": np.zeros((2, 4), np.float32)}
    future = runner.executeAsync(inputs, numpy_output)
    future.wait(WAIT_S)
    output_tensor = numpy_output["output"]
    from_future = future["output"].numpy()
    assert np.shares_memory(output_tensor, from_future)
    tensor_view = np.array(future["output"], copy=False)
    assert np.shares_memory(output_tensor, tensor_view)
    assert np.shares_memory(from_future, tensor_view)
    tensor_copy = np.array(future["output"], copy=True)
    assert not np.shares_memory(from_future, tensor_copy)
    assert not np.shares_memory(output_tensor, tensor_copy)
    np.testing.assert_allclose(
        output_tensor, reference("simple", simple, inputs)["output"], rtol=1e-6
    )


def test_inputs_are_not_copied_when_they_fill_the_batch(make_runner, simple: Model) -> None:
    """The device reads a request that covers the compiled batch straight from its memory."""
    runner = make_runner(simple)
    inputs = simple_inputs(14)
    before = {k: v.copy() for k, v in inputs.items()}
    assert_matches(runner.execute(inputs), reference("simple", simple, before))
    for name in inputs:  # nothing wrote into the caller's arrays
        np.testing.assert_array_equal(inputs[name], before[name])


def test_concurrent_futures_interface(make_runner, simple: Model) -> None:
    runner = make_runner(simple)
    inputs = simple_inputs(16)
    seen: list[object] = []
    future = runner.executeAsync(inputs)
    future.add_done_callback(seen.append)
    result = future.result(WAIT_S)
    assert future.done() and future.exception() is None
    assert_matches(result, reference("simple", simple, inputs))
    assert seen == [future] and list(future) == ["output"] and len(future) == 1


@pytest.mark.parametrize(
    ("split", "as_paths"),
    [
        (False, model_runtime.PopefPaths),
        (True, model_runtime.PopefPaths),
        (True, list),
        (False, lambda paths: paths[0]),  # C++'s ModelRunner(const std::string &popef_path)
    ],
)
def test_runner_from_popef_paths(make_runner, tmp_path: Path, split: bool, as_paths) -> None:
    builder = examples.simple(batch_size=2)
    paths = builder.write(
        tmp_path / "simple.popef", tensor_data_path=tmp_path / "weights.popef" if split else None
    )
    model = builder.build()
    runner = make_runner(as_paths([str(p) for p in paths]))
    inputs = simple_inputs(18)
    assert_matches(runner.execute(inputs), reference("simple", model, inputs))


def test_multiple_batches_in_one_request(make_runner, simple: Model) -> None:
    """Without batching_dim a request may hold any whole number of compiled batches."""
    runner = make_runner(simple)
    inputs = {"tensor_A": rows(6, 4, 20), "tensor_B": rows(6, 4, 21)}
    assert_matches(runner.execute(inputs), reference("simple", simple, inputs))
