"""The broker loop in-process (on a thread), driven by raw DEALER clients and fake workers."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator

import numpy as np
import pytest
import zmq

from ipuserve import grouping
from ipuserve import protocol as wire
from ipuserve.broker.loop import Broker
from ipuserve.client import Client
from ipuserve.errors import DeadlineExceeded, UnknownModelError
from tests.broker.conftest import StartBroker
from tests.broker.fakes import ADD, FakeWorker, result_for
from tests.helpers import RawClient, add_inputs, assert_add_reply, labels_of, wait_until

INPUTS = add_inputs(2)


@pytest.fixture
def workers(broker: Broker) -> Iterator[list[FakeWorker]]:
    made: list[FakeWorker] = []
    yield made
    for worker in made:
        worker.close()


def fake(broker: Broker, made: list[FakeWorker], **options: object) -> FakeWorker:
    worker = FakeWorker(broker.backend_endpoint, **options)  # type: ignore[arg-type]
    made.append(worker)
    welcome = worker.hello()
    assert welcome.epoch == broker.epoch
    return worker


def counted(broker: Broker, name: str, **labels: str) -> float:
    """``ipuserve_broker_NAME``'s samples with ``labels``, summed."""
    return broker.metrics.value(f"ipuserve_broker_{name}", **labels)


def loads(client: RawClient) -> dict[str, tuple[int, int]]:
    """worker id -> (credit, in flight), and queued under ''."""
    (info,) = client.models()
    return {"": (info.queued, 0), **{w.worker_id: (w.credit, w.in_flight) for w in info.workers}}


def test_a_request_is_served_and_the_reply_carries_broker_and_worker_timing(
    broker: Broker, client: RawClient, workers: list[FakeWorker]
) -> None:
    worker = fake(broker, workers)
    request_id = client.request("add", INPUTS, timeout_ms=10_000)
    job = worker.job()
    assert job.model == "add" and 0 < job.budget_ms <= 10_000  # type: ignore[operator]
    assert np.array_equal(job.tensors.arrays()["x"], INPUTS["x"])
    worker.answer(job)
    reply = client.recv()
    assert isinstance(reply, wire.Reply) and reply.request_id == request_id
    assert_add_reply(reply, INPUTS)
    assert set(reply.timing) == {"device_us", "broker_queue_us"}


def test_a_worker_never_holds_more_than_its_credit(
    broker: Broker, client: RawClient, workers: list[FakeWorker]
) -> None:
    worker = fake(broker, workers, credit=2)
    for _ in range(5):
        client.request("add", INPUTS)
    first, second = worker.job(), worker.job()
    assert loads(client) == {"": (3, 0), "fake": (2, 2)}
    worker.answer(first)
    third = worker.job()
    assert loads(client) == {"": (2, 0), "fake": (2, 2)}
    assert len({first.job_id, second.job_id, third.job_id}) == 3


def test_the_least_loaded_worker_gets_the_next_request(
    broker: Broker, client: RawClient, workers: list[FakeWorker]
) -> None:
    a = fake(broker, workers, credit=4, worker_id="a")
    b = fake(broker, workers, credit=2, worker_id="b")
    for _ in range(3):
        client.request("add", INPUTS)
    # a takes the first (both idle); then b (0/2 < 1/4); then a (1/4 < 1/2).
    assert loads(client) == {"": (0, 0), "a": (4, 2), "b": (2, 1)}
    assert a.job() and a.job() and b.job()


def test_two_live_workers_given_one_id_are_both_kept(
    broker: Broker, client: RawClient, workers: list[FakeWorker]
) -> None:
    """The second HELLO under a known id once dropped the first worker, which was told
    it was unknown, re-registered, dropped the second, and so on: most requests failed
    after max_attempts "deaths". A worker whose connection is up is not dead."""
    first = fake(broker, workers, credit=1, worker_id="twin")
    a = client.request("add", INPUTS)
    held = first.job()
    second = fake(broker, workers, credit=1, worker_id="twin")
    b = client.request("add", INPUTS)
    other = second.job()
    assert other.job_id != held.job_id  # not `a`'s, taken back from a first worker "gone"
    first.answer(held)
    second.answer(other)
    replies = [client.recv(), client.recv()]
    assert all(isinstance(reply, wire.Reply) for reply in replies)
    assert {reply.request_id for reply in replies} == {a, b}
    assert labels_of(broker.metrics, "ipuserve_broker_workers_lost_total") == []


def test_a_worker_restarted_under_its_id_takes_over_its_dead_predecessors_jobs(
    broker: Broker, client: RawClient, workers: list[FakeWorker]
) -> None:
    """A container restarted keeps its hostname, so its worker id: the jobs the dead
    process held go to the new one at its HELLO, not after the liveness window."""
    own = zmq.Context()
    dead = fake(broker, workers, credit=1, worker_id="node-1", context=own)
    a = client.request("add", INPUTS)
    held = dead.job()
    dead.die(own)
    reborn = fake(broker, workers, credit=1, worker_id="node-1")
    again = reborn.job()
    assert again.job_id == held.job_id
    reborn.answer(again)
    reply = client.recv()
    assert isinstance(reply, wire.Reply) and reply.request_id == a
    assert counted(broker, "workers_lost_total", reason="restarted") == 1


def test_a_disconnected_clients_queued_requests_are_dropped_not_run(
    start_broker_thread: StartBroker, workers: list[FakeWorker]
) -> None:
    """A client killed with requests queued: they ran anyway, one after another, and
    other clients waited behind them (a chaos review: 30 s for a 1-sample request).
    A reply that cannot reach it, and a liveness window without it, tell the broker
    it is gone."""
    broker = start_broker_thread(liveness_ms=200)
    worker = fake(broker, workers, credit=1)
    own = zmq.Context()
    dying = RawClient(broker.frontend_endpoint, context=own)
    for _ in range(3):
        dying.request("add", INPUTS)
    running = worker.job()
    dying.close()
    own.term()  # returns once its TCP connection is closed, as a process's death does
    with RawClient(broker.frontend_endpoint) as client:
        mine = client.request("add", INPUTS)
        worker.answer(running)  # undeliverable: the broker learns the client is gone...
        second = worker.job()  # ...but a blip is not death: the queue is kept a while
        worker.idle_until(lambda: counted(broker, "abandoned_total", model="add") == 1)
        worker.answer(second)
        worker.answer(worker.job())  # the next job is `mine`, not the dead client's third
        reply = client.recv()
    assert isinstance(reply, wire.Reply) and reply.request_id == mine


def test_a_bug_handling_one_worker_message_does_not_stop_the_broker(
    broker: Broker, client: RawClient, workers: list[FakeWorker]
) -> None:
    """An OverflowError reading one RESULTS once ended the broker's loop: every client
    and worker lost it. A fault is injected into the handler here, once."""
    handle = broker._workers.handle
    faults = [RuntimeError("injected")]

    def faulty(*args: object) -> None:
        if faults and isinstance(args[2], wire.Results):
            raise faults.pop()
        handle(*args)  # type: ignore[arg-type]

    broker._workers.handle = faulty  # type: ignore[method-assign]
    worker = fake(broker, workers, credit=1)
    first = client.request("add", INPUTS)
    worker.answer(worker.job())  # lost to the injected fault: its job is failed, not left
    error = client.recv()
    assert isinstance(error, wire.ErrorReply) and error.request_id == first
    assert error.code == "WORKER_FAILED"
    second = client.request("add", INPUTS)
    worker.answer(worker.job())  # the worker's credit came back with the failed job
    reply = client.recv()
    assert reply.request_id == second  # type: ignore[union-attr]
    assert_add_reply(reply, INPUTS)
    assert counted(broker, "dropped_total", reason="worker_message_failed") == 1


def test_only_a_worker_the_job_was_placed_on_may_answer_it(
    broker: Broker, client: RawClient, workers: list[FakeWorker]
) -> None:
    """Any backend peer once answered any job whose id it guessed, without a HELLO:
    200 of 200 requests of another client got its made-up outputs."""
    worker = fake(broker, workers, credit=1)
    stranger = FakeWorker(broker.backend_endpoint)  # never says HELLO
    workers.append(stranger)
    asked = client.request("add", INPUTS)
    job = worker.job()
    forged = wire.Tensors.of({"z": np.full((4, 8), 42, np.float32)})
    stranger.send(wire.Results((wire.Result(job.job_id, forged, {}),)))
    wait_until(lambda: counted(broker, "dropped_total", reason="result_from_stranger") == 1)
    worker.answer(job)
    reply = client.recv()
    assert reply.request_id == asked  # type: ignore[union-attr]
    assert_add_reply(reply, INPUTS)


def test_a_worker_that_reconnected_may_still_answer_the_jobs_it_held(
    broker: Broker, client: RawClient, workers: list[FakeWorker]
) -> None:
    """A worker that lost the broker for a while comes back on a new connection (a new
    identity) with the results of jobs it held; those were re-queued meanwhile. Its
    result still wins: it is registered under the id the job was placed on."""
    own = zmq.Context()
    first = fake(broker, workers, credit=1, worker_id="a", context=own)
    asked = client.request("add", INPUTS)
    held = first.job()
    first.die(own)
    other = fake(broker, workers, credit=1, worker_id="b")
    back = fake(broker, workers, credit=0, worker_id="a")  # takes nothing new
    assert other.job().job_id == held.job_id  # re-queued when "a" came back
    back.answer(held)
    reply = client.recv()
    assert isinstance(reply, wire.Reply) and reply.request_id == asked
    assert counted(broker, "dropped_total", reason="result_from_stranger") == 0


def test_outputs_that_do_not_fit_the_model_are_not_forwarded(
    broker: Broker, client: RawClient, workers: list[FakeWorker]
) -> None:
    """The broker forwarded whatever a worker answered: other names, dtypes, shapes."""
    worker = fake(broker, workers, credit=1)
    client.request("add", INPUTS)
    job = worker.job()
    wrong = wire.Tensors.of({"zzz": np.zeros((7,), np.int8)})
    worker.send(wire.Results((wire.Result(job.job_id, wrong, {}),)))
    reply = client.recv()
    assert isinstance(reply, wire.ErrorReply) and reply.code == "WORKER_FAILED"
    assert reply.message == (
        "fake answered model 'add' with outputs zzz:int8[7]; the model's are z:float32[4, 8]"
    )


def test_a_full_queue_answers_overloaded(
    start_broker_thread: StartBroker, workers: list[FakeWorker]
) -> None:
    broker = start_broker_thread(queue_limit=2)
    fake(broker, workers, credit=1)
    with RawClient(broker.frontend_endpoint) as client:
        ids = [client.request("add", INPUTS) for _ in range(4)]
        reply = client.recv()
    assert isinstance(reply, wire.ErrorReply) and reply.request_id == ids[3]
    assert reply.code == "OVERLOADED" and "2 queued requests" in reply.message


def test_a_queued_request_expires_with_deadline_exceeded(
    broker: Broker, client: RawClient, workers: list[FakeWorker]
) -> None:
    worker = fake(broker, workers, credit=1)
    client.request("add", INPUTS)
    late = client.request("add", INPUTS, timeout_ms=30)
    reply = client.recv()
    assert isinstance(reply, wire.ErrorReply) and reply.request_id == late
    assert reply.code == "DEADLINE_EXCEEDED" and "in the queue" in reply.message
    worker.answer(worker.job())
    assert isinstance(client.recv(), wire.Reply)


def test_a_request_expiring_at_a_worker_keeps_the_worker_credit_until_it_answers(
    broker: Broker, client: RawClient, workers: list[FakeWorker]
) -> None:
    worker = fake(broker, workers, credit=1)
    client.request("add", INPUTS, timeout_ms=30)
    job = worker.job()
    reply = client.recv()
    assert isinstance(reply, wire.ErrorReply) and reply.code == "DEADLINE_EXCEEDED"
    assert "at a worker" in reply.message
    assert loads(client)["fake"] == (1, 1)
    worker.answer(job)  # late: dropped, counted
    client.request("add", INPUTS)
    worker.answer(worker.job())
    assert isinstance(client.recv(), wire.Reply)
    assert counted(broker, "duplicate_results_total") == 1


def test_a_silent_worker_is_dropped_and_its_jobs_go_to_another(
    start_broker_thread: StartBroker, workers: list[FakeWorker]
) -> None:
    broker = start_broker_thread(liveness_ms=300)
    silent = fake(broker, workers, credit=1, worker_id="silent")
    with RawClient(broker.frontend_endpoint) as client:
        request_id = client.request("add", INPUTS)
        silent.job()
        silent.alive = False
        healthy = fake(broker, workers, credit=1, worker_id="healthy")
        healthy.answer(healthy.job())
        reply = client.recv()
        assert isinstance(reply, wire.Reply) and reply.request_id == request_id
        assert [w.worker_id for w in client.models()[0].workers] == ["healthy"]
    assert counted(broker, "requeued_total") == 1
    assert counted(broker, "workers_lost_total", reason="silent") == 1
    # queued twice, briefly each time: not the liveness window "silent" held it (which
    # broker_queue_us once counted), and the queue histogram sees the request once
    assert reply.timing["broker_queue_us"] < 300_000
    assert 'ipuserve_broker_queue_seconds_count{model="add",version="1"} 1.0' in (
        broker.metrics.render()
    )


def test_the_first_result_wins_and_the_dropped_worker_is_told_to_reconnect(
    start_broker_thread: StartBroker, workers: list[FakeWorker]
) -> None:
    broker = start_broker_thread(liveness_ms=300)
    slow = fake(broker, workers, credit=1, worker_id="slow")
    with RawClient(broker.frontend_endpoint) as client:
        client.request("add", INPUTS)
        first = slow.job()
        slow.alive = False
        other = fake(broker, workers, credit=1, worker_id="other")
        second = other.job()  # re-queued after "slow" was dropped
        assert second.job_id == first.job_id
        slow.answer(first)  # from a dropped worker, for a live job: wins
        assert_add_reply(client.recv(), INPUTS)
        assert isinstance(slow.recv(), wire.Reconnect)
        other.answer(second)  # a duplicate now
        client.send(wire.Ping(b"p"))
        assert isinstance(client.recv(), wire.Pong)  # and no second reply before it
    assert counted(broker, "duplicate_results_total") == 1


def test_an_error_from_a_dropped_worker_does_not_answer_a_requeued_job(
    start_broker_thread: StartBroker, workers: list[FakeWorker]
) -> None:
    broker = start_broker_thread(liveness_ms=300)
    slow = fake(broker, workers, credit=1, worker_id="slow")
    with RawClient(broker.frontend_endpoint) as client:
        client.request("add", INPUTS)
        first = slow.job()
        slow.alive = False
        other = fake(broker, workers, credit=1, worker_id="other")
        second = other.job()
        slow.fail(first, "UNAVAILABLE", "my backend closed")
        assert isinstance(slow.recv(), wire.Reconnect)  # the broker read the failure
        other.answer(second)
        assert_add_reply(client.recv(), INPUTS)
    assert counted(broker, "duplicate_results_total") == 1


def test_a_job_held_by_too_many_dying_workers_fails(
    start_broker_thread: StartBroker, workers: list[FakeWorker]
) -> None:
    broker = start_broker_thread(liveness_ms=300, max_attempts=1)
    worker = fake(broker, workers, credit=1)
    with RawClient(broker.frontend_endpoint) as client:
        client.request("add", INPUTS)
        worker.job()
        worker.alive = False
        reply = client.recv()
    assert isinstance(reply, wire.ErrorReply) and reply.code == "WORKER_FAILED"


def test_a_resent_pending_request_runs_once(
    broker: Broker, client: RawClient, workers: list[FakeWorker]
) -> None:
    worker = fake(broker, workers, credit=4)
    client.request("add", INPUTS, request_id=b"same")
    client.request("add", INPUTS, request_id=b"same")
    assert loads(client)["fake"] == (4, 1)
    worker.answer(worker.job())
    reply = client.recv()
    assert isinstance(reply, wire.Reply) and reply.request_id == b"same"
    assert counted(broker, "resent_requests_total") == 1


def test_bye_hands_jobs_back_without_counting_an_attempt(
    start_broker_thread: StartBroker, workers: list[FakeWorker]
) -> None:
    broker = start_broker_thread(max_attempts=1)
    leaving = fake(broker, workers, credit=2, worker_id="leaving")
    with RawClient(broker.frontend_endpoint) as client:
        client.request("add", INPUTS)
        client.request("add", INPUTS)
        done, handed = leaving.job(), leaving.job()
        leaving.send(wire.Heartbeat(in_flight=2, credit=0))
        leaving.answer(done)
        leaving.send(wire.Bye((handed.job_id,)))
        assert_add_reply(client.recv(), INPUTS)
        staying = fake(broker, workers, credit=1, worker_id="staying")
        again = staying.job()
        assert again.job_id == handed.job_id
        staying.answer(again)
        assert_add_reply(client.recv(), INPUTS)


def test_credit_zero_stops_dispatch_to_a_worker(
    broker: Broker, client: RawClient, workers: list[FakeWorker]
) -> None:
    draining = fake(broker, workers, credit=2, worker_id="draining")
    draining.send(wire.Heartbeat(in_flight=0, credit=0))
    client.request("add", INPUTS)
    assert loads(client) == {"": (1, 0), "draining": (0, 0)}


def test_start_up_grace_queues_requests_until_a_worker_serves_the_model(
    start_broker_thread: StartBroker, workers: list[FakeWorker]
) -> None:
    broker = start_broker_thread(grace_ms=60_000)
    with RawClient(broker.frontend_endpoint) as client:
        good = client.request("add", INPUTS)
        bad = client.request("add", {"x": INPUTS["x"]})
        worker = fake(broker, workers)
        refused = client.recv()
        assert isinstance(refused, wire.ErrorReply) and refused.request_id == bad
        assert refused.code == "INVALID_INPUT"
        worker.answer(worker.job())
        reply = client.recv()
        assert isinstance(reply, wire.Reply) and reply.request_id == good


def test_unknown_models_are_refused_once_the_grace_is_over(
    start_broker_thread: StartBroker,
) -> None:
    broker = start_broker_thread(grace_ms=50)
    with RawClient(broker.frontend_endpoint) as client:
        early = client.request("ghost", INPUTS)  # queued during the grace
        reply = client.recv()
        assert isinstance(reply, wire.ErrorReply) and reply.request_id == early
        assert reply.code == "UNKNOWN_MODEL"
        late = client.call("ghost", INPUTS)
        assert isinstance(late, wire.ErrorReply) and late.code == "UNKNOWN_MODEL"
    advice = (  # a typo, or no worker started: say how to start one
        "no worker serves model 'ghost' (models: none); check the name, or start a worker "
        "for it: `ipuserve worker --broker tcp://BROKER:5556 --model FILE --name ghost`"
    )
    assert reply.message == late.message == advice
    # counted without the made-up name: a label per name would grow without bound
    assert counted(broker, "errors_total", code="UNKNOWN_MODEL", model="") == 2
    errors = labels_of(broker.metrics, "ipuserve_broker_errors_total")
    assert errors and all(labels["model"] != "ghost" for labels in errors)


def test_a_worker_announcing_another_schema_gets_no_requests_for_that_model(
    broker: Broker, client: RawClient, workers: list[FakeWorker]
) -> None:
    first = fake(broker, workers, worker_id="first")
    assert first.welcome is not None and first.welcome.refused == ()
    other = wire.ModelSpec("add", ADD.inputs[:1], ADD.outputs, 4, 0)
    second = fake(broker, workers, worker_id="second", models=(other,))
    assert [w.worker_id for w in client.models()[0].workers] == ["first"]
    assert second.welcome is not None
    [(model, why)] = second.welcome.refused  # told, not left to idle
    assert model == "add"
    assert why == (
        "model 'add' is served by first with another schema at version 1 (x:float32[4, 8], "
        "y:float32[4, 8] -> z:float32[4, 8]; batch 4 along dimension 0; not "
        "x:float32[4, 8] -> z:float32[4, 8]; batch 4 along dimension 0); stop those "
        "workers first, or give this build another version (or the model another --name)"
    )


def test_an_unknown_worker_is_asked_to_reconnect(broker: Broker) -> None:
    stranger = FakeWorker(broker.backend_endpoint)
    try:
        stranger.send(wire.Heartbeat(in_flight=0))
        assert isinstance(stranger.recv(), wire.Reconnect)
    finally:
        stranger.close()


def test_malformed_worker_messages_are_dropped_and_counted(
    broker: Broker, client: RawClient, workers: list[FakeWorker]
) -> None:
    worker = fake(broker, workers)
    worker.socket.send_multipart([b"garbage"])
    client.request("add", INPUTS)
    job = worker.job()
    result = wire.Result(job.job_id, wire.Tensors.of({"z": np.zeros((2, 8), np.float32)}), {})
    frames = wire.Results((result,)).encode()
    worker.socket.send_multipart(frames[:-1])  # a RESULTS missing its tensor frame
    reply = client.recv()
    # the client's request was fine: the error names the worker, not BAD_MESSAGE
    assert isinstance(reply, wire.ErrorReply) and reply.code == "WORKER_FAILED"
    assert reply.message == (
        "worker fake sent an unreadable result: RESULTS header lists 1 tensor(s) but 0 "
        "tensor frame(s) follow"
    )
    assert counted(broker, "dropped_total", reason="malformed_from_worker") == 2


def test_a_result_with_a_bad_frame_fails_alone(
    broker: Broker, client: RawClient, workers: list[FakeWorker]
) -> None:
    worker = fake(broker, workers)
    first, second = client.request("add", INPUTS), client.request("add", INPUTS)
    jobs = worker.job(), worker.job()
    frames = wire.Results(tuple(result_for(job) for job in jobs)).encode()
    frames[2] = b"\x00" * 3  # the first result's tensor
    worker.socket.send_multipart(frames)
    replies = {reply.request_id: reply for reply in (client.recv(), client.recv())}  # type: ignore[union-attr]
    # the worker's fault, not the client's INVALID_INPUT
    assert isinstance(replies[first], wire.ErrorReply) and replies[first].code == "WORKER_FAILED"
    assert_add_reply(replies[second], INPUTS)
    assert counted(broker, "dropped_total", reason="malformed_from_worker") == 0


def test_credit_freed_by_one_results_is_refilled_by_one_jobs(
    broker: Broker, client: RawClient, workers: list[FakeWorker]
) -> None:
    worker = fake(broker, workers, credit=3)
    for _ in range(6):
        client.request("add", INPUTS)
    first = [worker.job() for _ in range(3)]
    assert loads(client) == {"": (3, 0), "fake": (3, 3)}
    worker.answer(*first)  # one RESULTS frees three credits at once
    batch = worker.next_batch()
    assert len(batch.jobs) == 3
    worker.answer(*batch.jobs)
    assert sum(isinstance(client.recv(), wire.Reply) for _ in range(6)) == 6


def test_models_and_ping(broker: Broker, client: RawClient, workers: list[FakeWorker]) -> None:
    fake(broker, workers, credit=3)
    (info,) = client.models()
    assert info.spec == ADD and info.queued == 0
    assert [(w.worker_id, w.credit, w.in_flight) for w in info.workers] == [("fake", 3, 0)]
    client.send(wire.Ping(b"p1"))
    assert client.recv() == wire.Pong(b"p1", broker.epoch)


def test_a_worker_command_on_the_frontend_is_refused(client: RawClient) -> None:
    client.send(wire.Heartbeat(in_flight=0))
    reply = client.recv()
    assert isinstance(reply, wire.ErrorReply) and reply.code == "BAD_MESSAGE"
    assert "HEARTBEAT is not a client command" in reply.message


def test_stopping_the_broker_answers_what_it_holds_broker_shutdown(
    start_broker_thread: StartBroker, workers: list[FakeWorker], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="ipuserve.broker.loop")
    broker = start_broker_thread()
    fake(broker, workers, credit=1)
    with RawClient(broker.frontend_endpoint) as client:
        client.request("add", INPUTS)
        client.request("add", INPUTS)
        assert loads(client)[""] == (1, 0)
        broker.stop()
        codes = {client.recv().code, client.recv().code}  # type: ignore[union-attr]
    assert codes == {"BROKER_SHUTDOWN"}  # an UNAVAILABLE the Client re-sends after a restart
    wait_until(lambda: "answered 2 pending request(s) BROKER_SHUTDOWN" in caplog.text)


def test_a_bug_on_one_row_of_a_batch_fails_that_row_only_and_once(
    broker: Broker, client: RawClient, workers: list[FakeWorker]
) -> None:
    """Admitting a row once ran outside the per-row guard: a row that raised there
    failed the whole batch, rows already admitted were answered twice (an error, then
    their result) and later valid rows were refused. A fault is injected for row "bb"."""
    worker = fake(broker, workers, credit=3)
    admit = broker._clients.on_request

    def faulty(client_id: bytes, row: wire.Request, batched: bool = False) -> None:
        if row.request_id == b"bb":
            raise ValueError("injected")
        admit(client_id, row, batched)

    broker._clients.on_request = faulty  # type: ignore[method-assign]
    given = add_inputs(1, seed=3)
    rows = tuple(wire.Request(i, "add", wire.Tensors.of(given)) for i in (b"aa", b"bb", b"dd"))
    client.send(wire.Requests(rows))
    error = client.recv()
    assert isinstance(error, wire.ErrorReply) and error.request_id == b"bb"
    assert error.message == "internal broker error; see its log"
    worker.answer(worker.job(), worker.job())
    replies = client.recv()
    assert isinstance(replies, wire.Replies) and replies.errors == ()
    assert [reply.request_id for reply in replies.replies] == [b"aa", b"dd"]
    for reply in replies.replies:
        assert_add_reply(reply, given)
    client.models()  # answered after anything sent before it, which it sets aside
    assert client.stash == []  # so nothing was answered twice


def test_a_batch_of_requests_is_served_row_by_row_and_answered_in_one_replies(
    broker: Broker, client: RawClient, workers: list[FakeWorker]
) -> None:
    worker = fake(broker, workers, credit=3)
    given = [add_inputs(rows, seed=rows) for rows in (1, 2, 3)]
    wrong = {"x": np.zeros((1, 5), np.float32), "y": np.zeros((1, 5), np.float32)}
    batch = [
        wire.Request(b"b%d" % i, "add", wire.Tensors.of(g), 5_000.0) for i, g in enumerate(given)
    ]
    batch.insert(1, wire.Request(b"bad", "add", wire.Tensors.of(wrong)))
    batch.append(wire.Request(b"who", "no-such-model", wire.Tensors.of(given[0])))
    client.send(wire.Requests(tuple(batch)))
    refused = {}
    for _ in range(2):  # the rows the broker refuses are answered at once, each on its own
        error = client.recv()
        assert isinstance(error, wire.ErrorReply)
        refused[error.request_id] = error.code
    assert refused == {b"bad": "INVALID_INPUT", b"who": "UNKNOWN_MODEL"}
    jobs = [worker.job() for _ in given]  # the others reach the worker, in order
    assert [job.budget_ms is not None and job.budget_ms <= 5_000 for job in jobs] == [True] * 3
    worker.answer(*jobs)  # one RESULTS: their replies leave in one turn, together
    replies = client.recv()
    assert isinstance(replies, wire.Replies) and replies.errors == ()
    assert [reply.request_id for reply in replies.replies] == [b"b0", b"b1", b"b2"]
    for reply, inputs in zip(replies.replies, given, strict=True):
        assert_add_reply(reply, inputs)
        assert set(reply.timing) == {"device_us", "broker_queue_us"}


def test_a_batch_whose_frames_do_not_match_fails_only_those_rows(
    broker: Broker, client: RawClient, workers: list[FakeWorker]
) -> None:
    worker = fake(broker, workers)
    batch = wire.Requests(
        tuple(wire.Request(b"r%d" % i, "add", wire.Tensors.of(INPUTS)) for i in range(2))
    )
    frames = batch.encode()
    frames[2] = b"\0" * 3  # the first row's first tensor
    client.send_frames(frames)
    error = client.recv()
    assert isinstance(error, wire.ErrorReply) and error.request_id == b"r0"
    assert error.code == "INVALID_INPUT" and "bytes" in error.message
    worker.answer(worker.job())
    reply = client.recv()  # a lone reply to a batched request: a plain REPLY
    assert isinstance(reply, wire.Reply) and reply.request_id == b"r1"
    assert_add_reply(reply, INPUTS)


def group_request(ids: tuple[bytes, ...], given: list[dict[str, np.ndarray]]) -> wire.Request:
    tensors = wire.Tensors.group([wire.Tensors.of(inputs) for inputs in given])
    return wire.Request(ids[0], "add", tensors, 5_000.0, ids)


def assert_replies(replies: wire.Message, given: list[dict[str, np.ndarray]]) -> list[wire.Reply]:
    """A REPLIES message whose members, in order, match numpy for ``given``; the members."""
    assert isinstance(replies, wire.Replies)
    answered = [r for row in replies.replies for r in row.members()]
    for reply, inputs in zip(answered, given, strict=True):
        assert_add_reply(reply, inputs)
    return answered


def test_a_group_travels_as_one_job_and_comes_back_as_one_replies_row(
    broker: Broker, client: RawClient, workers: list[FakeWorker]
) -> None:
    worker = fake(broker, workers, credit=2)
    given = [add_inputs(1, seed=i) for i in range(3)]  # 3 samples: within one batch of 4
    ids = (b"g0", b"g1", b"g2")
    client.send(wire.Requests((group_request(ids, given),)))
    job = worker.job()
    assert job.tensors.members == 3
    assert job.samples == 3  # counted once, by the broker: 1 sample a member
    assert loads(client)["fake"] == (2, 1)  # one job: one credit
    worker.answer(job)
    replies = client.recv()
    assert isinstance(replies, wire.Replies)
    (row,) = replies.replies
    assert row.group == ids
    for reply, inputs, ident in zip(row.members(), given, ids, strict=True):
        assert reply.request_id == ident
        assert_add_reply(reply, inputs)
        assert set(reply.timing) == {"device_us", "broker_queue_us"}
    assert counted(broker, "requests_total", model="add") == 3
    # counted once the REPLIES left, on the broker's thread: maybe after it arrived here
    wait_until(lambda: counted(broker, "replies_total", model="add") == 3)
    # one job, but the latency histograms count requests, all alike
    counts = [counted(broker, f"{h}_seconds_count", model="add") for h in ("queue", "request")]
    assert counts == [3, 3]


def assert_refused(client: RawClient, ids: tuple[bytes, ...], code: str, words: str) -> None:
    """One error per request of a refused group, each saying ``words``."""
    errors = [client.recv() for _ in ids]
    assert all(isinstance(e, wire.ErrorReply) for e in errors)
    assert sorted(e.request_id for e in errors if isinstance(e, wire.ErrorReply)) == sorted(ids)
    for error in errors:
        assert isinstance(error, wire.ErrorReply) and error.code == code
        assert words in error.message


def test_a_group_for_a_model_without_a_batching_dim_is_refused_not_dissolved(
    broker: Broker, client: RawClient, workers: list[FakeWorker]
) -> None:
    """The broker lists no group size for such a model, so a correct client never
    groups its requests; a group anyway is refused whole, INVALID_INPUT, and no
    worker sees any of it."""
    fixed = wire.ModelSpec("add", ADD.inputs, ADD.outputs, 4, None)
    worker = fake(broker, workers, credit=4, models=(fixed,))
    (info,) = client.models()
    assert info.group_samples == 0
    given = [add_inputs(4, seed=i) for i in range(2)]
    client.send(wire.Requests((group_request((b"a", b"b"), given),)))
    assert_refused(client, (b"a", b"b"), "INVALID_INPUT", "cannot take a group of requests")
    client.request("add", given[0], request_id=b"c")  # a lone request still runs
    job = worker.job()
    assert job.samples == 4  # no batching dim: the compiled batch, counted by the broker
    worker.answer(job)
    assert_add_reply(client.recv(), given[0])
    assert counted(broker, "requests_total", model="add") == 1


def test_a_group_holding_a_pending_request_runs_that_request_once(
    broker: Broker, client: RawClient, workers: list[FakeWorker]
) -> None:
    """A client re-sends one by one, never in a new group: a group holding a pending
    request is broken. The pending one is a re-send (answered once); the others are
    refused, not run apart from their group."""
    worker = fake(broker, workers, credit=4)
    given = [add_inputs(2, seed=i) for i in range(2)]
    client.request("add", given[0], request_id=b"p")
    first = worker.job()
    client.send(wire.Requests((group_request((b"p", b"q"), given),)))
    assert_refused(client, (b"q",), "INVALID_INPUT", "must all be new")
    worker.answer(first)
    assert_add_reply(client.recv(), given[0])
    assert counted(broker, "resent_requests_total") == 1
    assert counted(broker, "requests_total", model="add") == 1
    client.models()  # answered after anything sent before it, which it sets aside
    assert client.stash == []  # so p was answered once, and q never ran


def test_a_worker_answering_a_group_with_other_members_fails_each_request(
    broker: Broker, client: RawClient, workers: list[FakeWorker]
) -> None:
    worker = fake(broker, workers)
    client.send(wire.Requests((group_request((b"a", b"b"), [INPUTS, INPUTS]),)))
    job = worker.job()
    z = wire.Tensors.of({"z": np.zeros((2, 8), np.float32)})  # one member, not two
    worker.send(wire.Results((wire.Result(job.job_id, z, {}),)))
    errors = [client.recv(), client.recv()]
    assert {e.request_id for e in errors if isinstance(e, wire.ErrorReply)} == {b"a", b"b"}
    assert all(isinstance(e, wire.ErrorReply) and e.code == "INFERENCE_FAILED" for e in errors)


def test_a_group_bigger_than_a_batch_stays_one_job_and_the_listing_follows_the_device(
    broker: Broker, client: RawClient, workers: list[FakeWorker]
) -> None:
    """The broker never cuts a group: 6 requests of 2 samples (3 compiled batches of
    4) are one job. What it lists as ``group_samples``, for clients to group by, is
    one batch until the worker reports the device time, then what the device budget
    affords."""
    worker = fake(broker, workers, credit=8)
    (info,) = client.models()
    assert info.group_samples == ADD.batch_size == 4
    given = [add_inputs(2, seed=i) for i in range(6)]
    ids = tuple(b"a%d" % i for i in range(6))
    client.send(wire.Requests((group_request(ids, given),)))
    job = worker.job()
    assert job.tensors.members == 6
    worker.answer(job)  # device_us 1.0 for 12 samples
    answered = assert_replies(client.recv(), given)
    assert [r.request_id for r in answered] == list(ids)
    (info,) = client.models()
    assert info.group_samples == grouping.MAX_GROUP_SAMPLES  # cheap: up to the ceiling


def test_a_group_past_the_ceiling_is_refused_with_what_to_send_instead(
    broker: Broker, client: RawClient, workers: list[FakeWorker], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the most samples one group may hold (a ceiling of 8 here: the broker runs in
    this process), a group is refused whole, with how to do better; at it, it runs."""
    monkeypatch.setattr(grouping, "MAX_GROUP_SAMPLES", 8)
    worker = fake(broker, workers, credit=8)
    most = grouping.group_ceiling(ADD) // 2  # requests of 2 samples
    assert most == 4
    given = [add_inputs(2, seed=i) for i in range(most + 1)]
    ids = tuple(b"%05d" % i for i in range(most + 1))
    client.send(wire.Requests((group_request(ids, given),)))
    assert_refused(client, ids, "INVALID_INPUT", "send fewer requests per group")
    client.send(wire.Requests((group_request(ids[:most], given[:most]),)))  # at the limit
    job = worker.job()
    assert job.tensors.members == most
    worker.answer(job)
    assert_replies(client.recv(), given[:most])


def test_a_group_past_the_payload_limit_is_refused_not_cut(
    start_broker_thread: StartBroker, workers: list[FakeWorker]
) -> None:
    broker = start_broker_thread(max_payload_bytes=130)  # a member takes 64 bytes
    worker = fake(broker, workers, credit=4)
    given = [add_inputs(1, seed=i) for i in range(3)]
    with RawClient(broker.frontend_endpoint) as client:
        client.send(wire.Requests((group_request((b"a", b"b", b"c"), given),)))
        assert_refused(client, (b"a", b"b", b"c"), "PAYLOAD_TOO_LARGE", "takes 192 bytes")
        client.send(wire.Requests((group_request((b"d", b"e"), given[:2]),)))  # 128 bytes
        job = worker.job()
        assert job.tensors.members == 2
        worker.answer(job)
        assert_replies(client.recv(), given[:2])


def test_queue_limit_and_listing_count_a_groups_requests(
    start_broker_thread: StartBroker, workers: list[FakeWorker], caplog: pytest.LogCaptureFixture
) -> None:
    """Credit counts jobs; the queue limit, ``queued`` and ``requests`` count requests."""
    caplog.set_level(logging.WARNING, logger="ipuserve.broker.answers")
    broker = start_broker_thread(queue_limit=4)
    worker = fake(broker, workers, credit=1)
    given = [add_inputs(1, seed=i) for i in range(3)]
    with RawClient(broker.frontend_endpoint) as client:
        client.request("add", INPUTS, request_id=b"alone")
        running = worker.job()
        client.send(wire.Requests((group_request((b"a", b"b", b"c"), given),)))
        client.send(wire.Requests((group_request((b"x", b"y"), given[:2]),)))  # 3 + 2 > 4
        refused = [client.recv(), client.recv()]
        assert {e.request_id for e in refused if isinstance(e, wire.ErrorReply)} == {b"x", b"y"}
        assert all(
            isinstance(e, wire.ErrorReply)
            and e.code == "OVERLOADED"
            and "3 queued requests and a limit of 4" in e.message
            for e in refused
        )
        assert counted(broker, "errors_total", code="OVERLOADED", model="add") == 2
        shed = "model 'add': 2 request(s) refused OVERLOADED: its queue is full"
        wait_until(lambda: any(shed in r.getMessage() for r in list(caplog.records)))
        (info,) = client.models()
        assert info.queued == 3
        assert [(w.credit, w.in_flight, w.requests) for w in info.workers] == [(1, 1, 1)]
        worker.answer(running)
        assert isinstance(client.recv(), wire.Reply)
        group = worker.job()
        (info,) = client.models()
        assert info.queued == 0
        assert [(w.credit, w.in_flight, w.requests) for w in info.workers] == [(1, 1, 3)]
        metrics = broker.metrics  # gauges: set on the broker's next heartbeat tick
        wait_until(lambda: metrics.value("ipuserve_broker_requests_in_flight") == 3)
        assert metrics.value("ipuserve_broker_in_flight") == 1
        worker.answer(group)
        assert_replies(client.recv(), given)


def test_an_orderly_worker_leave_is_logged_at_info(
    broker: Broker, workers: list[FakeWorker], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="ipuserve.broker.lifecycle")
    leaving = fake(broker, workers, worker_id="leaving")
    leaving.send(wire.Bye())
    wait_until(lambda: "dropped (left)" in caplog.text)
    [record] = [r for r in list(caplog.records) if "dropped (left)" in r.getMessage()]
    assert record.levelno == logging.INFO  # an orderly leave is no trouble
    # counted as a departure, not as a worker lost
    assert counted(broker, "worker_departures_total", reason="bye") == 1
    assert counted(broker, "workers_lost_total") == 0


def test_a_served_models_queue_gauge_exists_before_anything_waits(
    broker: Broker, workers: list[FakeWorker]
) -> None:
    """A gauge series that appears only once something queued cannot be alerted on."""
    fake(broker, workers)
    queued = "ipuserve_broker_queued"  # set on the broker's next heartbeat tick
    wait_until(lambda: {"model": "add", "version": "1"} in labels_of(broker.metrics, queued))
    assert broker.metrics.value(queued, model="add", version="1") == 0


def test_a_request_whose_model_lost_its_workers_says_so_at_its_deadline(
    broker: Broker, workers: list[FakeWorker]
) -> None:
    """The broker's DEADLINE_EXCEEDED (where the request waited, and that nobody serves
    the model) reaches the Client: it waits a moment past the timeout for it."""
    worker = fake(broker, workers)
    worker.send(wire.Bye())
    with Client(broker.frontend_endpoint, timeout=10) as client:
        wait_until(lambda: not client.models()[0].workers)  # listed, but nobody serves it
        with pytest.raises(DeadlineExceeded) as failed:
            client.infer("add", INPUTS, timeout=0.3)
        with pytest.raises(UnknownModelError, match=r"\(models: add \(no worker now\)\)"):
            client.infer("ad", INPUTS)  # a typo: the list says which model has no worker
    assert re.search(
        r"timeout of 300 ms \(waited \d+ ms in the queue\); no worker serves model 'add' "
        r"version 1 now",
        str(failed.value),
    ), failed.value


def test_a_model_left_without_workers_past_orphan_ms_is_refused_at_once(
    start_broker_thread: StartBroker, workers: list[FakeWorker]
) -> None:
    """Queued requests wait orphan_ms for a worker to rejoin, then fail UNAVAILABLE (not
    each at its own deadline); later ones are refused at once until a worker joins."""
    broker = start_broker_thread(orphan_ms=300)
    worker = fake(broker, workers, worker_id="gone")
    worker.send(wire.Bye())
    with RawClient(broker.frontend_endpoint) as client:
        wait_until(lambda: not client.models()[0].workers)
        waiting = client.request("add", INPUTS, timeout_ms=60_000)
        refused = client.recv(timeout=10)  # long before its 60 s deadline
        assert isinstance(refused, wire.ErrorReply) and refused.request_id == waiting
        assert refused.code == "UNAVAILABLE"
        assert re.fullmatch(
            r"no worker has served model 'add' version 1 for \d+ s \(its last one left\); "
            r"start or load one, or wait for it to rejoin",
            refused.message,
        ), refused.message
        again = client.call("add", INPUTS)  # past orphan_ms: refused on arrival
        assert isinstance(again, wire.ErrorReply) and again.code == "UNAVAILABLE"
        back = fake(broker, workers, worker_id="back")
        request_id = client.request("add", INPUTS)
        back.answer(back.job())
        reply = client.recv()
    assert isinstance(reply, wire.Reply) and reply.request_id == request_id
    assert_add_reply(reply, INPUTS)


def test_made_up_models_queued_in_the_start_up_grace_grow_no_metric_label(
    start_broker_thread: StartBroker, workers: list[FakeWorker]
) -> None:
    """During the grace any client may queue requests for any name: each once became
    a `queued{model}` label for ever (300 requests, 300 labels)."""
    broker = start_broker_thread(grace_ms=60_000)
    with RawClient(broker.frontend_endpoint) as client:
        client.request("ghost", INPUTS)
        client.models()  # answered after the request was queued
        fake(broker, workers)
        wait_until(lambda: counted(broker, "workers") == 1)  # a beat since
    labels = labels_of(broker.metrics, "ipuserve_broker_queued")
    assert {"model": "add", "version": "1"} in labels
    assert not any(label["model"] == "ghost" for label in labels)
    requests = "ipuserve_broker_requests_total"  # counted, unnamed
    assert labels_of(broker.metrics, requests) == [{"model": "", "version": ""}]
    assert broker.metrics.value(requests) == 1


def test_a_name_with_a_lone_surrogate_is_refused_and_cannot_break_the_metrics_page(
    broker: Broker, client: RawClient
) -> None:
    """ "\\ud800" is valid JSON; once accepted, it made every /metrics scrape fail."""
    assert wire.name_problem("\ud800") == "must be UTF-8 text; '\\ud800' holds a lone surrogate"
    header = json.dumps({"model": "\ud800", "tensors": []}).encode()  # ASCII: \\ud800
    client.send_frames([wire.envelope(wire.Command.REQUEST, b"r1"), header])
    error = client.recv()
    assert isinstance(error, wire.ErrorReply) and error.code == "BAD_MESSAGE"
    assert "surrogate" in error.message


def test_overload_refusals_not_yet_reported_are_reported_at_shutdown(
    start_broker_thread: StartBroker, workers: list[FakeWorker], caplog: pytest.LogCaptureFixture
) -> None:
    """The report comes at most every 10 s: refusals after the last one went unsaid
    when the broker stopped (a chaos review: 4 reported, 471 never)."""
    caplog.set_level(logging.WARNING, logger="ipuserve.broker.answers")
    broker = start_broker_thread(queue_limit=1)
    fake(broker, workers, credit=1)
    with RawClient(broker.frontend_endpoint) as client:
        client.request("add", INPUTS)  # at the worker
        client.request("add", INPUTS)  # queued: the queue is full
        client.request("add", INPUTS)
        assert client.recv().code == "OVERLOADED"  # type: ignore[union-attr]
        wait_until(lambda: len(shed_lines(caplog)) == 1)  # reported at once
        client.request("add", INPUTS)  # refused after that report: due in 10 s
        assert client.recv().code == "OVERLOADED"  # type: ignore[union-attr]
    broker.stop()
    wait_until(lambda: len(shed_lines(caplog)) == 2)
    assert [line.split(":")[1].split(" in the last")[0] for line in shed_lines(caplog)] == [
        " 1 request(s) refused OVERLOADED",
        " 1 request(s) refused OVERLOADED",
    ]


def shed_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in list(caplog.records) if "refused OVERLOADED" in r.getMessage()]


def _until_echo(worker: FakeWorker) -> tuple[list[bytes], int]:
    """Job ids that arrive before the broker's HEARTBEAT carrying a credit; that credit."""
    before: list[bytes] = []
    while True:
        assert worker.socket.poll(10_000), "no credit echo from the broker"
        message = wire.decode(worker.socket.recv_multipart(copy=False))
        if isinstance(message, wire.Jobs):
            before += [job.job_id for job in message.jobs]
        elif isinstance(message, wire.Heartbeat) and message.credit is not None:
            return before, message.credit


def test_a_credit_change_is_echoed_after_the_jobs_placed_under_the_old_credit(
    broker: Broker, client: RawClient, workers: list[FakeWorker]
) -> None:
    """A worker serving several brokers frees a lowered credit's room for another broker
    only on this echo: any job sent under the old credit must have reached it by then."""
    worker = fake(broker, workers, credit=1)
    for _ in range(4):
        client.request("add", INPUTS)
    first = worker.job()
    worker.send(wire.Heartbeat(credit=3))
    before, echoed = _until_echo(worker)
    assert (before, echoed) == ([], 3)  # nothing more could be sent under credit 1
    second, third = worker.job(), worker.job()  # placed under the new credit, after it
    assert loads(client) == {"": (1, 0), "fake": (3, 3)}
    worker.send(wire.Heartbeat(credit=1))
    assert _until_echo(worker) == ([], 1)
    worker.answer(first, second)  # 1 still held: credit 1 is used up
    worker.idle_until(lambda: loads(client)["fake"] == (1, 1))
    worker.answer(third)
    fourth = worker.job()
    assert fourth.job_id not in {first.job_id, second.job_id, third.job_id}
