"""Load generators and statistics with an in-process target (one completion thread)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from ipuserve.client.loadgen import LoadConfig, OnDone, Outcome, run_load
from ipuserve.client.stats import Recording, Sample, Timing, latency_us, split_us, summarize


class Target:
    """Completes submitted requests in order on one thread; every 5th one fails."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[OnDone | None] = queue.SimpleQueue()
        self.submitted = 0
        self.max_outstanding = 0
        self._outstanding = 0
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def __call__(self, on_done: OnDone) -> None:
        with self._lock:
            self.submitted += 1
            self._outstanding += 1
            self.max_outstanding = max(self.max_outstanding, self._outstanding)
        self.jobs.put(on_done)

    def _run(self) -> None:
        n = 0
        while (on_done := self.jobs.get()) is not None:
            n += 1
            with self._lock:
                self._outstanding -= 1
            timing = Timing(total_us=100.0, broker_queue_us=10.0, worker_us=50.0, device_us=20.0)
            on_done(Outcome("OVERLOADED") if n % 5 == 0 else Outcome(None, timing, 4, 1000))

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join()


@pytest.fixture
def target() -> Iterator[Target]:
    t = Target()
    yield t
    t.close()


def test_closed_loop_stops_at_the_request_count_and_counts_add_up(target: Target) -> None:
    config = LoadConfig(warmup_s=0, duration_s=None, requests=200, in_flight=8)
    summary = summarize(run_load(target, config))
    assert summary["requests"] == 200
    assert summary["ok"] + sum(summary["errors"].values()) == 200
    assert set(summary["errors"]) == {"OVERLOADED"}
    assert target.max_outstanding <= 8
    assert summary["throughput"]["samples_per_s"] == pytest.approx(
        4 * summary["throughput"]["req_per_s"], rel=0.01
    )


def test_closed_loop_keeps_its_requests_in_flight_until_the_duration_ends(target: Target) -> None:
    recording = run_load(target, LoadConfig(warmup_s=0.05, duration_s=0.2, in_flight=3))
    assert target.submitted == len(recording.samples)  # everything sent was drained
    assert summarize(recording)["requests"] == len(recording.measured())


def test_open_loop_issues_at_its_rate_and_drains(target: Target) -> None:
    config = LoadConfig(warmup_s=0, duration_s=None, requests=50, rate=2000.0, poisson=False)
    recording = run_load(target, config)
    summary = summarize(recording)
    assert summary["requests"] == 50
    assert target.submitted == len(recording.samples) >= 50


def test_the_split_parts_add_up_to_the_total() -> None:
    timings = [
        Timing(
            total_us=1000, broker_queue_us=100, worker_queue_us=50, device_us=300, worker_us=500
        ),
        Timing(
            total_us=2000, broker_queue_us=300, worker_queue_us=150, device_us=500, worker_us=900
        ),
    ]
    split = split_us(timings)
    assert split == {
        "broker_queue": 200.0,
        "worker_queue": 100.0,
        "device": 400.0,
        "worker_other": 200.0,
        "wire": 600.0,
        "total": 1500.0,
    }


def test_latency_percentiles_match_numpy() -> None:
    values = np.random.default_rng(0).integers(1_000, 9_000_000, 10_001)
    found = latency_us(values)
    assert found["p50"] == round(float(np.percentile(values / 1e3, 50)), 1)
    assert found["p99.9"] == round(float(np.percentile(values / 1e3, 99.9)), 1)
    assert found["max"] == round(float(values.max() / 1e3), 1)


def test_only_samples_inside_the_window_are_measured() -> None:
    recording = Recording(start_ns=100, stop_ns=200)
    for done in (50, 100, 150, 200, 250):
        recording.add(Sample(done_ns=done, latency_ns=10))
    assert [s.done_ns for s in recording.measured()] == [100, 150, 200]
