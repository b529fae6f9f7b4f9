"""No message stops the broker (issue 28, item 4): a header nested 1,000 deep from a
client, from a registered worker, from a non-admin on a CURVE broker; and a handler's
own bug is answered INTERNAL, logged once, while the loop serves on.

An in-process broker (its real loop on a thread), raw DEALERs and a fake worker, on
loopback. The broker thread's liveness is asserted after each abuse: before the fix,
the loop raised RecursionError and the thread ended.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from ipuserve import protocol as wire
from ipuserve.broker.loop import Broker
from ipuserve.security import curve_client, generate_keypair, load_secret_key
from tests.broker.conftest import StartBroker
from tests.broker.fakes import FakeWorker
from tests.helpers import RawClient, add_inputs, assert_add_reply, wait_until

DEEP = 1000
NESTED = b"[" * DEEP + b"]" * DEEP
#: the issue's repro, as a client sends it
REPRO = [
    wire.envelope(wire.Command.REQUESTS),
    b'{"specs":[],"requests":[[' + NESTED + b",0,null]]}",
]


@pytest.fixture
def worker(broker: Broker) -> Iterator[FakeWorker]:
    fake = FakeWorker(broker.backend_endpoint)
    fake.hello()
    yield fake
    fake.close()


def assert_serving(broker: Broker, client: RawClient) -> None:
    """The loop still turns: a PING is answered (and the thread never ended)."""
    client.send(wire.Ping(b"alive?"))
    pong = client.recv()
    assert isinstance(pong, wire.Pong) and pong.request_id == b"alive?", pong
    assert broker._running


def test_the_repro_is_answered_bad_message_and_requests_are_served_after(
    broker: Broker, client: RawClient, worker: FakeWorker
) -> None:
    client.send_frames(REPRO)
    error = client.recv()
    assert isinstance(error, wire.ErrorReply), error
    assert (error.request_id, error.code) == (b"", "BAD_MESSAGE")
    assert error.message == "REQUESTS header nests 1003 deep; the limit is 32"
    inputs = add_inputs(2)
    rid = client.request("add", inputs)
    worker.answer(worker.job())
    reply = client.recv()
    assert getattr(reply, "request_id", None) == rid
    assert_add_reply(reply, inputs)


def test_deep_results_from_a_registered_worker_are_dropped_and_its_job_answered_later(
    broker: Broker, client: RawClient, worker: FakeWorker
) -> None:
    """RESULTS naming a live job, nested deep in its timing: unreadable, so dropped and
    counted; the broker serves on, and the worker's good RESULTS still answer the job."""
    inputs = add_inputs(2)
    rid = client.request("add", inputs)
    job = worker.job()
    deep = b'{"specs":[],"results":[["' + job.job_id.hex().encode() + b'",0,{"a":' + NESTED
    worker.socket.send_multipart([wire.envelope(wire.Command.RESULTS), deep + b"}]]}"])
    worker.idle_until(
        lambda: (
            broker.metrics.value("ipuserve_broker_dropped_total", reason="malformed_from_worker")
            == 1
        )
    )
    assert_serving(broker, client)
    worker.answer(job)
    reply = client.recv()
    assert getattr(reply, "request_id", None) == rid
    assert_add_reply(reply, inputs)


def test_a_non_admins_deep_repository_command_is_refused_not_internal(
    start_broker_thread: StartBroker, tmp_path: Path
) -> None:
    """On a CURVE broker, from a client key (no admin): BAD_MESSAGE, as from anyone, and
    the key's next command gets its PERMISSION_DENIED. It came back INTERNAL."""
    dirs = {role: tmp_path / role for role in ("clients", "workers", "admins")}
    for folder in dirs.values():
        folder.mkdir()
    server = generate_keypair("broker", tmp_path)
    files = generate_keypair("client", tmp_path)
    (dirs["clients"] / files.public.name).write_bytes(files.public.read_bytes())
    broker = start_broker_thread(
        curve_secret_key=str(server.secret),
        client_keys=str(dirs["clients"]),
        worker_keys=str(dirs["workers"]),
        admin_keys=str(dirs["admins"]),
    )
    context: zmq.Context[Any] = zmq.Context()
    try:
        sock = context.socket(zmq.DEALER)
        curve_client(sock, load_secret_key(files.secret), server.public)
        sock.connect(broker.frontend_endpoint)
        header = b'{"action":"load","model":' + NESTED + b"}"
        sock.send_multipart([wire.envelope(wire.Command.REPOSITORY, b"deep"), header])
        sock.send_multipart(wire.RepositoryCommand(b"index", "index").encode())  # type: ignore[arg-type]
        answers = []
        for _ in range(2):
            assert sock.poll(10_000), "no answer"
            answers.append(wire.decode(sock.recv_multipart(copy=False)))
        sock.close(linger=0)
    finally:
        context.destroy(linger=0)
    codes = [(getattr(a, "request_id", None), getattr(a, "code", None)) for a in answers]
    assert codes == [(b"deep", "BAD_MESSAGE"), (b"index", "PERMISSION_DENIED")], answers
    assert broker._running


def test_a_handlers_bug_is_answered_internal_and_logged_once(
    broker: Broker,
    client: RawClient,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A bug a peer can trigger, it can trigger in a loop: each message is answered,
    the traceback logged the first time only."""

    def bug(*_args: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(broker._clients, "handle", bug)
    with caplog.at_level(logging.DEBUG, logger="ipuserve.broker.loop"):
        for n in range(3):
            client.send(wire.ListModels(b"m%d" % n))
            error = client.recv()
            assert isinstance(error, wire.ErrorReply), error
            assert (error.request_id, error.code) == (b"m%d" % n, "INTERNAL")
    logged = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(logged) == 1, [r.getMessage() for r in logged]
    assert logged[0].exc_info is not None and "a bug" in str(logged[0].exc_info[1])
    assert broker.metrics.value("ipuserve_broker_errors_total", code="INTERNAL") == 3
    monkeypatch.undo()
    assert_serving(broker, client)


def test_a_bug_even_in_the_answer_drops_the_message_not_the_loop(
    broker: Broker, client: RawClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    def bug(*_args: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(broker._clients, "handle", bug)
    monkeypatch.setattr(broker.answers, "refuse", bug)
    client.send(wire.ListModels(b"lost"))
    wait_until(
        lambda: broker.metrics.value("ipuserve_broker_dropped_total", reason="handler_failed") == 1
    )
    monkeypatch.undo()
    assert_serving(broker, client)
