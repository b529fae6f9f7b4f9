"""How big a group job may be: one batch, or more while the device time is small,
within a ceiling; and the one rule on which groups may exist, which the client, the
broker and the worker share (``ipuserve.grouping``)."""

from __future__ import annotations

from ipuserve import protocol as wire
from ipuserve.grouping import (
    DEVICE_BUDGET_US,
    MAX_GROUP_SAMPLES,
    GroupSizer,
    group_ceiling,
    group_problem,
    members_per_group,
)

X = wire.TensorSpec("x", "float32", (16, 8))
MLP = wire.ModelSpec("mlp", (X,), (X,), batch_size=16, batching_dim=0)


def test_until_a_model_reports_device_time_a_job_holds_one_batch() -> None:
    sizer = GroupSizer()
    assert sizer.members_per_job(MLP, member_samples=1) == 16
    assert sizer.members_per_job(MLP, member_samples=4) == 4
    assert sizer.members_per_job(MLP, member_samples=16) == 1
    assert sizer.members_per_job(MLP, member_samples=40) == 1  # never below one request


def test_a_cheap_device_lets_a_job_hold_the_budget_of_device_time() -> None:
    sizer = GroupSizer()
    sizer.observe("mlp", device_us=16.0, samples=16)  # 1 us per sample
    assert sizer.members_per_job(MLP, member_samples=1) == int(DEVICE_BUDGET_US)
    assert sizer.members_per_job(MLP, member_samples=4) == int(DEVICE_BUDGET_US / 4)


def test_an_expensive_device_keeps_jobs_at_one_batch() -> None:
    sizer = GroupSizer()
    sizer.observe("mlp", device_us=5000.0, samples=16)  # 5 ms per batch
    assert sizer.members_per_job(MLP, member_samples=16) == 1
    assert sizer.members_per_job(MLP, member_samples=1) == 16


def test_the_estimate_follows_the_device_as_a_moving_average() -> None:
    sizer = GroupSizer()
    sizer.observe("mlp", device_us=16.0, samples=16)
    for _ in range(40):
        sizer.observe("mlp", device_us=8000.0, samples=16)  # the model got slow
    assert sizer.members_per_job(MLP, member_samples=1) == 16
    sizer.observe("mlp", device_us=-1.0, samples=16)  # nonsense is ignored
    sizer.observe("mlp", device_us=10.0, samples=0)
    assert sizer.members_per_job(MLP, member_samples=1) == 16


def test_a_requests_samples_are_its_size_along_the_batching_dim() -> None:
    assert MLP.samples([(3, 8)]) == 3
    assert MLP.samples([(), (5, 8)]) == 5  # the first tensor that has the dimension
    assert MLP.samples([()]) == 16  # none has it: the compiled batch
    fixed = wire.ModelSpec("f", (X,), (X,), batch_size=16, batching_dim=None)
    assert fixed.samples([(3, 8)]) == 16


def test_samples_per_job_is_one_batch_for_a_slow_model_and_more_for_a_fast_one() -> None:
    """What a worker merges into one runtime request, by the same rule as groups."""
    sizer = GroupSizer()
    assert sizer.samples_per_job(MLP) == MLP.batch_size  # nothing known yet
    sizer.observe(MLP.name, device_us=200_000.0, samples=8)  # 25 ms a sample
    assert sizer.samples_per_job(MLP) == MLP.batch_size
    fast = GroupSizer()
    fast.observe(MLP.name, device_us=8.0, samples=8)  # 1 us a sample
    assert fast.samples_per_job(MLP) == int(DEVICE_BUDGET_US)


FIXED = wire.ModelSpec("fixed", (X,), (X,), batch_size=16, batching_dim=None)


def test_a_single_request_is_never_a_group_problem() -> None:
    assert group_problem(FIXED, members=1, member_samples=16) is None
    assert group_problem(MLP, members=1, member_samples=10 * MAX_GROUP_SAMPLES) is None


def test_a_model_without_its_batching_dim_on_every_tensor_takes_no_group() -> None:
    assert group_ceiling(FIXED) == 0
    assert group_problem(FIXED, members=2, member_samples=1) == (
        "model 'fixed' cannot take a group of requests: not every tensor has its "
        "batching dimension (None)"
    )
    assert members_per_group(FIXED, member_samples=1, job_samples=64) == 1


def test_a_group_holds_at_most_the_ceiling_of_samples() -> None:
    ceiling = group_ceiling(MLP)
    assert ceiling == MAX_GROUP_SAMPLES
    assert group_problem(MLP, members=ceiling // 4, member_samples=4) is None
    problem = group_problem(MLP, members=ceiling // 4 + 1, member_samples=4)
    assert problem is not None and "takes at most 4096 in one group" in problem
    big = wire.ModelSpec("big", (X,), (X,), batch_size=2 * MAX_GROUP_SAMPLES, batching_dim=0)
    assert group_ceiling(big) == 2 * MAX_GROUP_SAMPLES  # one compiled batch, at least


def test_a_client_groups_what_the_broker_listed_and_never_past_the_ceiling() -> None:
    assert members_per_group(MLP, member_samples=1, job_samples=16) == 16
    assert members_per_group(MLP, member_samples=4, job_samples=16) == 4
    assert members_per_group(MLP, member_samples=40, job_samples=16) == 1
    assert members_per_group(MLP, member_samples=1, job_samples=0) == 1  # not listed
    # a listing past the ceiling (another broker's) still gives groups the broker takes
    most = members_per_group(MLP, member_samples=8, job_samples=10 * MAX_GROUP_SAMPLES)
    assert most == MAX_GROUP_SAMPLES // 8
    assert group_problem(MLP, most, member_samples=8) is None
    # and never more ids than one REQUESTS row may list
    assert members_per_group(MLP, 1, MAX_GROUP_SAMPLES) == wire.DEFAULT_LIMITS.max_batch


def test_the_sizers_advice_stays_within_the_ceiling() -> None:
    """A client may group by an older listing: every listing is one the broker takes."""
    sizer = GroupSizer()
    sizer.observe("mlp", device_us=0.0, samples=16)  # free, as far as it can tell
    assert sizer.samples_per_job(MLP) == MAX_GROUP_SAMPLES
    assert sizer.members_per_job(MLP, member_samples=3) == MAX_GROUP_SAMPLES // 3
