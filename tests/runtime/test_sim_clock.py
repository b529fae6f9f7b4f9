"""The simulated device's clock: host scheduling jitter is not device time, and a run of a
program estimated at T takes T at every load (IPUSERVE_SIM_TIME_SCALE slows the model,
not the host)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from ipuserve.runtime import ModelRunner, ModelRunnerConfig, PopefPaths
from ipuserve.runtime.model_runner.batch_policy import BatchPolicy
from ipuserve.runtime.popef import examples
from ipuserve.runtime.simulator.cost import CostModel, ipu_spec, time_scale_for
from ipuserve.runtime.simulator.engine import BACK_TO_BACK_S, DEVICE_LOOP_CATCH_UP_S, SimClock
from tests.helpers import wait_until


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


def test_a_run_whose_inputs_came_late_starts_when_they_came_launch_included(
    clock_and_time: tuple[SimClock, FakeTime],
) -> None:
    """The launch is the host sync that hands the inputs over: it cannot overlap the wait
    (it did, and a lone run of the MLP scaled to 2 ms took 0.8-0.96 ms)."""
    clock, fake = clock_and_time
    clock.start(0.0001)
    fake.now += 0.003  # blocked in the first input callback
    arrived = fake.now
    clock.waited_for_host()
    clock.advance(0.001)
    assert clock.started == arrived
    assert clock.deadline == pytest.approx(arrived + 0.0001 + 0.001)


def test_a_wait_in_the_middle_of_a_run_moves_the_deadline_past_the_wait(
    clock_and_time: tuple[SimClock, FakeTime],
) -> None:
    clock, fake = clock_and_time
    clock.start(0.0001)
    clock.waited_for_host()  # the first input was there
    clock.advance(0.001)
    fake.now += 0.003  # blocked in the second input callback
    clock.waited_for_host()
    clock.advance(0.001)
    assert clock.deadline == pytest.approx(fake.now + 0.001)


def test_a_late_device_thread_taking_a_ready_batch_is_not_a_device_stall(
    clock_and_time: tuple[SimClock, FakeTime],
) -> None:
    """The look-ahead says the set was ready before the device asked (ready_at 0.0): the
    run follows the previous one back to back however late the thread took it."""
    clock, fake = clock_and_time
    first_start = fake.now
    for _ in range(10):
        clock.start(0.0001)
        fake.now += 0.0015  # the thread hands outputs over and is descheduled
        clock.waited_for_host(ready_at=0.0)
        clock.advance(0.005)
        fake.now = clock.deadline + 0.0004
    assert clock.deadline == pytest.approx(first_start + 10 * 0.0051)


def test_a_batch_ready_late_starts_its_run_when_it_was_ready(
    clock_and_time: tuple[SimClock, FakeTime],
) -> None:
    clock, fake = clock_and_time
    clock.start(0.0001)
    ready = fake.now + 0.002
    fake.now += 0.0025  # the set came at `ready`; the thread took it a little later
    clock.waited_for_host(ready_at=ready)
    clock.advance(0.005)
    assert (clock.started, clock.deadline) == (ready, pytest.approx(ready + 0.0051))


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


class RecordingPolicy(BatchPolicy):
    """Eager flushing (a lone request runs at once) that keeps the device times reported."""

    name = "recording"
    reacts_to_idle = True

    def __init__(self) -> None:
        super().__init__()
        self.runs: list[float] = []

    def hold_s(
        self, filled: int, batch: int, first_time: float, now: float, idle_since: float | None
    ) -> float | None:
        return None if idle_since is None else 0.0

    def ran(self, seconds: float) -> None:
        self.runs.append(seconds)


@pytest.mark.parametrize(
    ("look_ahead", "lone_samples"),
    [("unlimited", 1), ("0", 1), ("0", 16)],  # the last: lone batches take the direct path
)
def test_a_scaled_run_takes_its_estimate_alone_and_back_to_back(
    monkeypatch: pytest.MonkeyPatch, look_ahead: str, lone_samples: int
) -> None:
    """The runtime's own account of each run's device time (what the batch policy is fed)
    is at least the estimate T, for lone runs on an idle device and for runs back to back;
    a lone run's account also lies within the span from its call to the account (so the
    device's idle time before it is not counted in). Only lower bounds on time: the host
    may be slow."""
    model = examples.build("mlp", batch_size=16)
    main = model.executable.program(model.metadata.programFlow().main()[0])
    target_s = 0.005
    scale = time_scale_for(target_s, CostModel(ipu_spec(2)).program_seconds(main))
    monkeypatch.setenv("IPUSERVE_SIM_TIME_SCALE", repr(scale))
    policy = RecordingPolicy()
    config = ModelRunnerConfig()
    config.batching_dim = 0
    config.timeout_ns = 3600 * 10**9
    config.is_batch_size_timeout_enabled = True
    config.batch_size_timeout_ns = 0
    config.ring_buffer_size_multiplier = 4
    config.max_look_ahead = look_ahead
    config.flush_on_waiting_outputs = True
    batch = np.random.default_rng(0).random((16, 784), dtype=np.float32)
    single = batch[:lone_samples]
    with ModelRunner(model, config=config, batch_policy=lambda _index: policy) as runner:
        replica = runner._replicas[0]
        for count in range(1, 4):  # lone requests: the device idles before each
            if look_ahead == "0":
                wait_until(lambda: replica.waiting_for() == "input", timeout=30.0)
            called = time.perf_counter()
            runner.execute({"input": single})
            # the device thread accounts for the run after handing its outputs over
            wait_until(lambda n=count: len(policy.runs) >= n, timeout=30.0)
            span_s = time.perf_counter() - called
            # at least the estimate; at most the span that holds the run (an ordering of
            # events, not a timing bound: the device's idle time before is not counted)
            assert target_s <= policy.runs[count - 1] <= span_s
        lone = len(policy.runs)
        futures = [runner.executeAsync({"input": batch}) for _ in range(6)]
        for future in futures:
            future.wait(30.0)
    assert len(policy.runs) >= lone + 6  # (and the run on zeros that shutdown finishes)
    assert min(policy.runs) >= target_s
    if lone_samples == 16:
        assert replica._direct is not None and replica._direct.runs >= 3
