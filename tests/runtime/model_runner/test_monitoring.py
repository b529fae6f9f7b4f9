"""Monitoring statistics: the spec's key names, microseconds, per replica."""

from __future__ import annotations

import pytest

from ipuserve.runtime.popef.types import Model

from .conftest import rows

PHASES = ("request", "read_preparation", "read_queue", "computation")


def run_some(runner, n: int, replica_id: int = 0) -> None:
    for i in range(n):
        runner.execute(
            {"tensor_A": rows(2, 4, i), "tensor_B": rows(2, 4, i + 1)}, replica_id=replica_id
        )


def test_keys_and_units(make_runner, simple: Model) -> None:
    runner = make_runner(simple, replication_factor=2)
    assert runner.getMonitoringStatisticsMean({}) == {}  # nothing recorded yet
    run_some(runner, 10)
    trace = runner.getTimeTrace({})
    assert set(trace) == {f"{p}_duration_us" for p in PHASES}
    assert trace["request_duration_us"] >= trace["computation_duration_us"] >= 0
    assert trace["request_duration_us"] >= trace["read_queue_duration_us"] >= 0
    p99 = runner.getMonitoringStatisticsPercentile({}, 0.999)
    assert set(p99) == {f"{p}_monitoring_statistics_percentile_us" for p in PHASES}
    mean = runner.getMonitoringStatisticsMean({})
    assert set(mean) == {f"{p}_monitoring_statistics_mean_us" for p in PHASES}
    assert 0 < mean["request_monitoring_statistics_mean_us"] < 60e6  # microseconds, not seconds
    counts = runner.getMonitoringStatisticsTotalCount({})
    assert {f"{p}_monitoring_statistics_count" for p in PHASES} <= set(counts)
    assert counts["request_monitoring_statistics_count"] == 10
    assert counts["batches_monitoring_statistics_count"] >= 10


def test_percentiles_are_ordered(make_runner, simple: Model) -> None:
    runner = make_runner(simple)
    run_some(runner, 30)
    p10 = runner.getMonitoringStatisticsPercentile({}, 0.1)
    p90 = runner.getMonitoringStatisticsPercentile({})  # the spec's default quantile, 0.9
    for phase in PHASES:
        key = f"{phase}_monitoring_statistics_percentile_us"
        assert p10[key] <= p90[key]
    with pytest.raises(ValueError, match="quantile"):
        runner.getMonitoringStatisticsPercentile({}, 1.5)


def test_statistics_are_per_replica(make_runner, simple: Model) -> None:
    runner = make_runner(simple, replication_factor=2)
    run_some(runner, 3, replica_id=1)
    assert (
        runner.getMonitoringStatisticsTotalCount({}, replica_id=0)[
            "request_monitoring_statistics_count"
        ]
        == 0
    )
    assert (
        runner.getMonitoringStatisticsTotalCount({}, replica_id=1)[
            "request_monitoring_statistics_count"
        ]
        == 3
    )


def test_passed_dict_is_filled_in_place(make_runner, simple: Model) -> None:
    runner = make_runner(simple)
    run_some(runner, 2)
    info: dict[str, float] = {"mine": 1.0}
    runner.getMonitoringStatisticsMean(info)
    assert info["mine"] == 1.0 and "request_monitoring_statistics_mean_us" in info
