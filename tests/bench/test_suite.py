"""`ipuserve bench --suite fabric --quick`: it starts everything, reports, and cleans up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from ipuserve.bench.suite import SuiteConfig, time_scale_for, write_models
from ipuserve.face.cli import main
from ipuserve.runtime.popef.reader import load_model
from ipuserve.runtime.simulator import cost

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


def test_the_suites_time_scale_makes_the_mlp_take_its_device_time(tmp_path: Path) -> None:
    """bench may not import the runtime: it scales from `model inspect --json`, which must
    give the runtime's own answer (only the steps scale, not the launch)."""
    models = write_models(tmp_path, SuiteConfig())
    scale = time_scale_for(5e-3, models)
    assert scale == pytest.approx(cost.time_scale_for(5e-3, models["mlp_seconds"]))
    model = load_model([str(models["mlp"])])
    main = model.executable.program(model.metadata.programFlow().main()[0])
    assert cost.CostModel(cost.ipu_spec(2), time_scale=scale).program_seconds(main) == (
        pytest.approx(5e-3)
    )
