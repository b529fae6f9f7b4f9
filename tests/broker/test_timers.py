"""The broker's timers fire at the event that is due, on a loop turned by hand.

Every timer sits on one heap (:mod:`ipuserve.broker.timers`) and the loop fires what
is due by the time it reads. Here the test is the loop: it reads what waits on a
socket, then fires the timers as of a time it names (past the real clock, as a
broker would see it later), so each check is of the event before and at the due
time, with no sleep and no timing assertion. Real sockets on loopback throughout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from ipuserve import protocol as wire
from ipuserve.broker.config import BrokerConfig
from ipuserve.broker.jobs import JobEntry, State
from ipuserve.broker.loop import Broker
from ipuserve.broker.registry import Worker
from ipuserve.broker.timers import Timers
from tests.broker.fakes import ADD, TIMEOUT, FakeWorker
from tests.helpers import RawClient, add_inputs

INPUTS = add_inputs(2)


class HandTurned:
    """A Broker whose loop is the test's: :meth:`read` one socket, :meth:`at` a time."""

    def __init__(self, **overrides: Any) -> None:
        settings: dict[str, Any] = {
            "frontend": "tcp://127.0.0.1:*",
            "backend": "tcp://127.0.0.1:*",
            "heartbeat_ms": 1000,
            "liveness_ms": 3000,
            "grace_ms": 0,
            **overrides,
        }
        self.broker = Broker(BrokerConfig(**settings))
        self.made: list[FakeWorker] = []

    def read(self, side: str) -> None:
        """Wait for a message on ``side`` ("frontend" or "backend"), then handle all
        that wait there and send what they placed: one turn's reading."""
        broker = self.broker
        sock = broker._backend if side == "backend" else broker._frontend
        assert sock.poll(int(TIMEOUT * 1000)), f"nothing arrived on the {side}"
        handle = broker._on_worker if side == "backend" else broker._on_client
        broker._drain(sock, handle)

    def read_until(self, side: str, done: Callable[[], bool]) -> None:
        """:meth:`read` until ``done()``: messages sent together may arrive over more
        than one turn."""
        self.read(side)
        while not done():
            self.read(side)

    def at(self, now: float) -> None:
        """Fire the timers due by ``now`` and send what they placed or answered."""
        self.broker.timers.run(now)
        self.broker.flush()

    def worker(self, worker_id: str, credit: int = 1) -> FakeWorker:
        """A registered fake worker that sends nothing by itself (silent unless told)."""
        fake = FakeWorker(self.broker.backend_endpoint, credit=credit, worker_id=worker_id)
        fake.alive = False  # no heartbeats of its own: the test says when it is heard
        self.made.append(fake)
        fake.send(wire.Hello(worker_id, fake.models, credit))
        self.read("backend")
        fake.welcome = fake.expect(wire.Welcome)
        return fake

    def registered(self, worker_id: str) -> Worker | None:
        return self.broker.registry.by_worker_id(worker_id)

    def live(self) -> list[JobEntry]:
        return sorted(self.broker.jobs.live(), key=lambda job: job.received)

    def close(self) -> None:
        for fake in self.made:
            fake.close()
        self.broker._shutdown()


@pytest.fixture
def hand() -> Iterator[HandTurned]:
    turned = HandTurned()
    yield turned
    turned.close()


@pytest.fixture
def client(hand: HandTurned) -> Iterator[RawClient]:
    with RawClient(hand.broker.frontend_endpoint) as raw:
        yield raw


def test_a_deadline_fires_at_its_due_time_at_a_worker_and_in_the_queue(
    hand: HandTurned, client: RawClient
) -> None:
    worker = hand.worker("a", credit=1)
    running = client.request("add", INPUTS, timeout_ms=100)
    hand.read("frontend")
    worker.job()
    queued = client.request("add", INPUTS, timeout_ms=100)
    hand.read("frontend")
    first, second = hand.live()
    assert first.deadline is not None and second.deadline is not None
    hand.at(first.deadline - 1e-6)
    assert (first.state, second.state) == (State.RUNNING, State.QUEUED)
    hand.at(first.deadline)
    assert first.state is State.DONE and second.state is State.QUEUED
    error = client.recv()
    assert isinstance(error, wire.ErrorReply) and error.request_id == running
    assert error.code == "DEADLINE_EXCEEDED" and "at a worker" in error.message
    hand.at(second.deadline)
    error = client.recv()
    assert isinstance(error, wire.ErrorReply) and error.request_id == queued
    assert "in the queue" in error.message
    # the worker still holds the expired job: its credit comes back when it answers
    held = hand.registered("a")
    assert held is not None and len(held.in_flight) == 1


def test_a_silent_worker_is_dropped_at_the_first_heartbeat_past_its_liveness(
    hand: HandTurned, client: RawClient
) -> None:
    silent = hand.worker("silent", credit=1)
    client.request("add", INPUTS)
    hand.read("frontend")
    silent.job()
    worker = hand.registered("silent")
    assert worker is not None
    heard, liveness, beat = worker.last_seen, 3.0, 1.0
    hand.at(heard + liveness - 0.001)  # a heartbeat is due: silent, but not for long enough
    assert hand.registered("silent") is worker
    hand.at(heard + liveness + 0.001)  # past the window, but no heartbeat is due yet
    assert hand.registered("silent") is worker
    hand.at(heard + liveness - 0.001 + beat)  # the next heartbeat: dropped
    assert hand.registered("silent") is None
    (job,) = hand.live()
    assert job.state is State.QUEUED  # re-queued, for the next worker to take
    assert hand.broker.metrics.value("ipuserve_broker_workers_lost_total", reason="silent") == 1
    hand.worker("next", credit=1).job()


def test_a_model_without_workers_refuses_its_queue_at_orphan_ms_not_before() -> None:
    hand = HandTurned(orphan_ms=5000)
    try:
        with RawClient(hand.broker.frontend_endpoint) as raw:
            leaving = hand.worker("leaving", credit=1)
            ids = [raw.request("add", INPUTS), raw.request("add", INPUTS)]
            hand.read_until("frontend", lambda: len(hand.live()) == 2)
            job = leaving.job()
            leaving.send(wire.Bye(handed_back=(job.job_id,)))
            hand.read("backend")
            since = hand.broker.registry.orphaned[("add", "1")]
            hand.at(since + 4.999)
            assert [job.state for job in hand.live()] == [State.QUEUED, State.QUEUED]
            hand.at(since + 5.0)
            assert hand.live() == []
            errors = [raw.recv(), raw.recv()]
            assert sorted(e.request_id for e in errors) == sorted(ids)  # type: ignore[union-attr]
            assert {e.code for e in errors} == {"UNAVAILABLE"}  # type: ignore[union-attr]
    finally:
        hand.close()


def test_overload_is_reported_at_once_then_at_most_every_ten_seconds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    hand = HandTurned(queue_limit=1, liveness_ms=60_000)
    caplog.set_level(logging.WARNING, logger="ipuserve.broker.answers")
    try:
        with RawClient(hand.broker.frontend_endpoint) as raw:
            hand.worker("a", credit=1)
            raw.request("add", INPUTS)  # runs
            raw.request("add", INPUTS)  # queued
            refused = raw.request("add", INPUTS)  # OVERLOADED
            metrics, errors = hand.broker.metrics, "ipuserve_broker_errors_total"
            hand.read_until(
                "frontend", lambda: metrics.value(errors, code="OVERLOADED", model="add") == 1
            )
            error = raw.recv()
            assert isinstance(error, wire.ErrorReply) and error.request_id == refused
            assert error.code == "OVERLOADED"
            assert "refused OVERLOADED" not in caplog.text  # at the end of the turn
            due = time.monotonic()
            hand.at(due)
            assert caplog.text.count("1 request(s) refused OVERLOADED") == 1
            raw.request("add", INPUTS)  # OVERLOADED again, within ten seconds
            hand.read("frontend")
            hand.at(due + 9.9)
            assert caplog.text.count("refused OVERLOADED") == 1
            hand.at(due + 10.0)
            assert caplog.text.count("refused OVERLOADED") == 2
    finally:
        hand.close()


def test_a_jobs_sample_count_is_taken_at_admission_and_feeds_the_group_sizer(
    hand: HandTurned, client: RawClient
) -> None:
    """Counted once, when the request is admitted (or, queued in the start-up grace,
    when its model's first worker brings the schema), not again at the result."""
    hand.broker._clients.grace_until = float("inf")  # as in a start-up grace
    client.request("add", add_inputs(3))
    hand.read("frontend")
    (job,) = hand.live()
    assert job.state is State.QUEUED and job.samples == 0  # its model is unknown yet
    worker = hand.worker("a", credit=1)
    assert job.samples == 3
    worker.answer(worker.job())  # device_us 1.0 for 3 samples
    hand.read("backend")
    assert job.state is State.DONE
    assert hand.broker.group_sizer.members_per_job(ADD, 1) == 3000  # 1/3 us each


def test_moot_timers_are_shed_when_the_heap_doubles_and_live_ones_still_fire() -> None:
    """The heap alone: entries a kind of timer calls moot go at the next rebuild; the
    others (and the sentinel) stay, and fire in due order."""
    done: set[int] = set()
    fired: list[int] = []

    def fire(arg: int, _now: float) -> None:
        fired.append(arg)

    timers = Timers(compact_min=8)  # rebuilt when past 8 entries, the sentinel counted
    timers.lapses(fire, lambda arg: arg in done)
    for arg in range(7):
        timers.at(float(arg), fire, arg)
    done.update((1, 3))  # answered before their due time
    assert len(timers) == 7 and timers.compact_at == 8  # no rebuild yet
    timers.at(7.0, fire, 7)  # 9 entries: rebuilt without the two moot ones
    assert len(timers) == 6 and timers.compact_at == 14  # 6 + the sentinel, doubled
    assert timers.run(100.0) == 6
    assert fired == [0, 2, 4, 5, 6, 7]
    assert timers.next_due == float("inf")


def test_answered_deadlines_leave_the_heap_long_before_they_are_due(
    hand: HandTurned, client: RawClient
) -> None:
    """Requests with a timeout of days, answered at once: their deadline timers do not
    pile up (the heap stays within twice its live timers), and the deadline of a job
    still running fires when due (the heap rebuilt meanwhile)."""
    timers = hand.broker.timers
    timers.compact_min = timers.compact_at = 16
    worker = hand.worker("a", credit=1)
    day_ms = 86_400_000.0
    for _ in range(60):
        client.request("add", INPUTS, timeout_ms=day_ms)
        hand.read("frontend")
        worker.answer(worker.job())
        hand.read("backend")
        reply = client.recv()
        assert isinstance(reply, wire.Reply)
        assert len(timers) <= 32, "answered deadlines piled up on the heap"
    running = client.request("add", INPUTS, timeout_ms=1000.0)  # within the liveness
    hand.read("frontend")
    worker.job()
    for _ in range(40):  # more pushes than the heap holds: at least one rebuild
        client.request("add", INPUTS, timeout_ms=1.0)
        hand.read("frontend")
    (job, *_queued) = hand.live()
    assert job.request_id == running and job.deadline is not None
    hand.at(job.deadline)
    assert job.state is State.DONE  # its timer survived every rebuild
    codes = {
        message.request_id: message.code
        for message in (client.recv() for _ in range(41))
        if isinstance(message, wire.ErrorReply)
    }
    assert codes[running] == "DEADLINE_EXCEEDED"
