"""The batch policies' decisions, fed made-up arrival, answer and device times (no clock)."""

from __future__ import annotations

import numpy as np
import pytest

import ipuserve.runtime as model_runtime
from ipuserve.errors import ConfigError
from ipuserve.runtime.model_runner.batch_policy import (
    MAX_OWED_ENTRIES,
    AdaptivePolicy,
    BatchAccount,
    BatchPolicy,
    EagerPolicy,
    FixedPolicy,
    make_policy,
    policy_from_spec,
)
from ipuserve.runtime.popef.types import Model

from .conftest import WAIT_S, assert_matches, reference, rows

MS = 1e-3
RUN = 2 * MS  # device time per batch of 16
BATCH = 16


def closed_loop_policy(return_s: float = 1 * MS, rounds: int = 5) -> AdaptivePolicy:
    """A policy that has seen ``rounds`` batches of 16 answered and come back
    ``return_s`` later, each run taking RUN: a closed loop of 16 clients."""
    policy = AdaptivePolicy()
    now = 0.0
    for _ in range(rounds):
        policy.ran(RUN)
        now += RUN
        policy.completed(BATCH, now)
        now += return_s
        policy.arrived(BATCH, now)
    return policy


def test_a_lone_client_never_waits() -> None:
    """1 in flight: its sample was repaid by its own arrival; nothing more is coming."""
    policy = AdaptivePolicy()
    now = 0.0
    for _ in range(5):
        policy.ran(RUN)
        now += RUN
        policy.completed(1, now)
        now += 1 * MS
        policy.arrived(1, now)
        assert policy.hold_s(1, BATCH, now, now, idle_since=now - 1 * MS) == 0.0


def test_half_a_batch_waits_for_the_half_just_answered() -> None:
    """16 in flight split 8/8: when the device idles with 8, the 8 just answered are
    due back one return time later, sooner than a run: the batch waits for them."""
    policy = closed_loop_policy(return_s=1 * MS)
    t = 1.0
    policy.completed(8, t)  # the run of 8 just ended
    hold = policy.hold_s(8, BATCH, first_time=t - 1 * MS, now=t, idle_since=t)
    assert hold == pytest.approx(1 * MS)  # the return time, all returns alike: no deviation
    # the owed come back: the batch is full and runs, the policy owes nothing more
    policy.arrived(8, t + 1 * MS)
    assert policy.hold_s(1, BATCH, t + 2 * MS, t + 2 * MS, idle_since=t) == 0.0


def test_the_batch_waits_only_for_what_it_still_needs() -> None:
    """Owed samples from two runs: 4 missing are repaid by the older run's, due first."""
    policy = closed_loop_policy(return_s=1 * MS)
    t = 1.0
    policy.completed(4, t)
    policy.completed(8, t + 0.5 * MS)
    now = t + 0.5 * MS
    assert policy.hold_s(12, BATCH, now, now, idle_since=now) == pytest.approx(0.5 * MS)
    assert policy.hold_s(4, BATCH, now, now, idle_since=now) == pytest.approx(1 * MS)


def test_a_partial_batch_of_a_small_closed_loop_waits_for_the_rest_then_runs() -> None:
    """4 in flight: the four come back close together; once all are in, none is owed."""
    policy = closed_loop_policy(return_s=1 * MS)
    t = 1.0
    policy.completed(4, t)
    policy.arrived(3, t + 1 * MS)
    now = t + 1 * MS
    assert policy.hold_s(3, BATCH, now, now, idle_since=t) == pytest.approx(0.0, abs=1e-12)
    policy.arrived(1, now)
    assert policy.hold_s(4, BATCH, now, now, idle_since=t) == 0.0


def test_no_wait_while_the_device_computes() -> None:
    """A busy device: the batch fills for free; the policy sets no limit of its own."""
    policy = closed_loop_policy()
    assert policy.hold_s(3, BATCH, 1.0, 1.0, idle_since=None) is None


def test_returns_slower_than_a_run_are_not_waited_for() -> None:
    """Owed samples due back later than one run away: run what is there."""
    policy = closed_loop_policy(return_s=5 * MS)
    t = 1.0
    policy.completed(8, t)
    assert policy.hold_s(8, BATCH, t, t, idle_since=t) == 0.0


def test_returns_slower_than_a_run_but_sooner_than_its_host_cost_are_waited_for() -> None:
    """A run costs the host too: with 1.5 ms of host CPU per 2 ms run, samples due back
    in 3 ms are worth waiting for -- running now would make a second run for them, 3.5
    ms of device and host time -- and the same samples are not waited for when the
    runs cost the host nothing."""
    t = 1.0
    weighed = closed_loop_policy(return_s=3 * MS)
    for _ in range(5):
        weighed.hosted(1.5 * MS)
    assert weighed.cost_s == pytest.approx(RUN + 1.5 * MS)
    weighed.completed(8, t)
    assert weighed.hold_s(8, BATCH, t, t, idle_since=t) == pytest.approx(3 * MS)
    device_only = closed_loop_policy(return_s=3 * MS)
    device_only.completed(8, t)
    assert device_only.hold_s(8, BATCH, t, t, idle_since=t) == 0.0


def test_returns_slower_than_a_run_and_its_host_cost_are_not_waited_for() -> None:
    policy = closed_loop_policy(return_s=5 * MS)
    policy.hosted(1.5 * MS)
    t = 1.0
    policy.completed(8, t)
    assert policy.hold_s(8, BATCH, t, t, idle_since=t) == 0.0


def test_the_wait_is_bounded_by_a_runs_cost_from_when_the_batch_could_start() -> None:
    policy = closed_loop_policy(return_s=3 * MS)
    policy.hosted(1.5 * MS)
    t = 1.0
    policy.completed(8, t)
    # idle for 1 ms already: 2.5 ms of the run's cost (2 + 1.5 ms) is left, not 3
    hold = policy.hold_s(8, BATCH, t - 3 * MS, t, idle_since=t - 1 * MS)
    assert hold == pytest.approx(2.5 * MS)


def test_the_host_cost_is_a_moving_average_from_its_first_measure() -> None:
    policy = AdaptivePolicy()
    assert policy.host_s == 0.0 and policy.cost_s is None
    policy.hosted(1 * MS)
    policy.hosted(2 * MS)
    policy.ran(2 * MS)
    assert policy.host_s == pytest.approx(1.2 * MS)
    assert policy.cost_s == pytest.approx(3.2 * MS)


def test_a_runner_tells_its_policy_what_each_run_cost_the_host(mlp: Model) -> None:
    """The device thread's CPU per run reaches the policy: the MLP's numpy work costs it."""
    policy = AdaptivePolicy()
    config = model_runtime.ModelRunnerConfig()
    config.batching_dim = 0
    runner = model_runtime.ModelRunner(mlp, config=config, batch_policy=lambda _i: policy)
    try:
        inputs = {"input": rows(16, 32, 7)}
        for _ in range(3):
            assert_matches(runner.execute(inputs), reference("mlp", mlp, inputs))
    finally:
        runner.close()
    assert policy.host_s > 0.0


def test_overdue_samples_are_written_off() -> None:
    """Clients that left (or an open loop): what is long overdue is not waited for."""
    policy = closed_loop_policy(return_s=1 * MS)
    policy.completed(8, 1.0)
    now = 1.0 + 10 * MS
    assert policy.hold_s(8, BATCH, now, now, idle_since=now) == 0.0
    # and written off for good: nothing is waited for later either
    assert policy.hold_s(8, BATCH, now, now + RUN, idle_since=now) == 0.0


def test_the_wait_is_bounded_by_a_run_from_when_the_batch_could_start() -> None:
    policy = closed_loop_policy(return_s=1.5 * MS)
    t = 1.0
    policy.completed(8, t)
    # idle for 1 ms already: 1 ms of the run's worth of waiting is left, not 1.5
    hold = policy.hold_s(8, BATCH, t - 3 * MS, t, idle_since=t - 1 * MS)
    assert hold == pytest.approx(1 * MS)


def test_the_batch_timeout_bounds_every_wait() -> None:
    policy = closed_loop_policy(return_s=1 * MS)
    policy.limit_s = 0.4 * MS
    t = 1.0
    policy.completed(8, t)
    assert policy.hold_s(8, BATCH, t - 0.1 * MS, t, idle_since=t) == pytest.approx(0.3 * MS)


def test_the_owed_answers_are_bounded() -> None:
    """A device never idle never prunes the overdue; the oldest answers are forgotten."""
    policy = closed_loop_policy()
    for i in range(MAX_OWED_ENTRIES + 10):
        policy.completed(1, 1.0 + i * 1e-6)
    now = 1.0 + MAX_OWED_ENTRIES * 1e-6
    # the missing 1 is repaid by the oldest remembered answer, 10 after the first
    policy.arrived(9, now)
    returns = policy.return_s
    assert returns is not None
    assert policy.hold_s(15, BATCH, now, now, idle_since=now) == pytest.approx(
        1.0 + 19 * 1e-6 + returns - now
    )


def test_nothing_measured_yet_means_no_wait() -> None:
    """Before the first run the policy knows no device time: it behaves eagerly."""
    policy = AdaptivePolicy()
    policy.completed(8, 1.0)
    assert policy.hold_s(8, BATCH, 1.0, 1.0, idle_since=1.0) == 0.0


def test_the_return_estimate_is_mean_plus_two_deviations() -> None:
    policy = AdaptivePolicy()
    for now, back in ((0.0, 1 * MS), (1.0, 3 * MS)):
        policy.completed(1, now)
        policy.arrived(1, now + back)
    # mean 1 + 0.2 * 2 = 1.4 ms; deviation 0.2 * |3 - 1| = 0.4 ms
    assert policy.return_s == pytest.approx(1.4 * MS + 2 * 0.4 * MS)


def test_device_time_is_a_moving_average() -> None:
    policy = AdaptivePolicy()
    policy.ran(2 * MS)
    policy.ran(4 * MS)
    assert policy.run_s == pytest.approx(2.4 * MS)


def test_eager_runs_a_partial_batch_when_the_device_idles() -> None:
    policy = EagerPolicy()
    assert policy.hold_s(1, BATCH, 0.0, 1.0, idle_since=0.5) == 0.0
    assert policy.hold_s(1, BATCH, 0.0, 1.0, idle_since=None) is None


def test_fixed_waits_its_window_from_the_first_sample() -> None:
    policy = FixedPolicy(4 * MS)
    assert policy.hold_s(1, BATCH, 1.0, 1.0 + 1 * MS, idle_since=1.0) == pytest.approx(3 * MS)
    assert policy.hold_s(1, BATCH, 1.0, 1.0 + 1 * MS, idle_since=None) == pytest.approx(3 * MS)
    assert policy.hold_s(1, BATCH, 1.0, 1.0 + 5 * MS, idle_since=None) == 0.0


def test_the_spec_semantics_as_policies() -> None:
    never = 2**63 - 1
    assert type(policy_from_spec(False, 0, never)) is BatchPolicy
    assert type(policy_from_spec(True, never, never)) is BatchPolicy
    assert isinstance(policy_from_spec(True, 0, never), EagerPolicy)
    fixed = policy_from_spec(True, 3_000_000, never)
    assert isinstance(fixed, FixedPolicy) and fixed.limit_s == pytest.approx(3 * MS)


def test_make_policy_by_name() -> None:
    assert make_policy("adaptive").name == "adaptive"
    assert make_policy("eager", 5 * MS).name == "eager"
    assert make_policy("fixed", 2 * MS).limit_s == pytest.approx(2 * MS)
    with pytest.raises(ConfigError, match="needs a batch timeout > 0"):
        make_policy("fixed")
    with pytest.raises(ConfigError, match="unknown batch policy 'greedy'"):
        make_policy("greedy")


def test_the_account_reports_each_batch_it_closes() -> None:
    closed: list[tuple[int, float]] = []
    account = BatchAccount(4, lambda samples, waited: closed.append((samples, waited)))
    account.add(1, 10.0)
    account.add(2, 10.5)
    account.add(3, 11.0)  # completes the first batch (4) and starts the next with 2
    assert (account.filled, account.first_time) == (2, 11.0)
    account.flushed(12.0)
    account.flushed(13.0)  # nothing partial: no batch
    account.add(9, 14.0)  # two whole batches and one sample
    assert closed == [(4, 1.0), (2, 1.0), (4, 0.0), (4, 0.0)]
    assert account.filled == 1


# -- a policy plugged into a real ModelRunner ------------------------------------------


class Recording(EagerPolicy):
    """Eager, and remembers what the replica told it."""

    def __init__(self) -> None:
        super().__init__(None, self._closed)
        self.arrivals: list[int] = []
        self.completions: list[int] = []
        self.batches: list[int] = []
        self.asked_idle: list[bool] = []

    def hold_s(
        self, filled: int, batch: int, first_time: float, now: float, idle_since: float | None
    ) -> float | None:
        self.asked_idle.append(idle_since is not None)
        return super().hold_s(filled, batch, first_time, now, idle_since)

    def arrived(self, samples: int, now: float) -> None:
        self.arrivals.append(samples)

    def completed(self, samples: int, now: float) -> None:
        self.completions.append(samples)

    def _closed(self, samples: int, _waited: float) -> None:
        self.batches.append(samples)


@pytest.mark.parametrize("look_ahead", ["unlimited", "0"])
def test_a_plugged_in_policy_decides_and_hears_of_every_request(
    mlp: Model, look_ahead: str
) -> None:
    """The replica asks the factory's policy, tells it of each arrival and answer, and
    its observer of each batch as the producer side forms it: 40 samples are two full
    batches and a flushed 8, a lone sample a flushed batch of 1. Results match numpy."""
    policies: list[Recording] = []

    def factory(replica: int) -> BatchPolicy:
        assert replica == 0
        policies.append(Recording())
        return policies[-1]

    # No spec batch timeout, and timeout_ns 0 (wait forever): only the policy can flush.
    config = model_runtime.ModelRunnerConfig(
        batching_dim=0, flush_on_waiting_outputs=True, max_look_ahead=look_ahead, timeout_ns=0
    )
    runner = model_runtime.ModelRunner(mlp, config=config, batch_policy=factory)
    try:
        for samples in (40, 1):
            x = rows(samples, 32, seed=samples)
            got = runner.executeAsync({"input": x}).result(WAIT_S)
            padded = np.concatenate([x, np.zeros((-samples % BATCH, 32), np.float32)])
            chunks = np.split(padded, len(padded) // BATCH)
            want = [reference("mlp", mlp, {"input": chunk}) for chunk in chunks]
            assert_matches(got, {k: np.concatenate([w[k] for w in want])[:samples] for k in got})
    finally:
        runner.close()
    (policy,) = policies
    assert policy.arrivals == policy.completions == [40, 1]
    assert policy.batches == [16, 16, 8, 1]
    assert any(policy.asked_idle)
