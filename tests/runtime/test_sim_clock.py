"""The simulated device's clock: host scheduling jitter is not device time."""

from __future__ import annotations

from pathlib import Path

import pytest

from ipuserve.runtime import ModelRunner, PopefPaths
from ipuserve.runtime.popef import examples
from ipuserve.runtime.simulator.engine import BACK_TO_BACK_S, DEVICE_LOOP_CATCH_UP_S, SimClock


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock_and_time() -> tuple[SimClock, FakeTime]:
    fake = FakeTime()
    return SimClock(now=fake), fake


def run(clock: SimClock, fake: FakeTime, launch: float, work: float, woke_late: float) -> None:
    """One run: launch, one step of work, the thread waking ``woke_late`` after the end."""
    clock.start(launch)
    clock.advance(work)
    fake.now = clock.deadline + woke_late


def test_back_to_back_runs_do_not_accumulate_the_hosts_wake_up_delay(
    clock_and_time: tuple[SimClock, FakeTime],
) -> None:
    clock, fake = clock_and_time
    first_start = fake.now
    for _ in range(10):
        run(clock, fake, launch=0.0001, work=0.005, woke_late=0.0004)
    assert clock.deadline == pytest.approx(first_start + 10 * 0.0051)  # not + 10 x 0.4 ms


def test_a_run_after_the_device_idled_starts_when_it_is_started(
    clock_and_time: tuple[SimClock, FakeTime],
) -> None:
    clock, fake = clock_and_time
    run(clock, fake, launch=0.0001, work=0.005, woke_late=0.0)
    fake.now += BACK_TO_BACK_S + 0.5  # idle: nobody asked for a run
    started = fake.now
    clock.start(0.0001)
    assert clock.deadline == pytest.approx(started + 0.0001)


def test_waiting_for_the_host_moves_the_deadline_past_the_wait(
    clock_and_time: tuple[SimClock, FakeTime],
) -> None:
    clock, fake = clock_and_time
    clock.start(0.0001)
    fake.now += 0.003  # blocked in an input callback
    clock.waited_for_host()
    clock.advance(0.001)
    assert clock.deadline == pytest.approx(fake.now + 0.001)


def test_a_device_loop_catches_up_a_thread_that_was_descheduled_for_milliseconds() -> None:
    fake = FakeTime()
    looping = SimClock(now=fake, catch_up_s=DEVICE_LOOP_CATCH_UP_S)
    first_start = fake.now
    for _ in range(10):  # the host's cores are busy: the thread gets going 10 ms late
        run(looping, fake, launch=0.0001, work=0.005, woke_late=0.010)
    assert looping.deadline == pytest.approx(first_start + 10 * 0.0051)


def test_the_runners_sessions_are_device_loops(tmp_path: Path) -> None:
    [path] = examples.noop().write(tmp_path / "noop.popef")
    with ModelRunner(PopefPaths([str(path)])) as runner:
        [replica] = runner._replicas
        assert replica.session.config.device_loop
