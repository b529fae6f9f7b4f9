"""`ipuserve bench --suite fabric --quick`: it starts everything, reports, and cleans up."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from ipuserve.face.cli import main

pytestmark = pytest.mark.slow


def test_a_quick_suite_run_reports_every_comparison_with_same_run_ratios() -> None:
    result = CliRunner().invoke(
        main, ["bench", "--suite", "fabric", "--quick", "--runs", "1", "--json"],
        catch_exceptions=False,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    results = json.loads(result.stdout)
    names = [row["name"] for row in results["comparisons"]]
    assert names == [
        "latency p50", "latency p99", "throughput, 64 in flight",
        "MLP saturation vs ideal", "goodput, 4 MiB tensors",
    ]  # fmt: skip
    for row in results["comparisons"] + results["diagnostics"]:
        [run] = row["per_run"]
        assert run["ratio"] == pytest.approx(run["ipuserve"] / run["baseline"], abs=1e-3)
        assert row["met"] in (True, False)
    [detail] = results["detail"]
    for case in ("latency", "throughput", "goodput", "mlp"):
        measured = detail[f"fabric_{case}"]
        assert measured["ok"] + sum(measured["errors"].values()) == measured["requests"] > 0
        assert measured["errors"] == {}
    assert results["mlp"]["ideal_samples_per_s"] == pytest.approx(2 * 16 / 0.005)
    stages = results["breakdown"]
    assert [stage["name"].split()[0] for stage in stages] == ["pyzmq", "+", "+", "+"]
    assert stages[0]["latency_vs_relay"] == stages[0]["req_per_s_vs_relay"] == 1.0
    assert all(stage["req_per_s"] > 0 for stage in stages)
    for stage in stages:  # every process on each path was seen working (Linux /proc)
        for case in ("latency", "throughput"):
            cpu = stage["cpu_us_per_request"][case]
            assert sorted(cpu) == ["broker", "client", "worker"]
            assert all(value > 0 for value in cpu.values()), (stage["name"], case, cpu)
    for case in ("latency", "throughput"):  # the runtime-free echo worker answered
        assert detail[f"echo_{case}"]["requests"] > 0
