"""run_program on the example models, checked against the plain-numpy references."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from ipuserve.errors import RuntimeUsageError
from ipuserve.runtime.popef import GraphBuilder, Step, examples, run_program
from tests.runtime.popef.helpers import Host


def check_main_run(
    name: str,
    inputs: dict[str, Any] | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    **opts: Any,
) -> dict[str, Any]:
    model = examples.build(name, **opts)
    host = Host(model)
    host.run("load")
    inputs = inputs if inputs is not None else examples.sample_inputs(model, seed=7)
    outputs = host.run("main", inputs)
    reference_opts = {"batch_dim": opts["batch_dim"]} if "batch_dim" in opts else {}
    expected = examples.reference(name, inputs, examples.tensor_arrays(model), **reference_opts)
    assert set(outputs) == set(expected)
    for key, value in expected.items():
        assert outputs[key].dtype == value.dtype
        np.testing.assert_allclose(
            outputs[key].astype(np.float64), value, rtol=rtol, atol=atol, err_msg=f"{name}: {key}"
        )
    return outputs


@pytest.mark.parametrize("batch_size", [1, 3])
def test_simple_matches_reference(batch_size: int) -> None:
    check_main_run("simple", batch_size=batch_size)


def test_simple_with_the_batch_in_dimension_1() -> None:
    model = examples.build("simple", batch_size=3, batch_dim=1)
    assert model.metadata.anchor("tensor_A").tensorInfo().shape() == [4, 3]
    check_main_run("simple", batch_size=3, batch_dim=1)


def test_simple_computes_the_spec_formula_on_known_values() -> None:
    model = examples.build("simple", batch_size=2)
    weights = model.tensorData["weights"].array()
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    b = np.full((2, 4), 10, np.float32)
    host = Host(model)
    host.run("load")
    out = host.run("main", {"tensor_A": a, "tensor_B": b})["output"]
    np.testing.assert_allclose(
        out[1],
        [4 * weights[0] + 10, 5 * weights[1] + 10, 6 * weights[2] + 10, 7 * weights[3] + 10],
        rtol=1e-6,
    )


def test_mlp_default_size_matches_reference() -> None:
    outputs = check_main_run("mlp", rtol=1e-4, atol=1e-5)
    assert outputs["logits"].shape == (16, 10)
    np.testing.assert_allclose(outputs["probs"].sum(axis=-1), 1.0, rtol=1e-5)


def test_mlp_float16_matches_reference_within_half_precision() -> None:
    check_main_run(
        "mlp",
        rtol=2e-2,
        atol=2e-2,
        batch_size=4,
        input_size=32,
        hidden_size=64,
        layers=3,
        outputs=5,
        dtype="float16",
    )


def test_mlp_without_hidden_layers_is_one_dense_layer() -> None:
    check_main_run("mlp", batch_size=2, input_size=6, layers=0, outputs=3)


def test_noop_passes_the_input_object_through() -> None:
    model = examples.build("noop", elements=16)
    host = Host(model)
    given = np.arange(16, dtype=np.float32).reshape(1, 16)
    assert host.run("main", {"input": given})["output"] is given
    check_main_run("noop", elements=16, batch_size=2)


@pytest.mark.parametrize(
    ("selector", "ran", "skipped"), [(0, "a_output", "b_output"), (1, "b_output", "a_output")]
)
def test_branches_runs_only_the_selected_branch(selector: int, ran: str, skipped: str) -> None:
    model = examples.build("branches", batch_size=2)
    inputs = examples.sample_inputs(model, seed=3)
    inputs["branch"] = np.array([selector, 1 - selector], np.int32)  # the first sample decides
    outputs = check_main_run("branches", inputs=inputs, batch_size=2)
    assert ran in outputs and skipped not in outputs


def test_branches_reads_only_the_chosen_branch_inputs() -> None:
    model = examples.build("branches")
    host = Host(model)
    host.run("load")
    # no b_input given: branch 0 must not ask the host for it
    out = host.run(
        "main", {"branch": np.array([0], np.int32), "a_input": np.ones((1, 4), np.float32)}
    )
    assert list(out) == ["a_output"]


@pytest.mark.parametrize("value", [2, -1])
def test_selector_out_of_range_is_a_clear_value_error(value: int) -> None:
    model = examples.build("branches")
    host = Host(model)
    host.run("load")
    with pytest.raises(
        ValueError,
        match=rf"selector tensor 'branch' has value {value}, but "
        r"the switch has 2 branches",
    ):
        host.run("main", {"branch": np.array([value], np.int32)})


def test_counter_counts_main_runs_and_load_resets_it() -> None:
    model = examples.build("simple")
    host = Host(model)
    inputs = examples.sample_inputs(model)
    host.run("load")
    for _ in range(3):
        host.run("main", inputs)
    saved = host.run("save")
    np.testing.assert_array_equal(saved["run_count"], np.array([3], np.int64))
    host.run("load")
    np.testing.assert_array_equal(host.run("save")["run_count"], [0])


def test_main_before_load_names_the_missing_state_tensor() -> None:
    model = examples.build("simple")
    with pytest.raises(RuntimeUsageError, match=r"reads tensor 'weights'.*run it first"):
        Host(model).run("main", examples.sample_inputs(model))


def test_on_step_reports_each_executed_step_but_not_the_switch() -> None:
    model = examples.build("branches")
    main = model.executable.program(1)
    seen: list[Step] = []
    memory: dict[str, Any] = {
        "a_weight": np.eye(4, dtype=np.float32),
        "b_weight": np.ones((8, 3), np.float32),
    }
    inputs = {"branch": np.array([1], np.int32), "b_input": np.ones((1, 8), np.float32)}
    run_program(
        model.executable,
        main,
        memory,
        lambda s: inputs[s.anchor or ""],
        lambda s, a: None,
        seen.append,
    )
    switch = main.steps[1]
    assert switch.op == "switch"
    assert seen == [main.steps[0], *switch.branches[1]]


def test_callback_errors_propagate_unchanged() -> None:
    model = examples.build("noop")

    def failing(_step: Step) -> Any:
        raise KeyError("no data for you")

    with pytest.raises(KeyError, match="no data for you"):
        run_program(model.executable, model.executable.program(1), {}, failing, lambda s, a: None)


def test_state_tensors_persist_and_locals_do_not() -> None:
    g = GraphBuilder("state", batch_size=1)
    total = g.counter("total", dtype="float32", amount=2.5)
    g.output("out", g.identity(total), batched=False)
    model = g.build()
    memory: dict[str, Any] = {}
    host_out: list[Any] = []
    for index in (0, 1, 1):
        run_program(
            model.executable,
            model.executable.program(index),
            memory,
            lambda s: np.zeros(0),
            lambda s, a: host_out.append(a.copy()),
        )
    assert set(memory) == {"total"}  # the identity's result did not leak into device state
    np.testing.assert_array_equal(host_out, [[2.5], [5.0]])


def test_unknown_example_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown example 'resnet'; examples: simple, mlp"):
        examples.build("resnet")
    with pytest.raises(ValueError, match=r"unknown example 'resnet'"):
        examples.reference("resnet", {}, {})
