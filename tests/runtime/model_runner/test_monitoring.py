"""Monitoring statistics: the spec's key names, microseconds, per replica."""

from __future__ import annotations

import time

import pytest

import ipuserve.runtime as model_runtime
from ipuserve.errors import ConfigError
from ipuserve.runtime.popef import examples
from ipuserve.runtime.popef.types import Model
from ipuserve.runtime.simulator.cost import CostModel, ipu_spec

from .conftest import assert_matches, reference, rows

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
    with pytest.raises(ConfigError, match="quantile"):
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


DEVICE_S = 0.2


def test_durations_are_microseconds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bounds that hold whatever the machine's speed, and only in microseconds: a request
    lasts no longer than the call around it, and its computation phase holds most of the
    simulated device time between reading its input and writing its last output: 200 ms.
    Not all of it: the simulated device counts from its launch, so a device thread the
    host's scheduler made late to read inputs that were ready has already spent part of
    the run (on a loaded machine 2 ms of 2 showed as 1.2). Half of 200 ms leaves such
    lateness 100 ms, and still tells microseconds from milli- or nanoseconds."""
    model = examples.build("mlp", batch_size=16)
    steps = model.executable.program(model.metadata.programFlow().main()[0]).steps
    last_read = max(i for i, step in enumerate(steps) if step.op == "stream_in")
    after_read_s = sum(CostModel(ipu_spec(2)).step_seconds(s) for s in steps[last_read + 1 :])
    scale = DEVICE_S / after_read_s  # the device computes for DEVICE_S after the read
    monkeypatch.setenv("IPUSERVE_SIM_TIME_SCALE", repr(scale))
    inputs = {"input": rows(16, 784, 0)}
    with model_runtime.ModelRunner(model) as runner:
        called = time.perf_counter()
        got = runner.execute(inputs)
        call_us = (time.perf_counter() - called) * 1e6
        trace = runner.getTimeTrace({})
        mean = runner.getMonitoringStatisticsMean({})
    assert_matches(got, reference("mlp", model, inputs))
    assert trace["computation_duration_us"] >= DEVICE_S * 1e6 / 2
    assert trace["computation_duration_us"] <= trace["request_duration_us"] <= call_us
    for phase in PHASES:  # one request: its trace is the mean
        assert mean[f"{phase}_monitoring_statistics_mean_us"] == trace[f"{phase}_duration_us"]
