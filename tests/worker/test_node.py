"""WorkerNode on a thread against a fake broker (a bare ROUTER): the worker's whole protocol."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ipuserve import protocol as wire
from ipuserve.worker.backend import Backend, FunctionBackend
from ipuserve.worker.config import WorkerConfig
from ipuserve.worker.node import WorkerNode
from tests.helpers import time_scale_for_run, wait_until, write_example
from tests.worker.fakes import ADD, FakeBroker, GatedAdd, add, add_inputs, add_job


class RunningNode:
    def __init__(self, node: WorkerNode) -> None:
        self.node = node
        self.exit_code: int | None = None
        self.thread = threading.Thread(target=self._run, name="worker-node", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.exit_code = self.node.run()

    def stop(self) -> int | None:
        self.node.request_stop()
        self.thread.join(10)
        assert not self.thread.is_alive(), "the worker loop did not stop"
        return self.exit_code


StartNode = Callable[..., RunningNode]


@pytest.fixture
def broker() -> Iterator[FakeBroker]:
    fake = FakeBroker()
    yield fake
    fake.close()


@pytest.fixture
def start_node(broker: FakeBroker) -> Iterator[StartNode]:
    nodes: list[RunningNode] = []

    def start(
        backend: Backend, node_class: type[WorkerNode] = WorkerNode, **overrides: Any
    ) -> RunningNode:
        settings: dict[str, Any] = {
            "broker": broker.endpoint,
            "worker_id": "w1",
            "heartbeat_ms": 50,
            "handshake_timeout_ms": 300,
            "reconnect_min_ms": 10,
            "reconnect_max_ms": 50,
            "drain_timeout_ms": 5000,
            **overrides,
        }
        node = RunningNode(node_class(backend, WorkerConfig(**settings)))
        nodes.append(node)
        return node

    yield start
    for node in nodes:
        node.stop()


def expect_result(broker: FakeBroker, job_id: bytes, inputs: dict[str, Any]) -> wire.Result:
    _identity, result = broker.expect(wire.Result)
    assert result.job_id == job_id
    np.testing.assert_allclose(result.tensors.arrays()["z"], inputs["x"] + 2 * inputs["y"])
    return result  # type: ignore[no-any-return]


def expect_fail(broker: FakeBroker, job_id: bytes, code: str) -> wire.Fail:
    _identity, fail = broker.expect(wire.Fail)
    assert (fail.job_id, fail.code) == (job_id, code), fail
    return fail  # type: ignore[no-any-return]


def test_hello_welcome_then_jobs_are_answered_with_timing(
    broker: FakeBroker, start_node: StartNode
) -> None:
    start_node(GatedAdd().backend(), credit=3)
    identity, hello = broker.expect(wire.Hello)
    assert (hello.worker_id, hello.credit) == ("w1", 3)
    broker.send(identity, wire.Welcome("epoch1", 50, 60_000))
    inputs = broker.job(identity, b"j1")
    result = expect_result(broker, b"j1", inputs)
    assert set(result.timing) == {"device_us", "worker_queue_us", "worker_us"}
    _identity, beat = broker.recv(heartbeats=True)
    assert isinstance(beat, wire.Heartbeat) and beat.in_flight == 0


@pytest.mark.parametrize(
    ("job", "code"),
    [
        ({"model": "mul"}, "UNKNOWN_MODEL"),
        ({"budget_ms": -1.0}, "DEADLINE_EXCEEDED"),
    ],
    ids=["unknown model", "no budget left"],
)
def test_jobs_the_worker_cannot_run_fail_with_a_code(
    broker: FakeBroker, start_node: StartNode, job: dict[str, Any], code: str
) -> None:
    model = GatedAdd()
    start_node(model.backend())
    identity = broker.welcome()
    broker.job(identity, b"bad", **job)
    expect_fail(broker, b"bad", code)
    assert model.most_running == 0
    inputs = broker.job(identity, b"good")
    expect_result(broker, b"good", inputs)


def test_a_job_with_a_bad_frame_fails_alone(broker: FakeBroker, start_node: StartNode) -> None:
    start_node(GatedAdd().backend())
    identity = broker.welcome()
    inputs = add_inputs()
    batch = wire.Jobs(
        tuple(add_job(job_id, wire.Tensors.of(inputs), None, "add") for job_id in (b"j1", b"j2"))
    )
    frames = batch.encode()
    broker.socket.send_multipart([identity, *frames[:-1], b"short"])  # j2's y
    # in either order: j1 may finish on the backend's thread before the loop sends j2's FAIL
    answers = {message.job_id: message for message in (broker.recv()[1] for _ in range(2))}
    fail, result = answers[b"j2"], answers[b"j1"]
    assert isinstance(fail, wire.Fail) and fail.code == "INVALID_INPUT", fail
    assert "needs 64 bytes" in fail.message
    assert isinstance(result, wire.Result), result
    np.testing.assert_allclose(result.tensors.arrays()["z"], inputs["x"] + 2 * inputs["y"])


def test_a_batch_that_cannot_be_read_fails_every_job_it_names(
    broker: FakeBroker, start_node: StartNode
) -> None:
    start_node(GatedAdd().backend())
    identity = broker.welcome()
    batch = wire.Jobs(
        tuple(add_job(job_id, wire.Tensors.of(add_inputs())) for job_id in (b"a", b"b"))
    )
    frames = batch.encode()
    broker.socket.send_multipart([identity, *frames[:-1]])  # a frame short
    for job_id in (b"a", b"b"):
        fail = expect_fail(broker, job_id, "BAD_MESSAGE")
        assert "3 tensor frame(s) follow" in fail.message
    inputs = broker.job(identity, b"good")
    expect_result(broker, b"good", inputs)


def test_outcomes_ready_together_leave_in_one_results(
    broker: FakeBroker, start_node: StartNode
) -> None:
    """Jobs of one batch answered inline finish in one turn of the loop: one RESULTS."""
    node = start_node(FunctionBackend({ADD: add}, threads=0, capacity=8))
    identity = broker.welcome()
    inputs = add_inputs()
    jobs = tuple(add_job(b"j%d" % i, wire.Tensors.of(inputs), None, "add") for i in range(5))
    broker.send(identity, wire.Jobs((*jobs, add_job(b"bad", wire.Tensors.of({}), None, "mul"))))
    message = broker.next_message(wire.Results)
    assert [r.job_id for r in message.results] == [job.job_id for job in jobs]
    assert [(f.job_id, f.code) for f in message.failures] == [(b"bad", "UNKNOWN_MODEL")]
    assert node.stop() == 0


def test_never_more_than_credit_jobs_run_at_once(broker: FakeBroker, start_node: StartNode) -> None:
    """Jobs beyond the credit (a broker restart's overlap) wait; beyond twice it, refused."""
    model = GatedAdd(gated=True)
    start_node(model.backend(threads=4), credit=1)
    identity = broker.welcome()
    sent = {b"j%d" % i: broker.job(identity, b"j%d" % i) for i in range(2)}
    broker.job(identity, b"j2")
    expect_fail(broker, b"j2", "OVERLOADED")
    model.wait_started()
    model.gate.set()
    for _ in sent:
        _identity, result = broker.expect(wire.Result)
        inputs = sent[result.job_id]
        np.testing.assert_allclose(result.tensors.arrays()["z"], inputs["x"] + 2 * inputs["y"])
    assert model.most_running == 1


def test_reconnect_on_request_keeps_results_of_the_same_epoch(
    broker: FakeBroker, start_node: StartNode
) -> None:
    model = GatedAdd(gated=True)
    start_node(model.backend())
    first = broker.welcome("epoch1")
    inputs = broker.job(first, b"j1")
    model.wait_started()
    broker.send(first, wire.Reconnect())
    second = broker.welcome("epoch1")
    assert second != first  # a fresh socket
    model.gate.set()
    expect_result(broker, b"j1", inputs)


def test_results_of_an_old_epoch_are_dropped(
    broker: FakeBroker, start_node: StartNode, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="ipuserve.worker")
    model = GatedAdd(gated=True)
    start_node(model.backend())
    first = broker.welcome("epoch1")
    broker.job(first, b"old")
    model.wait_started()
    broker.send(first, wire.Reconnect())
    second = broker.welcome("epoch2")
    # the log says what happens to the job already running: it once said "dropped 0"
    said = "dropped 0 waiting job(s) and unsent result(s) of the old one; 1 job(s) of it "
    wait_until(lambda: said in caplog.text)
    model.gate.set()
    inputs = broker.job(second, b"new")
    expect_result(broker, b"new", inputs)  # and never a RESULT for "old"


def test_a_silent_broker_is_left_for_a_fresh_connection(
    broker: FakeBroker, start_node: StartNode
) -> None:
    start_node(GatedAdd().backend())
    first = broker.welcome(liveness_ms=200)  # then the fake broker never heartbeats
    second = broker.welcome()
    assert second != first


class WaitRecordingNode(WorkerNode):
    """A WorkerNode that notes every pause it takes between attempts to reach the broker."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.waits: list[float] = []
        wait = self._joiner.wait

        def recording(seconds: float) -> None:
            self.waits.append(seconds)
            wait(seconds)

        setattr(self._joiner, "wait", recording)  # noqa: B010 (mypy: no method assignment)


def test_an_unanswered_hello_is_retried_with_backoff(
    broker: FakeBroker, start_node: StartNode
) -> None:
    running = start_node(
        GatedAdd().backend(), node_class=WaitRecordingNode, reconnect_min_ms=5, reconnect_max_ms=20
    )
    ignored = {broker.expect(wire.Hello)[0] for _ in range(4)}  # each from a fresh socket
    answered = broker.welcome()
    assert len(ignored | {answered}) == 5
    # One pause before each of the 4 retries (taken before that retry's HELLO left),
    # doubling from reconnect_min_ms and capped at reconnect_max_ms.
    node = running.node
    assert isinstance(node, WaitRecordingNode)
    assert node.waits == pytest.approx([0.005, 0.01, 0.02, 0.02])


def test_stop_drains_finishes_running_jobs_and_hands_back_the_rest(
    broker: FakeBroker, start_node: StartNode
) -> None:
    model = GatedAdd(gated=True)
    node = start_node(model.backend(), credit=1)
    identity = broker.welcome()
    running = broker.job(identity, b"running")
    broker.job(identity, b"waiting")
    model.wait_started()
    node.node.request_stop()
    _identity, beat = broker.recv(heartbeats=True)
    while not (isinstance(beat, wire.Heartbeat) and beat.credit == 0):
        _identity, beat = broker.recv(heartbeats=True)
    broker.job(identity, b"late")
    while not (isinstance(beat, wire.Heartbeat) and beat.in_flight == 3):
        _identity, beat = broker.recv(heartbeats=True)  # the node holds all three
    model.gate.set()
    expect_result(broker, b"running", running)
    _identity, bye = broker.expect(wire.Bye)
    assert sorted(bye.handed_back) == [b"late", b"waiting"]
    assert node.stop() == 0


def test_the_drain_timeout_hands_back_jobs_still_running(
    broker: FakeBroker, start_node: StartNode
) -> None:
    model = GatedAdd(gated=True)
    node = start_node(model.backend(), drain_timeout_ms=100)
    identity = broker.welcome()
    broker.job(identity, b"stuck")
    model.wait_started()
    node.node.request_stop()
    _identity, bye = broker.expect(wire.Bye)
    assert bye.handed_back == (b"stuck",)
    model.gate.set()
    assert node.stop() == 0


def group_of(count: int, rows: int = 2) -> list[dict[str, np.ndarray[Any, Any]]]:
    rng = np.random.default_rng(count)
    return [
        {name: rng.standard_normal((rows, 8), dtype=np.float32) for name in ("x", "y")}
        for _ in range(count)
    ]


def send_group(broker: FakeBroker, identity: bytes, job_id: bytes, given: list[Any]) -> None:
    tensors = wire.Tensors.group([wire.Tensors.of(inputs) for inputs in given])
    broker.send(identity, wire.Jobs((add_job(job_id, tensors, None, "add"),)))


def test_a_group_job_runs_once_and_answers_each_member(
    broker: FakeBroker, start_node: StartNode
) -> None:
    model = GatedAdd()
    start_node(model.backend())
    identity = broker.welcome()
    given = group_of(3)
    send_group(broker, identity, b"g", given)
    _identity, result = broker.expect(wire.Result)
    assert (result.job_id, result.tensors.members) == (b"g", 3)
    for member, inputs in zip(result.tensors.split(), given, strict=True):
        np.testing.assert_allclose(member.arrays()["z"], inputs["x"] + 2 * inputs["y"])
    model.wait_started(1)
    assert not model.started.acquire(timeout=0), "the group ran as more than one call"


def test_a_group_for_a_model_without_a_batching_dim_fails(
    broker: FakeBroker, start_node: StartNode
) -> None:
    fixed = wire.ModelSpec("add", ADD.inputs, ADD.outputs, 4, None)
    start_node(FunctionBackend({fixed: add}))
    identity, _hello = broker.expect(wire.Hello)
    broker.send(identity, wire.Welcome("epoch1", 50, 60_000))
    send_group(broker, identity, b"g", group_of(2, rows=4))
    fail = expect_fail(broker, b"g", "INVALID_INPUT")
    assert "cannot take a group" in fail.message


def test_outputs_that_do_not_split_into_the_group_fail_it(
    broker: FakeBroker, start_node: StartNode
) -> None:
    start_node(FunctionBackend({ADD: lambda t: {"z": t["x"][:1]}}))
    identity = broker.welcome()
    send_group(broker, identity, b"g", group_of(3))
    fail = expect_fail(broker, b"g", "INFERENCE_FAILED")
    assert "does not split into 3 equal parts" in fail.message


# ---------------------------------------------------------------- jobs waiting for room


def _simple_jobs(count: int, budget_ms: float | None) -> wire.Jobs:
    rng = np.random.default_rng(7)
    arrays = [
        {n: rng.standard_normal((4, 4)).astype(np.float32) for n in ("tensor_A", "tensor_B")}
        for _ in range(count)
    ]
    return wire.Jobs(
        tuple(
            add_job(b"j%02d" % i, wire.Tensors.of(a), budget_ms, "simple")
            for i, a in enumerate(arrays)
        )
    )


def _runner_backend(tmp_path: Path) -> Backend:
    from ipuserve.worker.runner_backend import RunnerBackend

    return RunnerBackend([write_example(tmp_path / "simple.popef", "simple", "--batch-size", "4")])


def test_jobs_waiting_for_room_are_all_answered_after_a_device_fault(
    broker: FakeBroker, start_node: StartNode, tmp_path: Path
) -> None:
    """With the device faulted, each hand-over is refused at once; the jobs kept waiting
    for room were then never started (nothing more came to start them): 6 of 12 jobs
    were held for ever."""
    backend = _runner_backend(tmp_path)
    start_node(backend)
    identity, _hello = broker.expect(wire.Hello)
    broker.send(identity, wire.Welcome("epoch1", 50, 60_000))
    backend.runner._replicas[0].device.injectFault()  # type: ignore[attr-defined]
    broker.send(identity, _simple_jobs(12, None))
    codes = [broker.expect(wire.Fail)[1].code for _ in range(12)]
    assert set(codes) <= {"INFERENCE_FAILED", "WORKER_FAILED"}, codes


def test_jobs_waiting_for_room_are_answered_at_their_deadline(
    broker: FakeBroker, start_node: StartNode, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not when the device next finishes a batch: the broker has answered their clients,
    and until then they held the worker's credit."""
    model = write_example(tmp_path / "simple.popef", "simple", "--batch-size", "4")
    monkeypatch.setenv("IPUSERVE_SIM_TIME_SCALE", time_scale_for_run(model, 0.5))  # a batch
    start_node(_runner_backend(tmp_path))
    identity, _hello = broker.expect(wire.Hello)
    broker.send(identity, wire.Welcome("epoch1", 50, 60_000))
    broker.send(identity, _simple_jobs(12, 200.0))  # 3 start, 9 wait; all expire at 0.2 s
    first = [broker.recv()[1] for _ in range(9)]
    assert all(isinstance(o, wire.Fail) and o.code == "DEADLINE_EXCEEDED" for o in first), first


class _BackendWithoutRoomFor:
    """A backend written to the seam before room_for existed."""

    def __init__(self, inner: FunctionBackend) -> None:
        self.describe, self.capacity = inner.describe, inner.capacity
        self.submit_all, self.close = inner.submit_all, inner.close


def test_a_backend_without_room_for_is_handed_every_job(
    broker: FakeBroker, start_node: StartNode
) -> None:
    """room_for came later; such a backend crashed the socket loop at the first JOBS."""
    start_node(_BackendWithoutRoomFor(GatedAdd().backend()))  # type: ignore[arg-type]
    identity = broker.welcome()
    inputs = broker.job(identity, b"j1")
    expect_result(broker, b"j1", inputs)
