"""GraphBuilder: validation as ops are added, costs, memory, anchors and hashes."""

from __future__ import annotations

import numpy as np
import pytest

from ipuserve.runtime.popef import DataType, GraphBuilder, Step, TensorType, examples


def small_graph() -> GraphBuilder:
    g = GraphBuilder("small", batch_size=2)
    x = g.input("x", (2, 4))
    w = g.weight("w", np.ones((4, 4), np.float32))
    g.output("y", g.relu(g.matmul(x, w)))
    return g


def all_steps(steps: tuple[Step, ...]) -> list[Step]:
    found = []
    for step in steps:
        found.append(step)
        for branch in step.branches:
            found.extend(all_steps(branch))
    return found


# -- validation -----------------------------------------------------------------------


def test_shape_errors_name_the_op_and_its_tensors() -> None:
    g = GraphBuilder("bad", batch_size=2)
    x = g.input("x", (2, 3))
    w = g.weight("w", np.ones((4, 5), np.float32))
    with pytest.raises(
        ValueError,
        match=r"^matmul\(x, w\): inner dimensions differ: "
        r"float32\[2, 3\] @ float32\[4, 5\]",
    ):
        g.matmul(x, w)


def test_dtype_errors_name_the_op_and_its_tensors() -> None:
    g = GraphBuilder("bad", batch_size=2)
    x = g.input("x", (2, 3))
    i = g.input("i", (2, 3), "int32")
    with pytest.raises(ValueError, match=r"^add\(x, i\): inputs must share one dtype"):
        g.add(x, i)


def test_batched_io_must_carry_the_batch_in_the_batch_dimension() -> None:
    g = GraphBuilder("bad", batch_size=4)
    with pytest.raises(
        ValueError,
        match=r"input 'x' has shape \[3, 4\]; batched I/O needs the "
        r"batch size \(4\) in dimension 0",
    ):
        g.input("x", (3, 4))
    assert g.input("lookup", (3, 4), batched=False).shape == (3, 4)


def test_batch_dim_option_moves_the_batch() -> None:
    g = GraphBuilder("dim1", batch_size=4, batch_dim=1)
    with pytest.raises(ValueError, match=r"in dimension 1"):
        g.input("x", (4, 3))
    x = g.input("ok", (3, 4))
    with pytest.raises(ValueError, match=r"output 'bad'"):
        g.output("bad", g.transpose(x))


def test_names_must_be_unique() -> None:
    g = small_graph()
    with pytest.raises(ValueError, match=r"an anchor named 'y' already exists"):
        g.input("y", (2, 4))
    with pytest.raises(ValueError, match=r"a tensor named 'w' already exists"):
        g.counter("w")


def test_tensors_of_another_builder_are_rejected() -> None:
    other = GraphBuilder("other", batch_size=2).input("x", (2, 4))
    g = GraphBuilder("mine", batch_size=2)
    g.input("x", (2, 4))
    with pytest.raises(ValueError, match=r"tensor 'x' does not belong to model 'mine'"):
        g.relu(other)


def test_branch_tensors_are_invisible_outside_their_branch() -> None:
    g = GraphBuilder("scoped", batch_size=1)
    selector = g.input("sel", (1,), "int32")
    with g.switch(selector) as sw:
        with sw.branch():
            inside = g.input("a", (1, 4))
        with (
            sw.branch(),
            pytest.raises(
                ValueError,
                match=r"relu\(a\): tensor 'a' was made in "
                r"another program or switch branch",
            ),
        ):
            g.relu(inside)
    with pytest.raises(ValueError, match=r"tensor 'a'"):
        g.output("leak", inside)


def test_steps_between_branches_are_rejected() -> None:
    g = GraphBuilder("loose", batch_size=1)
    selector = g.input("sel", (1,), "int32")
    with pytest.raises(ValueError, match=r"outside its branches"), g.switch(selector):
        g.input("stray", (1, 4))


def test_switch_needs_an_integer_selector_and_a_branch() -> None:
    g = GraphBuilder("switchy", batch_size=1)
    selector = g.input("f", (1,))
    with (
        pytest.raises(ValueError, match=r"selector 'f' must have an integer dtype"),
        g.switch(selector),
    ):
        pass
    selector = g.input("s", (1,), "int32")
    with pytest.raises(ValueError, match=r"switch on 's' has no branches"), g.switch(selector):
        pass


def test_save_output_takes_only_state_tensors() -> None:
    g = small_graph()
    x = g.input("x2", (2, 4))
    with pytest.raises(ValueError, match=r"save output 'x2_back': tensor 'x2' is not a state"):
        g.save_output("x2_back", x)


def test_attributes_must_be_storable() -> None:
    g = GraphBuilder("attrs", batch_size=1)
    with pytest.raises(ValueError, match=r"cannot be stored"):
        g.fill(float("nan"), "float32", (1,))
    # numpy scalars and tuples are stored as plain JSON values
    t = g.fill(np.float32(2), "float32", (np.int64(2), 3))  # type: ignore[arg-type]
    step = g.build().executable.program(1).steps[-1]
    assert t.shape == (2, 3) and step.attrs == {"value": 2.0, "dtype": "float32", "shape": [2, 3]}


# -- what build() records -------------------------------------------------------------


def test_compute_steps_record_dtype_flops_and_streams_record_bytes() -> None:
    model = examples.build(
        "mlp", batch_size=2, input_size=8, hidden_size=6, layers=1, outputs=3, dtype="float16"
    )
    steps = [s for p in model.executable.programs() for s in all_steps(p.steps)]
    anchors = {a.name(): a for a in model.metadata.anchors()}
    for step in steps:
        if step.op in ("stream_in", "stream_out"):
            assert step.host_bytes == anchors[step.anchor or ""].tensorInfo().sizeInBytes()
            assert step.flops == 0
        else:
            assert step.attrs["dtype"] == "float16" and step.host_bytes == 0
    matmuls = [s.flops for s in steps if s.op == "matmul"]
    assert matmuls == [2 * 2 * 8 * 6, 2 * 2 * 6 * 3]
    assert [s.flops for s in steps if s.op == "gelu"] == [8 * 2 * 6]


def test_memory_is_state_plus_peak_live_activations() -> None:
    # state: w (64 B). main: x (32) -> matmul (32) -> relu (32) -> out; at most two live.
    assert small_graph().build().executable.memoryBytes() == 64 + 64


def test_identity_results_share_their_input_memory() -> None:
    model = examples.build("noop", elements=1024)
    assert model.executable.memoryBytes() == 4096
    assert model.executable.zeroTime()


def test_anchors_know_their_direction_and_programs() -> None:
    metadata = examples.build("simple").metadata
    found = {a.name(): (a.type(), a.programs()) for a in metadata.anchors()}
    assert found == {
        "tensor_A": (TensorType.INPUT, [1]),
        "tensor_B": (TensorType.INPUT, [1]),
        "weights": (TensorType.INPUT, [0]),
        "output": (TensorType.OUTPUT, [1]),
        "run_count": (TensorType.OUTPUT, [2]),
    }
    assert metadata.anchor("run_count").tensorInfo().dataType() is DataType.S64
    flow = metadata.programFlow()
    assert (flow.load(), flow.main(), flow.save()) == ([0], [1], [2])


def test_branch_anchors_are_streamed_inside_their_branch() -> None:
    main = examples.build("branches").executable.program(1)
    switch = next(s for s in main.steps if s.op == "switch")
    branch_anchors = [{s.anchor for s in b if s.anchor} for b in switch.branches]
    assert branch_anchors == [{"a_input", "a_output"}, {"b_input", "b_output"}]
    assert [s.anchor for s in main.steps if s.anchor] == ["branch"]


def test_hash_covers_the_executable_not_the_weights() -> None:
    one = examples.build("simple", seed=1)
    same_graph = examples.build("simple", seed=2)
    other_batch = examples.build("simple", batch_size=2)
    assert one.executable.hash() == same_graph.executable.hash()
    assert one.executable.hash() != other_batch.executable.hash()
    assert one.metadata.executableHash() == one.executable.hash()
    assert not np.array_equal(
        one.tensorData["weights"].array(), same_graph.tensorData["weights"].array()
    )


def test_weights_are_copied_and_read_only() -> None:
    values = np.ones(4, np.float32)
    g = GraphBuilder("copy", batch_size=1)
    g.weight("w", values)
    values[0] = 5
    stored = g.build().tensorData["w"].array()
    assert stored[0] == 1 and not stored.flags.writeable


def test_build_inside_an_open_switch_is_refused() -> None:
    g = GraphBuilder("open", batch_size=1)
    with (
        g.switch(g.input("s", (1,), "int32")) as sw,
        sw.branch(),
        pytest.raises(ValueError, match=r"inside an open switch"),
    ):
        g.build()
