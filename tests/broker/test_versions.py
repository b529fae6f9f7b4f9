"""Model versions on the data path, with a real broker and real worker processes
(tests/fn_worker.py ``--version V``: its ``add`` answers x + 2y + 10 (V - 1), so each
reply's numbers say which version computed it, and ``reply.version`` must agree).

A request naming a version is served by that version; one naming none by the model's
default (the pinned one, else the latest with a worker); an unknown version is refused
naming those that exist; and when the last worker of a version leaves, handing back
what it had not started, the requests that named no version move to the new default:
none fails.
"""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

from ipuserve import protocol as wire
from tests.helpers import (
    BrokerProc,
    Processes,
    RawClient,
    fn_worker_argv,
    start_broker,
    start_worker,
    wait_until,
)

X = np.arange(32, dtype=np.float32).reshape(4, 8)
Y = np.full((4, 8), 0.5, dtype=np.float32)
INPUTS = {"x": X, "y": Y}
_ids = itertools.count(1)


def expected(version: str) -> np.ndarray:
    """What ``add`` at ``version`` answers for INPUTS (the numpy reference)."""
    return X + 2 * Y + 10 * (int(version) - 1)


def send(client: RawClient, version: str | None) -> bytes:
    request_id = b"v%d" % next(_ids)
    client.send(wire.Request(request_id, "add", wire.Tensors.of(INPUTS), None, (), version))
    return request_id


def call(client: RawClient, version: str | None = None) -> wire.Message:
    request_id = send(client, version)
    while True:
        message = client.recv()
        if getattr(message, "request_id", None) == request_id:
            return message


def answered_by(reply: wire.Message) -> str:
    """The version a reply says answered, checked against its numbers."""
    assert isinstance(reply, wire.Reply), reply
    assert reply.version is not None
    np.testing.assert_array_equal(reply.tensors.arrays()["z"], expected(reply.version))
    return reply.version


def worker(processes: Processes, broker: BrokerProc, version: str, *args: str) -> None:
    argv = fn_worker_argv("add", "--version", version, "--worker-id", f"add-v{version}", *args)
    start_worker(processes, broker, argv, name=f"v{version}")


def test_a_request_naming_a_version_gets_it_and_one_naming_none_the_latest(
    processes: Processes,
) -> None:
    broker = start_broker(processes)
    worker(processes, broker, "1")
    worker(processes, broker, "2")
    with RawClient(broker.frontend) as client:
        assert answered_by(call(client, "1")) == "1"
        assert answered_by(call(client, "2")) == "2"
        assert answered_by(call(client)) == "2"  # the latest
        infos = client.models()
        assert [(m.spec.name, m.spec.version) for m in infos] == [("add", "1"), ("add", "2")]
        assert [[w.worker_id for w in m.workers] for m in infos] == [["add-v1"], ["add-v2"]]
        # a batch: each row to its version, each REPLIES row saying which answered
        tensors = wire.Tensors.of(INPUTS)
        rows = (
            wire.Request(b"b1", "add", tensors, None, (), "1"),
            wire.Request(b"b2", "add", tensors, None, (), None),
        )
        client.send(wire.Requests(rows))
        got: dict[bytes, str] = {}
        while len(got) < 2:
            message = client.recv()
            replies = message.replies if isinstance(message, wire.Replies) else (message,)
            for reply in replies:
                got[reply.request_id] = answered_by(reply)  # type: ignore[union-attr]
        assert got == {b"b1": "1", b"b2": "2"}


def test_a_pinned_default_version_takes_the_requests_naming_none(processes: Processes) -> None:
    broker = start_broker(processes)
    worker(processes, broker, "1", "--default-version", "1")
    worker(processes, broker, "2", "--default-version", "1")
    with RawClient(broker.frontend) as client:
        assert answered_by(call(client)) == "1"
        assert answered_by(call(client, "2")) == "2"


def test_an_unknown_version_is_refused_naming_the_versions_served(processes: Processes) -> None:
    broker = start_broker(processes)
    worker(processes, broker, "1")
    worker(processes, broker, "2")
    with RawClient(broker.frontend) as client:
        refused = call(client, "3")
        assert isinstance(refused, wire.ErrorReply) and refused.code == "UNKNOWN_MODEL"
        assert "model 'add' has no version 3 (versions: 1, 2)" in refused.message


def test_requests_naming_no_version_move_to_a_version_that_joins(processes: Processes) -> None:
    broker = start_broker(processes)
    worker(processes, broker, "1")
    with RawClient(broker.frontend) as client:
        assert answered_by(call(client)) == "1"
        worker(processes, broker, "2")
        assert answered_by(call(client)) == "2"
        assert answered_by(call(client, "1")) == "1"  # still there for those who name it


def test_the_last_worker_of_a_version_leaving_hands_its_requests_to_the_default(
    processes: Processes,
) -> None:
    """v1 holds more jobs than it runs at once (credit 6, one thread, 100 ms a job) and
    more wait at the broker; v2 joins, then v1 is stopped (SIGTERM): it finishes what
    runs within its drain timeout and hands the rest back in its BYE. Every request is
    answered, none fails: the ones v1 did not run are answered by v2."""
    broker = start_broker(processes, liveness_ms=5000)  # a loaded host is no death
    slow = ("--credit", "6", "--threads", "1", "--delay-ms", "100", "--drain-timeout-ms", "150")
    argv = fn_worker_argv("add", "--version", "1", "--worker-id", "add-v1", *slow)
    v1 = start_worker(processes, broker, argv, name="v1")
    with RawClient(broker.frontend) as client:
        ids = [send(client, None) for _ in range(40)]
        v1.wait_for("running a job")  # it holds jobs now, one of them running
        worker(processes, broker, "2")
        v1.terminate()
        replies = []
        while len(replies) < len(ids):
            replies.append(client.recv())
    assert sorted(r.request_id for r in replies) == sorted(ids)  # type: ignore[union-attr]
    versions = [answered_by(reply) for reply in replies]  # none is an error
    assert "1" in versions and "2" in versions
    handed = broker.proc.wait_for(r"worker add-v1 dropped \(left\).*\((\d+) of them handed back")
    assert int(handed[1]) > 0, "v1 handed nothing back: the test did not test the hand-over"
    broker.proc.wait_for(r"moved from version 1 to version 2")


@pytest.mark.parametrize("named", ["1", None])
def test_requests_waiting_for_a_version_with_no_worker_left_wait_or_move(
    processes: Processes, named: str | None
) -> None:
    """With no other version, requests for the one that left wait for a worker (the
    orphan's treatment) whether or not they named it; once another version serves,
    only those that named none go to it."""
    broker = start_broker(processes, "--orphan-ms", "60000")
    v1 = start_worker(processes, broker, fn_worker_argv("add", "--worker-id", "add-v1"), name="v1")
    with RawClient(broker.frontend) as client:
        assert answered_by(call(client, named)) == "1"
        v1.terminate()
        wait_until(lambda: not client.models()[0].workers)
        request_id = send(client, named)
        wait_until(lambda: client.models()[0].queued == 1)
        worker(processes, broker, "2")
        if named is None:  # moved to v2 as soon as it served
            reply = client.recv()
            assert reply.request_id == request_id and answered_by(reply) == "2"  # type: ignore[union-attr]
        else:
            wait_until(lambda: [m.queued for m in client.models()] == [1, 0])
            start_worker(processes, broker, fn_worker_argv("add", "--worker-id", "v1-again"))
            reply = client.recv()
            assert reply.request_id == request_id and answered_by(reply) == "1"  # type: ignore[union-attr]
    assert not re.search("Traceback", broker.proc.output())
