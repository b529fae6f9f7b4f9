"""The low-level API: Session, anchor callbacks, predicates and QueueManager, end to end."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ipuserve.runtime as model_runtime
from ipuserve.errors import (
    ClosedError,
    DeviceFaultError,
    DeviceMemoryError,
    DeviceRequestError,
    RuntimeUsageError,
    TensorError,
)
from ipuserve.runtime import anchor_callbacks, popef_data_usage
from ipuserve.runtime.popef import examples, write_model
from ipuserve.runtime.popef.types import Model
from ipuserve.runtime.predicates import (
    AnchorCallbackPolicy,
    AnchorWithPolicy,
    PopefDataUsagePolicy,
    ProgramsWithPolicy,
)
from tests.runtime.test_ring_buffer import Background

LOAD, MAIN, SAVE = 0, 1, 2
Policy = AnchorCallbackPolicy


@pytest.fixture
def device() -> Iterator[model_runtime.Device]:
    device = model_runtime.DeviceManager().getDevice(1)
    yield device
    device.detach()


@pytest.fixture(scope="module")
def simple() -> Model:
    return examples.build("simple", batch_size=2)


def feed(array: np.ndarray):
    """An input callback that fills the device's buffer (the C++ way)."""

    def fill(buffer: np.ndarray) -> None:
        buffer[...] = array

    return fill


def fed_simple(
    simple: Model, device: model_runtime.Device, a: np.ndarray, b: np.ndarray
) -> tuple[model_runtime.Session, list[np.ndarray]]:
    """A session of the simple model on ``device``, fed ``a`` and ``b`` by callbacks;
    the list collects a copy of each run's output."""
    session = model_runtime.Session(simple)
    session.bindToDevice(device)
    outputs: list[np.ndarray] = []
    session.setCallbackForAnchor("tensor_A", feed(a))
    session.setCallbackForAnchor("tensor_B", feed(b))
    session.setCallbackForAnchor("output", lambda out: outputs.append(out.copy()))
    return session, outputs


def test_callbacks_end_to_end(simple: Model, device: model_runtime.Device) -> None:
    a, b = np.full((2, 4), 2.0, np.float32), np.ones((2, 4), np.float32)
    session, captured = fed_simple(simple, device, a, b)
    session.runMainPrograms()  # runs the load program first, implicitly
    session.runMainPrograms()
    expected = examples.reference(
        "simple", {"tensor_A": a, "tensor_B": b}, examples.tensor_arrays(simple)
    )["output"]
    assert len(captured) == 2
    np.testing.assert_allclose(captured[0], expected, rtol=1e-6)
    counter: list[np.ndarray] = []
    session.setCallbackForAnchor("run_count", lambda c: counter.append(c.copy()))
    session.runSavePrograms()
    assert counter[0].tolist() == [2]


def test_queue_manager_packs_requests_into_one_run(device: model_runtime.Device) -> None:
    model = examples.build("mlp", batch_size=16, input_size=8, hidden_size=16)
    session = model_runtime.Session(model)
    session.bindToDevice(device)
    queues = session.createQueueManager()
    assert set(queues.inputs) == {"input"} and set(queues.outputs) == {"logits", "probs"}
    requests = [
        np.random.default_rng(i).standard_normal((n, 8)).astype(np.float32)
        for i, n in enumerate((5, 3, 8))
    ]
    results: list[dict[str, np.ndarray]] = [{} for _ in requests]
    for data, result in zip(requests, results, strict=True):
        queues.inputQueue("input").enqueue(data)
        for name in ("logits", "probs"):
            queues.outputQueue(name).enqueue(
                np.zeros((len(data), 10), np.float32),
                None,
                lambda filled, r=result, n=name: r.__setitem__(n, filled),
            )
    session.runMainPrograms()  # one run: 5 + 3 + 8 = 16 samples
    tensor_data = examples.tensor_arrays(model)
    for data, result in zip(requests, results, strict=True):
        want = examples.reference("mlp", {"input": data}, tensor_data)
        for name in ("logits", "probs"):
            np.testing.assert_allclose(result[name], want[name], rtol=1e-5, atol=1e-6)


def test_queue_manager_flush_pads_a_partial_batch(device: model_runtime.Device) -> None:
    model = examples.build("mlp", batch_size=16, input_size=8, hidden_size=16)
    session = model_runtime.Session(model)
    session.bindToDevice(device)
    queues = session.createQueueManager(
        model_runtime.ring_size_multiplier_factory.ringSizeMultForMainProgs(model, 3)
    )
    assert queues.inputQueue("input").numBuffers() == 48
    data = np.ones((3, 8), np.float32)
    got: list[np.ndarray] = []
    queues.inputQueue("input").enqueue(data)
    queues.outputQueue("logits").enqueue(None, 3 * 40, got.append)
    queues.outputQueue("probs").enqueue(None, 3 * 40, got.append)
    queues.flushAll()
    session.runMainPrograms()
    assert [g.shape for g in got] == [(3, 10), (3, 10)]
    with pytest.raises(TensorError, match="no input queue for tensor 'nope'; input queues: input"):
        queues.inputQueue("nope")


def test_tensor_data_binding_follows_the_predicate(
    simple: Model, device: model_runtime.Device
) -> None:
    config = model_runtime.SessionConfig(
        pred_tensor_data=popef_data_usage.predAnchorsPolicies(
            [AnchorWithPolicy("weights", PopefDataUsagePolicy.USE_USER_DATA)]
        )
    )
    session = model_runtime.Session(simple, config)
    session.bindToDevice(device)
    missing = session.anchorsNotConnectedToCallbacks([LOAD, MAIN])
    assert {p: [a.name() for a in anchors] for p, anchors in missing.items()} == {
        LOAD: ["weights"],
        MAIN: ["tensor_A", "tensor_B", "output"],
    }
    with pytest.raises(RuntimeUsageError, match="program 0: weights; program 1: tensor_A"):
        session.errorIfAnchorsAreNotConnectedToCallbacks([LOAD, MAIN])
    weights = np.array([1, 2, 3, 4], np.float32)
    out: list[np.ndarray] = []
    session.setCallbackForAnchor("weights", feed(weights))
    session.setCallbackForAnchor("tensor_A", feed(np.ones((2, 4), np.float32)))
    session.setCallbackForAnchor("tensor_B", feed(np.zeros((2, 4), np.float32)))
    session.setCallbackForAnchor("output", lambda o: out.append(o.copy()))
    session.runMainPrograms()
    np.testing.assert_array_equal(out[0], np.tile(weights, (2, 1)))


def test_user_input_handler_with_predicates(simple: Model, device: model_runtime.Device) -> None:
    session = model_runtime.Session(simple)
    session.bindToDevice(device)
    asked: list[str] = []

    def factory(info: model_runtime.CallbackInfo):
        asked.append(info.anchor.name())
        return feed(np.ones((2, 4), np.float32))

    flow = simple.metadata.programFlow()
    session.setUserInputHandler(
        factory, anchor_callbacks.predProgramFlowMain(flow), skip_connected=True
    )
    assert asked == ["tensor_A", "tensor_B"]  # weights is connected to its tensor data
    outputs: list[str] = []
    session.setUserOutputHandler(
        lambda info: outputs.append(info.anchor.name()) or (lambda _o: None),
        anchor_callbacks.predProgramFlowMain(flow),
    )  # run_count gets the empty callback
    assert outputs == ["output"]
    session.runMainPrograms()
    session.runSavePrograms()  # run_count is bound to the empty callback: no error
    assert not session.anchorsNotConnectedToCallbacks([LOAD, MAIN, SAVE])


def test_the_spec_namespace_predicate_factory_holds_both_factories(simple: Model) -> None:
    flow = simple.metadata.programFlow()
    main = model_runtime.predicate_factory.anchor_callbacks.predProgramFlowMain(flow)
    tensor_a = simple.metadata.anchor("tensor_A")
    assert main(tensor_a) is Policy.BIND_USER_CB
    assert model_runtime.predicate_factory.popef_data_usage is popef_data_usage


def test_predicate_factories(simple: Model) -> None:
    anchors = {a.name(): a for a in simple.metadata.anchors()}
    flow = simple.metadata.programFlow()
    main = anchor_callbacks.predProgramFlowMain(flow)
    save = anchor_callbacks.predProgramFlowSave(flow, Policy.SKIP_CB, Policy.BIND_USER_CB)
    assert main(anchors["tensor_A"]) is Policy.BIND_USER_CB
    assert main(anchors["weights"]) is Policy.BIND_EMPTY_CB
    assert save(anchors["run_count"]) is Policy.SKIP_CB
    both = anchor_callbacks.andBind(
        Policy.BIND_USER_CB, Policy.SKIP_CB, main, anchor_callbacks.predNonScalarType()
    )
    either = anchor_callbacks.orBind(
        Policy.BIND_USER_CB, Policy.SKIP_CB, main, anchor_callbacks.predProgramFlowLoad(flow)
    )
    assert both(anchors["tensor_A"]) is Policy.BIND_USER_CB
    assert both(anchors["weights"]) is Policy.SKIP_CB
    assert either(anchors["weights"]) is Policy.BIND_USER_CB
    assert either(anchors["run_count"]) is Policy.SKIP_CB
    grouped = anchor_callbacks.predProgramIndexes(
        [
            ProgramsWithPolicy([SAVE], Policy.SKIP_CB),
            ProgramsWithPolicy([LOAD], Policy.BIND_USER_CB),
        ],
        Policy.BIND_EMPTY_CB,
    )
    assert [grouped(anchors[n]) for n in ("run_count", "weights", "output")] == [
        Policy.SKIP_CB,
        Policy.BIND_USER_CB,
        Policy.BIND_EMPTY_CB,
    ]
    indexes = anchor_callbacks.predProgramIndexes([LOAD])
    assert indexes(anchors["weights"]) is Policy.BIND_USER_CB
    assert anchor_callbacks.predProgramNotAssigned()(anchors["output"]) is Policy.BIND_EMPTY_CB
    data = popef_data_usage.predProgramFlowLoad(flow)
    assert data(anchors["weights"]) is PopefDataUsagePolicy.USE_USER_DATA


def test_stop_and_reload(simple: Model, device: model_runtime.Device) -> None:
    session = model_runtime.Session(simple)
    session.bindToDevice(device)
    for name in ("tensor_A", "tensor_B"):
        session.setCallbackForAnchor(name, feed(np.ones((2, 4), np.float32)))
    counts: list[int] = []
    session.setCallbackForAnchor("output", lambda _o: None)
    session.setCallbackForAnchor("run_count", lambda c: counts.append(int(c[0])))
    session.runMainPrograms()
    session.stop()
    assert session.isStopped()
    with pytest.raises(ClosedError, match="reload"):
        session.runMainPrograms()
    session.reload()
    assert not session.isStopped()
    session.runMainPrograms()  # fresh device memory: the load program ran again
    session.runSavePrograms()
    assert counts == [1]


def test_sessions_sharing_a_device_swap_with_implicit_save_and_load(
    device: model_runtime.Device,
) -> None:
    models = [examples.build("simple", batch_size=2, seed=s) for s in (1, 2)]
    outputs: list[list[np.ndarray]] = [[], []]
    saved: list[list[int]] = [[], []]
    sessions = []
    for i, model in enumerate(models):
        session = model_runtime.Session(model)
        session.bindToDevice(device)
        for name in ("tensor_A", "tensor_B"):
            session.setCallbackForAnchor(name, feed(np.ones((2, 4), np.float32)))
        session.setCallbackForAnchor("output", lambda o, i=i: outputs[i].append(o.copy()))
        session.setCallbackForAnchor("run_count", lambda c, i=i: saved[i].append(int(c[0])))
        sessions.append(session)
    sessions[0].runMainPrograms()
    sessions[0].runMainPrograms()
    sessions[1].runMainPrograms()  # takes the device: session 0 saves first
    assert saved == [[2], []]
    sessions[0].runMainPrograms()  # back again: session 1 saves, session 0 loads afresh
    assert saved == [[2], [1]]
    for i, model in enumerate(models):
        want = examples.reference(
            "simple",
            {"tensor_A": np.ones((2, 4), np.float32), "tensor_B": np.ones((2, 4), np.float32)},
            examples.tensor_arrays(model),
        )["output"]
        for got in outputs[i]:
            np.testing.assert_allclose(got, want, rtol=1e-6)


def test_conditional_branch_reads_only_its_inputs(device: model_runtime.Device) -> None:
    model = examples.build("branches")
    session = model_runtime.Session(model)
    session.bindToDevice(device)
    read: list[str] = []

    def source(name: str, array: np.ndarray):
        def fill(buffer: np.ndarray) -> None:
            read.append(name)
            buffer[...] = array

        return fill

    a = np.ones((1, 4), np.float32)
    session.setCallbackForAnchor("branch", source("branch", np.array([0], np.int32)))
    session.setCallbackForAnchor("a_input", source("a_input", a))
    session.setCallbackForAnchor("b_input", source("b_input", np.ones((1, 8), np.float32)))
    got: dict[str, np.ndarray] = {}
    session.setCallbackForAnchor("a_output", lambda o: got.__setitem__("a_output", o.copy()))
    session.setCallbackForAnchor("b_output", lambda o: got.__setitem__("b_output", o.copy()))
    session.runMainPrograms()
    assert read == ["branch", "a_input"] and set(got) == {"a_output"}
    want = examples.reference(
        "branches", {"branch": np.array([0], np.int32), "a_input": a}, examples.tensor_arrays(model)
    )
    np.testing.assert_allclose(got["a_output"], want["a_output"], rtol=1e-6)


def test_immediate_launch_policy_acquires_a_device(simple: Model) -> None:
    session = model_runtime.Session(
        simple, model_runtime.SessionConfig(policy=model_runtime.LaunchPolicy.Immediate)
    )
    bound = session.device()
    assert bound is not None and bound.numIpus() == 1
    assert [a.name() for a in session.getInputAnchors()] == ["tensor_A", "tensor_B", "weights"]
    session.unloadFromDevice()
    assert not bound.isAttached()
    with pytest.raises(RuntimeUsageError, match="not bound to a device"):
        session.runMainPrograms()


def test_a_model_too_large_for_the_device(simple: Model) -> None:
    big = examples.build("mlp", input_size=784, hidden_size=1024)
    small = model_runtime.DeviceManager().createSmallIpuModelDevice(1)
    session = model_runtime.Session(big)
    with pytest.raises(DeviceMemoryError, match=r"'mlp' needs 7\.\d MiB.*has 2\.4 MiB"):
        session.bindToDevice(small)
    small.detach()


def test_device_must_match_the_compiled_ipus(simple: Model) -> None:
    pair = model_runtime.DeviceManager().getDevice(2)
    try:
        with pytest.raises(DeviceRequestError, match=r"compiled for 1 IPU.*has 2"):
            model_runtime.Session(simple).bindToDevice(pair)
    finally:
        pair.detach()


def test_unknown_anchor(simple: Model) -> None:
    with pytest.raises(TensorError, match="no anchor 'tensor_C'; its anchors are: output"):
        model_runtime.Session(simple).setCallbackForAnchor("tensor_C", lambda _b: None)


def test_a_strided_zero_copy_input_is_made_contiguous(device: model_runtime.Device) -> None:
    model = examples.build("noop", batch_size=4, elements=3)
    session = model_runtime.Session(model)
    session.bindToDevice(device)
    source = np.asfortranarray(np.arange(12, dtype=np.float32).reshape(4, 3))
    got: list[np.ndarray] = []
    session.setCallbackForAnchor("input", lambda _offered: source)
    session.setCallbackForAnchor("output", got.append)
    session.runMainPrograms()
    assert got[0].flags.c_contiguous
    np.testing.assert_array_equal(got[0], source)


# -- the example models from their files, through the queues -----------------------


def from_files(model: Model, tmp_path: Path) -> model_runtime.Session:
    """A Session over ``model`` written as two files (tensor data in the second)."""
    paths = write_model(model, tmp_path / "model.popef", tmp_path / "weights.popef")
    return model_runtime.Session([str(path) for path in paths])


def collect(into: dict[str, np.ndarray], name: str):
    """A write-complete callback keeping a copy of what the queue delivered."""
    return lambda filled: into.__setitem__(name, np.array(filled))


@pytest.mark.parametrize(
    ("name", "options", "sizes"),
    [
        ("simple", {"batch_size": 2}, (1, 3, 1)),
        ("mlp", {}, (5, 20, 3)),  # the real-sized MLP: 784 -> 2 x 1024 -> 10, batch 16
        ("noop", {"batch_size": 4, "elements": 3}, (1, 6, 2)),
    ],
)
def test_example_models_end_to_end_through_queues(
    tmp_path: Path,
    device: model_runtime.Device,
    name: str,
    options: dict[str, Any],
    sizes: tuple[int, ...],
) -> None:
    """Requests of any size are packed into batches, split across runs and padded."""
    model = examples.build(name, **options)
    session = from_files(model, tmp_path)
    session.bindToDevice(device)
    queues = session.createQueueManager()
    batch = model.metadata.batchSize()
    template = examples.sample_inputs(model)
    rng = np.random.default_rng(3)
    tensor_data = examples.tensor_arrays(model)
    wanted: list[dict[str, np.ndarray]] = []
    results: list[dict[str, np.ndarray]] = [{} for _ in sizes]
    for number, (count, result) in enumerate(zip(sizes, results, strict=True)):
        inputs = {
            anchor: rng.standard_normal((count, *like.shape[1:])).astype(like.dtype)
            for anchor, like in template.items()
        }
        want = examples.reference(name, inputs, tensor_data)
        wanted.append(want)
        for anchor, data in inputs.items():
            queues.inputQueue(anchor).enqueue(data)
        for anchor, expected in want.items():
            memory = np.empty_like(expected) if number % 2 else None  # user's or the queue's
            queues.outputQueue(anchor).enqueue(memory, expected.nbytes, collect(result, anchor))
    queues.flushAll()  # pads the last, partial batch
    runs = -(-sum(sizes) // batch)
    assert all(q.pendingSamples() == runs * batch for q in queues.inputs.values())
    for _ in range(runs):
        session.runMainPrograms()
    assert all(q.pendingSamples() == 0 for q in queues.inputs.values())
    tolerance = {"rtol": 1e-4, "atol": 1e-5} if name == "mlp" else {"rtol": 1e-6}
    for want, got in zip(wanted, results, strict=True):
        assert set(got) == set(want)
        for anchor, expected in want.items():
            np.testing.assert_allclose(got[anchor], expected, **tolerance)


def test_both_branches_through_queues(tmp_path: Path, device: model_runtime.Device) -> None:
    """Conditional execution: each run reads only the queues of the branch it takes."""
    model = examples.build("branches")
    session = from_files(model, tmp_path)
    session.bindToDevice(device)
    queues = session.createQueueManager()
    assert set(queues.inputs) == {"branch", "a_input", "b_input"}
    rng = np.random.default_rng(5)
    requests = [
        {"branch": np.array([0], np.int32), "a_input": rng.standard_normal((1, 4), np.float32)},
        {"branch": np.array([1], np.int32), "b_input": rng.standard_normal((1, 8), np.float32)},
    ]
    tensor_data = examples.tensor_arrays(model)
    for inputs in requests:
        want = examples.reference("branches", inputs, tensor_data)
        got: dict[str, np.ndarray] = {}
        for anchor, data in inputs.items():
            queues.inputQueue(anchor).enqueue(data)
        for anchor, expected in want.items():
            queues.outputQueue(anchor).enqueue(None, expected.nbytes, collect(got, anchor))
        session.runMainPrograms()
        assert set(got) == set(want)
        for anchor, expected in want.items():
            np.testing.assert_allclose(got[anchor], expected, rtol=1e-6)
    assert all(q.pendingSamples() == 0 for q in queues.inputs.values())


def test_stop_releases_a_run_blocked_on_its_queues(device: model_runtime.Device) -> None:
    session = model_runtime.Session(examples.build("noop", batch_size=1, elements=3))
    session.bindToDevice(device)
    device_waits = threading.Event()
    queues = session.createQueueManager(
        timeout_ns=1_000_000, timeout_callback=lambda _ring: device_waits.set()
    )
    run = Background(session.runMainPrograms)
    assert device_waits.wait(10), "the run never waited for its input"
    session.stop()  # disconnects the queues: the run finishes on zeros
    run.result(10)
    assert session.isStopped()
    with pytest.raises(ClosedError, match="reload"):
        session.runMainPrograms()
    with pytest.raises(ClosedError, match="'input' is disconnected"):
        queues.inputQueue("input").enqueue(np.ones((1, 3), np.float32))
    queues.resetAll()
    session.reload()
    data = np.arange(3, dtype=np.float32).reshape(1, 3)
    got: dict[str, np.ndarray] = {}
    queues.inputQueue("input").enqueue(data)
    queues.outputQueue("output").enqueue(None, data.nbytes, collect(got, "output"))
    session.runMainPrograms()
    np.testing.assert_array_equal(got["output"], data)


def test_an_injected_fault_fails_runs_until_reload(
    simple: Model, device: model_runtime.Device
) -> None:
    a, b = np.full((2, 4), 3.0, np.float32), np.ones((2, 4), np.float32)
    session, outputs = fed_simple(simple, device, a, b)
    device.injectFault()
    with pytest.raises(DeviceFaultError, match=r"application runtime error on device 0.*injected"):
        session.runMainPrograms()
    with pytest.raises(DeviceFaultError, match=r"error state.*must be reset.*reload"):
        session.runMainPrograms()
    assert outputs == []  # a failed run hands nothing to the host
    session.reload()
    session.runMainPrograms()
    want = examples.reference(
        "simple", {"tensor_A": a, "tensor_B": b}, examples.tensor_arrays(simple)
    )["output"]
    assert len(outputs) == 1
    np.testing.assert_allclose(outputs[0], want, rtol=1e-6)


def test_ring_sizes_follow_the_multiplier_factory(
    simple: Model, device: model_runtime.Device
) -> None:
    session = model_runtime.Session(simple)
    session.bindToDevice(device)
    factory = model_runtime.ring_size_multiplier_factory.ringSizeMultForProgs([SAVE], 3, 2)
    queues = session.createQueueManager(factory)
    assert set(queues.inputs) == {"tensor_A", "tensor_B"}  # weights: bound to its tensor data
    assert set(queues.outputs) == {"output", "run_count"}
    assert queues.outputQueue("run_count").numBuffers() == 3 * 1  # save program, batch 1
    assert queues.inputQueue("tensor_A").numBuffers() == 2 * 2  # the others, batch 2
    pool = model_runtime.allocateQueueStorage(queues.inputQueue("tensor_A"), extra_buffers=1)
    assert (pool.numBlobs(), pool.blobSize()) == (5, 2 * 4 * 4)


def test_explicit_load_main_save_and_program_lists(
    simple: Model, device: model_runtime.Device
) -> None:
    flow = simple.metadata.programFlow()
    config = model_runtime.SessionConfig(
        pred_tensor_data=popef_data_usage.predProgramFlowLoad(flow)
    )
    session = model_runtime.Session(simple, config)  # weights from us, to count the loads
    session.bindToDevice(device)
    weights = np.array([1, 2, 3, 4], np.float32)
    loads: list[int] = []

    def load_weights(buffer: np.ndarray) -> None:
        loads.append(1)
        buffer[...] = weights

    a, b = np.full((2, 4), 2.0, np.float32), np.ones((2, 4), np.float32)
    outputs: list[np.ndarray] = []
    counts: list[int] = []
    session.setCallbackForAnchor("weights", load_weights)
    session.setCallbackForAnchor("tensor_A", feed(a))
    session.setCallbackForAnchor("tensor_B", feed(b))
    session.setCallbackForAnchor("output", lambda out: outputs.append(out.copy()))
    session.setCallbackForAnchor("run_count", lambda count: counts.append(int(count[0])))
    session.runLoadPrograms()
    session.runMainPrograms()  # loaded already: no implicit load
    assert len(loads) == 1
    session.runPrograms([MAIN, MAIN, SAVE])
    assert counts == [3]
    session.runPrograms([LOAD, MAIN, SAVE])  # a load resets the device-side counter
    assert len(loads) == 2 and counts == [3, 1]
    want = examples.reference("simple", {"tensor_A": a, "tensor_B": b}, {"weights": weights})[
        "output"
    ]
    assert len(outputs) == 4
    for got in outputs:
        np.testing.assert_allclose(got, want, rtol=1e-6)
    session.unloadFromDevice()  # no implicit save; the device is not the session's to detach
    assert counts == [3, 1] and device.isAttached() and session.device() is None
    session.bindToDevice(device)
    session.runMainPrograms()  # bound afresh: the load program runs first
    assert len(loads) == 3
