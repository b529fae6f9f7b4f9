"""``ipuserve tools callbacks-benchmark``: callbacks counted, bytes adding up, devices freed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ipuserve.errors import DeviceUnavailableError
from ipuserve.progress import Progress
from ipuserve.runtime import DeviceManager, Session
from ipuserve.runtime.popef import examples
from ipuserve.runtime.tools.anchor_taps import connect_taps
from ipuserve.runtime.tools.callbacks_bench import CallbacksBenchConfig, run_callbacks_benchmark
from ipuserve.runtime.tools.stats import Budget

from .conftest import all_ipus_free, invoke, invoke_json, one_line_error


def by_name(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {anchor["name"]: anchor for anchor in report["anchors"]}


def assert_bytes_add_up(report: dict[str, Any]) -> None:
    for direction in ("input", "output"):
        moved = sum(
            a["bytes"] * a["calls"] for a in report["anchors"] if a["direction"] == direction
        )
        assert report["bytes"][direction] == moved
        assert report["callback_us"][direction]["count"] == sum(
            a["calls"] for a in report["anchors"] if a["direction"] == direction
        )
    assert report["bytes"]["total"] == report["bytes"]["input"] + report["bytes"]["output"]


@pytest.mark.parametrize("zero_copy", [False, True], ids=["copy", "zero-copy"])
def test_noop_moves_each_anchor_once_per_run(zero_copy: bool) -> None:
    config = CallbacksBenchConfig(
        elements=256, batch_size=2, zero_copy=zero_copy, budget=Budget(warmup=3, count=40)
    )
    report = run_callbacks_benchmark(config)
    assert report["runs"] == 40 and report["interrupted"] is False
    anchors = by_name(report)
    assert set(anchors) == {"input", "output"}
    for anchor in anchors.values():
        assert anchor["calls"] == 40  # warm-up runs are not counted
        assert anchor["bytes"] == 2 * 256 * 4
        assert anchor["shape"] == [2, 256]
    assert report["bytes"]["total"] == 2 * 40 * 2 * 256 * 4
    assert_bytes_add_up(report)
    assert report["run_us"]["count"] == 40
    assert report["zero_copy"] is zero_copy and report["zero_time_model"] is True
    assert report["throughput"]["runs_per_s"] > 0
    assert all_ipus_free()


def test_model_files_bind_weights_from_the_file_and_skip_unrun_anchors(simple_file: Path) -> None:
    report = run_callbacks_benchmark(
        CallbacksBenchConfig(popef=(str(simple_file),), budget=Budget(warmup=1, count=7))
    )
    anchors = by_name(report)
    assert "weights" not in anchors  # tensor data stays bound to the model file
    assert anchors["tensor_A"]["calls"] == anchors["tensor_B"]["calls"] == 7
    assert anchors["output"]["calls"] == 7
    assert anchors["run_count"]["calls"] == 0  # a save-program output: never run here
    assert anchors["tensor_A"]["bytes"] == 4 * 4 * 4
    assert_bytes_add_up(report)
    assert report["files"] == [str(simple_file)]


def test_conditional_model_counts_only_the_branch_that_ran(tmp_path: Path) -> None:
    path = tmp_path / "branches.popef"
    examples.branches().write(path)
    report = run_callbacks_benchmark(
        CallbacksBenchConfig(popef=(str(path),), budget=Budget(warmup=0, count=5))
    )
    anchors = by_name(report)
    # The selector input is zeros, so branch 0 runs every time.
    assert anchors["branch"]["calls"] == anchors["a_input"]["calls"] == 5
    assert anchors["a_output"]["calls"] == 5
    assert anchors["b_input"]["calls"] == anchors["b_output"]["calls"] == 0
    assert_bytes_add_up(report)


def test_ipu_model_needs_no_ipu_and_takes_no_simulated_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("IPUSERVE_SIM_TIME_SCALE", "0.25")
    holder = DeviceManager().getDevice(4)  # every IPU of the host is taken
    try:
        report = run_callbacks_benchmark(
            CallbacksBenchConfig(ipu_model=True, budget=Budget(warmup=0, count=3))
        )
    finally:
        holder.detach()
    assert report["ipu_model"] is True and report["device"].startswith("IPU Model")
    assert report["time_scale"] == 0.25
    assert report["effective_time_scale"] == 0.0


def test_time_scale_is_reported_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IPUSERVE_SIM_TIME_SCALE", "0.5")
    report = run_callbacks_benchmark(CallbacksBenchConfig(budget=Budget(warmup=0, count=2)))
    assert report["time_scale"] == 0.5 == report["effective_time_scale"]


def test_ctrl_c_stops_between_runs_and_releases_the_device() -> None:
    calls = []

    def interrupt_on_fifth(progress: Progress) -> None:
        calls.append(progress)
        if progress.phase == "measuring" and progress.done == 5:
            raise KeyboardInterrupt

    report = run_callbacks_benchmark(
        CallbacksBenchConfig(budget=Budget(warmup=2, count=10**9)), interrupt_on_fifth
    )
    assert report["interrupted"] is True and report["runs"] == 5
    assert [p.phase for p in calls[:2]] == ["warm-up", "warm-up"]
    assert all_ipus_free()


def test_taps_deliver_the_data_with_and_without_zero_copy() -> None:
    """The data path itself: a noop's output callback sees exactly what the input gave."""
    model = examples.build("noop", batch_size=3, elements=17)
    for zero_copy in (False, True):
        device = DeviceManager().createIpuModelDevice(model)
        try:
            session = Session(model)
            session.bindToDevice(device)
            taps = connect_taps(session, zero_copy=zero_copy)
            session.runMainPrograms()
            by_direction = {tap.direction: tap for tap in taps.taps}
            source, sink = by_direction["input"], by_direction["output"]
            np.testing.assert_array_equal(sink.buffer, source.buffer)
            assert sink.buffer is not source.buffer
            session.unloadFromDevice()
        finally:
            device.detach()


# -- the command ---------------------------------------------------------------------------


def test_cli_json_parses_and_adds_up() -> None:
    report = invoke_json("callbacks-benchmark", "--elements", "64", "--runs", "12", "--warmup", "0")
    assert report["tool"] == "callbacks-benchmark"
    assert report["runs"] == 12 and report["model"] == "noop"
    assert report["time_scale"] == 0.0  # the test fixture's IPUSERVE_SIM_TIME_SCALE
    assert_bytes_add_up(report)
    assert report["bytes"]["input"] == 12 * 64 * 4


def test_cli_table_names_device_time_scale_and_anchors(simple_file: Path) -> None:
    result = invoke("callbacks-benchmark", "--popef", str(simple_file), "--runs", "3")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "model simple" in out and "IPUSERVE_SIM_TIME_SCALE=0" in out
    assert "device 0" in out and "runs/s" in out and "GB/s" in out
    assert "tensor_A" in out and "run_count" in out


def test_cli_refuses_noop_options_with_model_files(simple_file: Path) -> None:
    result = invoke("callbacks-benchmark", "--popef", str(simple_file), "--elements", "8")
    assert result.exit_code == 2
    assert "--elements describe the generated noop model" in result.stderr


def test_cli_corrupt_model_file_is_one_line(tmp_path: Path) -> None:
    broken = tmp_path / "broken.popef"
    broken.write_bytes(b"not a model at all")
    error = one_line_error(invoke("callbacks-benchmark", "--popef", str(broken)))
    assert str(broken) in error


@pytest.fixture
def busy_host() -> Iterator[None]:
    holder = DeviceManager().getDevice(4)
    yield
    holder.detach()


@pytest.mark.usefixtures("busy_host")
def test_cli_no_free_ipu_is_one_line() -> None:
    error = one_line_error(invoke("callbacks-benchmark", "--runs", "1"))
    assert "no free" in error
    with pytest.raises(DeviceUnavailableError):
        run_callbacks_benchmark(CallbacksBenchConfig(budget=Budget(count=1)))
