"""Dispatcher and ModelQueue bookkeeping, and the metrics text format (no sockets)."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np
import pytest

from ipuserve.broker.dispatch import Dispatcher, ModelQueue
from ipuserve.broker.jobs import JobEntry, JobTable, State
from ipuserve.broker.metrics import BrokerMetrics
from ipuserve.broker.registry import Registry
from ipuserve.broker.timers import Timers
from ipuserve.errors import OverloadedError
from ipuserve.protocol import Hello, Tensors
from ipuserve.versions import default_key
from tests.broker.fakes import ADD

TABLE = JobTable()


def job(
    model: str = "add", at: float = 0.0, timeout_ms: float | None = None, members: int = 0
) -> JobEntry:
    """A job; with ``members``, a group job of that many requests."""
    group = tuple(b"%f-%d" % (at, i) for i in range(members))
    key = (model, "1")
    return TABLE.create(b"client", b"%f" % at, key, Tensors(), at, timeout_ms, group=group)


def test_a_queue_is_bounded_but_requeued_jobs_always_fit() -> None:
    queue = ModelQueue("add", limit=2)
    queue.push(job())
    queue.push(job())
    with pytest.raises(OverloadedError, match="2 queued"):
        queue.push(job())
    queue.push_front(job())
    assert len(queue) == 3


def test_jobs_answered_while_queued_are_skipped_and_not_counted() -> None:
    queue = ModelQueue("add", limit=10)
    first, second = job(at=1), job(at=2)
    queue.push(first)
    queue.push(second)
    first.state = State.DONE
    queue.forget(first)
    assert len(queue) == 1 and queue.pop() is second and queue.pop() is None


def test_a_queue_counts_and_limits_requests_not_jobs() -> None:
    queue = ModelQueue("add", limit=10)
    group = job(at=1, members=6)
    queue.push(group)
    assert len(queue) == 6
    with pytest.raises(OverloadedError, match="6 queued requests and a limit of 10; 5 more"):
        queue.push(job(at=2, members=5))
    queue.push(job(at=3, members=4))
    assert len(queue) == 10
    with pytest.raises(OverloadedError):
        queue.push(job(at=4))
    assert queue.pop() is group and len(queue) == 4
    late = queue.head()
    assert late is not None
    late.state = State.DONE
    queue.forget(late)
    assert len(queue) == 0 and queue.pop() is None


def test_an_empty_queue_admits_a_group_bigger_than_its_limit() -> None:
    queue = ModelQueue("add", limit=2)
    queue.push(job(members=5))  # else a limit under the group size would refuse it forever
    assert len(queue) == 5
    with pytest.raises(OverloadedError):
        queue.push(job(at=1))


def test_a_worker_counts_the_requests_its_jobs_hold() -> None:
    worker = Registry().add(b"w", Hello("w", (ADD,), 4), 0.0)[0]
    worker.in_flight[b"1"] = job(at=1, members=3)
    worker.in_flight[b"2"] = job(at=2)
    assert len(worker.in_flight) == 2 and worker.requests_in_flight == 4
    assert worker.spare == 2  # credit counts jobs


def test_choose_picks_the_least_loaded_worker_with_spare_credit() -> None:
    registry = Registry()
    a = registry.add(b"a", Hello("a", (ADD,), 4), 0.0)[0]
    b = registry.add(b"b", Hello("b", (ADD,), 1), 0.0)[0]
    dispatcher = Dispatcher(registry, 10)
    add = ("add", "1")
    assert dispatcher.choose(add) is a  # a tie goes to the first registered
    a.in_flight[b"1"] = job()
    assert dispatcher.choose(add) is b  # 0/1 < 1/4
    b.in_flight[b"2"] = job()
    assert dispatcher.choose(add) is a  # b has no spare credit
    a.credit = 1
    assert dispatcher.choose(add) is None
    assert dispatcher.choose(("other", "1")) is None
    assert dispatcher.choose(("add", "2")) is None  # another version: other workers


def test_next_for_takes_the_oldest_job_among_the_worker_models() -> None:
    other = ADD.__class__("other", ADD.inputs, ADD.outputs, 4, 0)
    registry = Registry()
    worker = registry.add(b"w", Hello("w", (ADD, other), 2), 0.0)[0]
    dispatcher = Dispatcher(registry, 10)
    newer, older = job("add", at=5), job("other", at=3)
    dispatcher.enqueue(newer)
    dispatcher.enqueue(older)
    assert dispatcher.next_for(worker) is older
    assert dispatcher.next_for(worker) is newer
    assert dispatcher.next_for(worker) is None


def test_timers_fire_in_due_order_once_and_only_when_due() -> None:
    timers, fired = Timers(), []

    def record(arg: object, now: float) -> None:
        fired.append((arg, now))

    assert timers.next_due == float("inf")  # nothing armed: the loop blocks
    for due, name in ((0.3, "late"), (0.1, "early"), (0.2, "middle"), (0.1, "early too")):
        timers.at(due, record, name)
    assert timers.next_due == pytest.approx(0.1)
    assert timers.run(0.09) == 0 and fired == []
    assert timers.run(0.2) == 3
    assert fired == [("early", 0.2), ("early too", 0.2), ("middle", 0.2)]  # ties: as armed
    assert timers.next_due == pytest.approx(0.3) and len(timers) == 1
    assert timers.run(1.0) == 1 and timers.run(2.0) == 0
    assert timers.next_due == float("inf")


def test_a_timer_armed_by_a_firing_one_fires_in_the_same_run_when_due() -> None:
    timers, fired = Timers(), []

    def again(count: int, now: float) -> None:
        fired.append(count)
        if count < 3:
            timers.at(now, again, count + 1)  # due at once
        timers.at(now + 1.0, again, 99)  # due later: stays armed

    timers.at(0.0, again, 1)
    assert timers.run(0.5) == 3 and fired == [1, 2, 3]
    assert timers.next_due == pytest.approx(1.5)


def test_metrics_render_in_the_prometheus_text_format() -> None:
    metrics = BrokerMetrics()
    metrics.errors.labels("OVERLOADED", "add").inc()
    metrics.errors.labels("OVERLOADED", "add").inc()
    metrics.queued.labels('we"ird', "1").set(3)
    metrics.of("add", "2").queue_seconds.observe_many(0.0003, 4)  # a group of 4
    text = metrics.render()
    assert "# TYPE ipuserve_broker_errors_total counter" in text
    assert 'ipuserve_broker_errors_total{code="OVERLOADED",model="add"} 2.0' in text
    assert 'ipuserve_broker_queued{model="we\\"ird",version="1"} 3.0' in text
    series = 'model="add",version="2"'
    assert f'ipuserve_broker_queue_seconds_bucket{{le="0.00025",{series}}} 0.0' in text
    assert f'ipuserve_broker_queue_seconds_bucket{{le="0.0005",{series}}} 4.0' in text
    assert f'ipuserve_broker_queue_seconds_bucket{{le="+Inf",{series}}} 4.0' in text
    assert f"ipuserve_broker_queue_seconds_count{{{series}}} 4.0" in text
    assert f"ipuserve_broker_queue_seconds_sum{{{series}}} 0.0012" in text
    assert "_created" not in text  # off: ipuserve.metrics says why


def test_a_finished_job_lets_go_of_its_payload() -> None:
    """The timer heap and a queue's deque keep a finished job until it reaches their
    front: behind one slow job, every finished job's payload stayed (a chaos review:
    8000 answered 64 KiB requests took the broker from 44 to 556 MiB)."""
    table, timers = JobTable(), Timers()
    payload = np.zeros((4, 8), np.float32)
    job = table.create(b"c", b"r1", ("add", "1"), Tensors.of({"x": payload}), 0.0, 1000.0)
    timers.at(1.0, lambda _job, _now: None, job)  # as the job's deadline is armed
    alive = weakref.ref(payload)
    del payload
    table.finish(job)
    gc.collect()
    assert alive() is None and job.state is State.DONE


def test_the_default_version_is_the_pinned_one_served_else_the_latest_served() -> None:
    specs = {
        ("m", v): ADD.__class__("m", ADD.inputs, ADD.outputs, version=v) for v in ["1", "2", "10"]
    }
    taking, draining = SimpleNamespace(credit=2), SimpleNamespace(credit=0)
    serving: dict[tuple[str, str], list[Any]] = {
        ("m", "1"): [taking],
        ("m", "2"): [taking],
        ("m", "10"): [],
    }
    assert default_key("m", specs, serving) == ("m", "2")  # 10 has no worker now
    serving[("m", "10")] = [taking]
    assert default_key("m", specs, serving) == ("m", "10")  # as numbers: 10 > 2
    specs[("m", "10")] = msgspec.structs.replace(specs[("m", "10")], default_version="1")
    assert default_key("m", specs, serving) == ("m", "1")  # pinned by the latest's config
    serving[("m", "1")] = [draining]
    assert default_key("m", specs, serving) == ("m", "10")  # the pin drains: the latest
    serving[("m", "1")] = []
    assert default_key("m", specs, serving) == ("m", "10")  # a pin nobody serves: the latest
    serving[("m", "10")] = serving[("m", "2")] = [draining]
    assert default_key("m", specs, serving) == ("m", "10")  # all drain: served still counts
    assert default_key("m", specs, {}) == ("m", "10")  # nobody at all: the latest known
    assert default_key("other", specs, serving) is None
