"""The measuring parts the tools share: budget, latency summaries, item clock, progress line."""

from __future__ import annotations

import threading
from array import array

import numpy as np
import pytest

from ipuserve.errors import ConfigError
from ipuserve.latency import latency_us
from ipuserve.runtime.tools.item_clock import ItemClock
from ipuserve.runtime.tools.stats import Budget, LatencyRecorder, gb_per_s, rate
from ipuserve.runtime.tools.workers import Worker, supervise


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "count or a duration"),
        ({"count": 0}, "count must be >= 1"),
        ({"duration_s": 0.0}, "duration must be > 0"),
        ({"count": 1, "warmup": -1}, "warm-up must be >= 0"),
    ],
)
def test_budget_refuses_what_cannot_end_or_start(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Budget(**kwargs)  # type: ignore[arg-type]


def test_budget_ends_at_whichever_limit_comes_first() -> None:
    both = Budget(count=10, duration_s=1.0)
    assert not both.done(9, 0.5)
    assert both.done(10, 0.0)
    assert both.done(0, 1.0)
    assert not Budget(count=10).done(9, 1e9)
    assert not Budget(duration_s=1.0).done(10**9, 0.99)


def test_latency_summary_matches_numpy_in_microseconds() -> None:
    values = [1_000, 2_000, 3_000, 4_000, 100_000]
    recorder = LatencyRecorder()
    for value in values:
        recorder.add(value)
    summary = recorder.summary_us()
    us = np.array(values) / 1e3
    assert summary["count"] == len(values) == len(recorder)
    assert summary["max"] == 100.0
    assert summary["mean"] == pytest.approx(us.mean())
    for key, q in (("p50", 50), ("p90", 90), ("p99", 99), ("p99.9", 99.9)):
        assert summary[key] == pytest.approx(np.percentile(us, q), abs=1e-3)
    assert summary["p50"] <= summary["p90"] <= summary["p99"] <= summary["max"]


def test_empty_summary_is_all_zeros_not_an_error() -> None:
    assert (
        LatencyRecorder().summary_us()
        == latency_us(array("q"))
        == {
            "count": 0,
            "mean": 0.0,
            "p50": 0.0,
            "p90": 0.0,
            "p99": 0.0,
            "p99.9": 0.0,
            "max": 0.0,
        }
    )


def test_rates_of_an_empty_window_are_zero() -> None:
    assert rate(10, 0.0) == 0.0 and gb_per_s(10, 0.0) == 0.0
    assert rate(10, 2.0) == 5.0
    assert gb_per_s(3 * 10**9, 1.5) == 2.0


def test_item_clock_measures_only_after_the_warm_up() -> None:
    clock = ItemClock(warmup=2)
    for _ in range(5):
        clock.started()
    for _ in range(4):
        clock.completed()
    assert clock.done_count() == 4 and clock.started_count() == 5
    assert len(clock.latency) == 2  # items 2 and 3
    assert clock.measured()[0] == 2
    assert not clock.finished.is_set()
    clock.close(5)
    assert not clock.finished.is_set()
    clock.completed()
    assert clock.finished.is_set()
    assert clock.measured()[0] == 3 and len(clock.latency) == 3


def test_item_clock_finishes_when_closed_after_the_last_completion() -> None:
    clock = ItemClock(warmup=0)
    clock.started()
    clock.completed()
    assert not clock.finished.is_set()
    clock.close(1)  # the producer learns it was the last after the consumer saw it
    assert clock.finished.is_set()


def test_item_clock_during_warm_up_has_no_window() -> None:
    clock = ItemClock(warmup=3)
    clock.started()
    clock.completed()
    assert clock.measured() == (0, 0.0)
    assert clock.measuring_since_ns() is None
    assert clock.progress(0).phase == "warm-up"


def test_supervise_reraises_what_a_worker_died_of_and_still_stops() -> None:
    finished = threading.Event()
    stopped: list[bool] = []

    def boom() -> None:
        raise ValueError("worker failed")

    workers = [Worker("boom", boom, finished.set)]
    with pytest.raises(ValueError, match="worker failed"):
        supervise(workers, finished, lambda: stopped.append(True), lambda: None)
    assert stopped == [True]
    assert not workers[0].is_alive()


def test_supervise_turns_ctrl_c_into_an_orderly_stop() -> None:
    finished, release = threading.Event(), threading.Event()
    workers = [Worker("waiter", lambda: release.wait(), finished.set)]

    def interrupt() -> None:
        raise KeyboardInterrupt

    interrupted = supervise(workers, finished, release.set, interrupt)
    assert interrupted
    assert not workers[0].is_alive()
