"""Load generators and statistics with an in-process target (one completion thread)."""

from __future__ import annotations

import io
import itertools
import queue
import re
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from ipuserve.bench.loadgen import LoadConfig, OnDone, Outcome, arrivals, run_load
from ipuserve.bench.recording import Recording, Sample, split_us, summarize
from ipuserve.bench.report import LoadProgress
from ipuserve.client import Timing
from ipuserve.latency import latency_us


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


def schedule(config: LoadConfig, count: int, start_ns: int = 0) -> list[int]:
    """The first ``count`` times the open loop would issue at."""
    return list(itertools.islice(arrivals(config, start_ns), count))


def test_fixed_arrivals_are_due_exactly_one_over_the_rate_apart() -> None:
    due = schedule(LoadConfig(rate=3000.0, poisson=False), 3001, start_ns=5_000)
    assert due[0] == 5_000
    assert set(np.diff(due)) == {333_333, 333_334}  # 1e9 / 3000 ns, rounding not accumulated
    assert due[3000] - due[0] == 1_000_000_000  # 3000 requests a second


def test_poisson_arrivals_average_the_rate_and_are_fixed_by_the_seed() -> None:
    config = LoadConfig(rate=2000.0, poisson=True, seed=3)
    gaps = np.diff(schedule(config, 20_001)) / 1e9
    assert gaps.mean() == pytest.approx(1 / 2000, rel=0.03)  # 20,000 draws: ~0.7% error
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential gaps
    assert (gaps >= 0).all()
    assert schedule(config, 50) == schedule(config, 50)
    assert schedule(config, 50) != schedule(LoadConfig(rate=2000.0, seed=4), 50)


@pytest.mark.parametrize("poisson", [False, True], ids=["fixed", "poisson"])
def test_open_loop_issues_on_its_schedule_and_drains(target: Target, poisson: bool) -> None:
    config = LoadConfig(warmup_s=0, duration_s=None, requests=50, rate=5000.0, poisson=poisson)
    recording = run_load(target, config)
    assert summarize(recording)["requests"] == 50
    assert target.submitted == len(recording.samples) >= 50
    # Latency runs from the scheduled time, so each sample tells when it was due: the
    # requests went out exactly on the schedule, whatever the clock did meanwhile.
    scheduled = sorted(s.done_ns - s.latency_ns for s in recording.samples)
    assert scheduled == schedule(config, len(scheduled), start_ns=scheduled[0])


def test_progress_ends_on_one_line_with_the_final_counts(target: Target) -> None:
    stream = io.StringIO()
    progress = LoadProgress(stream, enabled=True)
    config = LoadConfig(warmup_s=0, duration_s=None, requests=100, in_flight=4)
    recording = run_load(target, config, progress)
    progress.finish()
    text = stream.getvalue()
    assert text.startswith("\r") and text.endswith("\n") and text.count("\n") == 1
    last = text[:-1].rsplit("\r", 1)[1]  # what the terminal shows at the end
    found = re.fullmatch(
        r"measuring +[\d.]+ s +(\d+) requests  ~ *\d+ requests/s  errors +(\d+)  in flight +0",
        last,
    )
    assert found, last
    errors = sum(1 for sample in recording.samples if sample.error is not None)
    assert (int(found[1]), int(found[2])) == (len(recording.samples), errors)
    assert errors == len(recording.samples) // 5  # the target fails every 5th request


def test_progress_stays_silent_when_not_on_a_terminal(target: Target) -> None:
    stream = io.StringIO()  # isatty() is False
    progress = LoadProgress(stream)
    run_load(target, LoadConfig(warmup_s=0, duration_s=None, requests=20), progress)
    progress.finish()
    assert stream.getvalue() == ""


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
    assert found["p50"] == round(float(np.percentile(values / 1e3, 50)), 3)
    assert found["p99.9"] == round(float(np.percentile(values / 1e3, 99.9)), 3)
    assert found["max"] == round(float(values.max() / 1e3), 3)


def test_only_samples_inside_the_window_are_measured() -> None:
    recording = Recording(start_ns=100, stop_ns=200)
    for done in (50, 100, 150, 200, 250):
        recording.add(Sample(done_ns=done, latency_ns=10))
    assert [s.done_ns for s in recording.measured()] == [100, 150, 200]


def test_ctrl_c_while_the_first_requests_leave_still_ends_in_a_report() -> None:
    """A Ctrl-C that lands while the caller's thread is still sending the first requests
    (after one has left) once escaped run_load as a bare KeyboardInterrupt: no report,
    and no wait for the request in flight. The request is answered while the run drains
    (from its progress call), so its completion cannot race the interrupt."""
    in_flight: list[OnDone] = []

    def submit(on_done: OnDone) -> None:
        in_flight.append(on_done)
        raise KeyboardInterrupt  # as the signal handler raises it, after the hand-over

    def progress(recording: Recording, outstanding: int) -> None:
        if recording.interrupted and in_flight:
            in_flight.pop()(Outcome())

    config = LoadConfig(in_flight=4, warmup_s=0, duration_s=60)
    recording = run_load(submit, config, progress)
    assert recording.interrupted
    assert not in_flight  # answered: the run waited for the request in flight
    assert len(recording.samples) == 1  # and it is recorded; no further request went
