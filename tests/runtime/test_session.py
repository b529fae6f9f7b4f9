"""The low-level API: Session, anchor callbacks, predicates and QueueManager, end to end."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

import ipuserve.runtime as model_runtime
from ipuserve.errors import (
    ClosedError,
    DeviceMemoryError,
    DeviceRequestError,
    RuntimeUsageError,
    TensorError,
)
from ipuserve.runtime import anchor_callbacks, popef_data_usage
from ipuserve.runtime.popef import examples
from ipuserve.runtime.popef.types import Model
from ipuserve.runtime.predicates import (
    AnchorCallbackPolicy,
    AnchorWithPolicy,
    PopefDataUsagePolicy,
    ProgramsWithPolicy,
)

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


def test_callbacks_end_to_end(simple: Model, device: model_runtime.Device) -> None:
    session = model_runtime.Session(simple)
    session.bindToDevice(device)
    a, b = np.full((2, 4), 2.0, np.float32), np.ones((2, 4), np.float32)
    captured: list[np.ndarray] = []
    session.setCallbackForAnchor("tensor_A", feed(a))
    session.setCallbackForAnchor("tensor_B", feed(b))
    session.setCallbackForAnchor("output", lambda out: captured.append(out.copy()))
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
