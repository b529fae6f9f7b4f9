"""``ipuserve tools queues-benchmark``: well-formed, self-consistent reports in both modes.

No timing is asserted -- only that the counts add up: every item started came out,
the device ran exactly the batches the samples (plus the flush padding) fill, and
bytes are items times the item size.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import pytest

from ipuserve.errors import ConfigError
from ipuserve.progress import Progress
from ipuserve.runtime.tools.queues_bench import run_queues_benchmark
from ipuserve.runtime.tools.queues_config import QueuesBenchConfig
from ipuserve.runtime.tools.stats import Budget

from .conftest import invoke, invoke_json, one_line_error


def assert_consistent(report: dict[str, Any], config: QueuesBenchConfig) -> None:
    """The invariants of a finished (not interrupted) run."""
    assert report["interrupted"] is False
    warmup, items = config.budget.warmup, report["items"]
    assert report["items_started"] == report["items_completed"] == warmup + items
    assert report["warmup_items"] == warmup
    assert report["item_bytes"] == config.request_size * config.sample_bytes()
    assert report["samples"] == items * config.request_size
    assert report["bytes"] == items * report["item_bytes"]
    assert report["latency_us"]["count"] == items
    assert report["throughput"]["items_per_s"] > 0
    latency = report["latency_us"]
    assert 0 < latency["p50"] <= latency["p90"] <= latency["p99"] <= latency["max"]


@pytest.mark.parametrize(
    ("batch", "request_size"),
    [(8, 1), (8, 3), (8, 8), (4, 10), (1, 1)],
    ids=["packing", "items-across-batches", "one-item-per-batch", "item-spans-runs", "batch-1"],
)
def test_queues_mode_accounts_for_every_sample(batch: int, request_size: int) -> None:
    config = QueuesBenchConfig(
        sample_shape=(3, 5),
        batch=batch,
        request_size=request_size,
        budget=Budget(warmup=7, count=101),
    )
    report = run_queues_benchmark(config)
    assert_consistent(report, config)
    enqueued = report["items_started"] * request_size
    assert report["padding_samples"] == -enqueued % batch
    assert report["device_runs"] == math.ceil(enqueued / batch)
    assert report["device_runs"] * batch == enqueued + report["padding_samples"]


def test_ring_mode_streams_every_item_by_reference() -> None:
    config = QueuesBenchConfig(mode="ring", request_size=4, ring_size=3, budget=Budget(count=500))
    report = run_queues_benchmark(config)
    assert_consistent(report, config)
    assert report["payload_bytes"] == report["bytes"]
    assert "device_runs" not in report


@pytest.mark.parametrize("dtype", ["float16", "int8", "bool", "uint64"])
def test_item_size_follows_the_dtype(dtype: str) -> None:
    config = QueuesBenchConfig(
        sample_shape=(10,), dtype=dtype, batch=2, request_size=2, budget=Budget(count=20)
    )
    report = run_queues_benchmark(config)
    assert_consistent(report, config)
    assert report["item_bytes"] == 2 * 10 * config.numpy_dtype().itemsize


def test_duration_budget_ends_the_run() -> None:
    config = QueuesBenchConfig(budget=Budget(warmup=0, duration_s=0.05))
    report = run_queues_benchmark(config)
    assert_consistent(report, config)
    assert report["items"] >= 1


def test_a_ring_too_small_to_hold_a_batch_is_refused_not_deadlocked() -> None:
    with pytest.raises(ConfigError, match="use a ring of >= 9 slots"):
        QueuesBenchConfig(batch=8, request_size=1, ring_size=8)
    QueuesBenchConfig(batch=8, request_size=1, ring_size=9)  # the smallest that works
    QueuesBenchConfig(mode="ring", batch=8, request_size=1, ring_size=1)


def test_the_smallest_ring_allowed_does_not_deadlock() -> None:
    config = QueuesBenchConfig(batch=6, request_size=4, ring_size=3, budget=Budget(count=200))
    assert config.min_slots() == 3
    assert_consistent(run_queues_benchmark(config), config)


def test_ctrl_c_stops_both_threads_and_reports_what_completed() -> None:
    config = QueuesBenchConfig(budget=Budget(warmup=0, duration_s=3600.0))

    def interrupt(progress: Progress) -> None:
        raise KeyboardInterrupt

    report = run_queues_benchmark(config, interrupt)
    assert report["interrupted"] is True
    assert report["items_completed"] <= report["items_started"]
    assert report["bytes"] == report["items"] * report["item_bytes"]
    alive = [t.name for t in threading.enumerate() if t.name.startswith("bench-")]
    assert alive == []


# -- the command ---------------------------------------------------------------------------


def test_cli_json_is_the_report() -> None:
    report = invoke_json(
        "queues-benchmark", "--shape", "2,3", "--dtype", "int16", "--batch", "4",
        "--request-size", "3", "--items", "50", "--warmup", "5",
    )  # fmt: skip
    assert report["tool"] == "queues-benchmark"
    assert report["config"] == {
        "mode": "queues",
        "sample_shape": [2, 3],
        "dtype": "int16",
        "batch": 4,
        "request_size": 3,
        "ring_size": 8,
        "warmup_items": 5,
        "items": 50,
        "duration_s": None,
    }
    assert report["items"] == 50 and report["samples"] == 150
    assert report["bytes"] == 50 * 3 * 2 * 3 * 2


def test_cli_table_shows_the_measured_figures() -> None:
    result = invoke("queues-benchmark", "--mode", "ring", "--items", "200", "--warmup", "0")
    assert result.exit_code == 0, result.output
    assert "mode ring" in result.stdout
    assert "measured           200 items  200 samples  800.0 KiB" in result.stdout
    for label in ("throughput", "items/s", "GB/s", "p50", "p90", "p99", "max"):
        assert label in result.stdout


def test_cli_refuses_a_ring_that_would_deadlock_in_one_line() -> None:
    error = one_line_error(invoke("queues-benchmark", "--batch", "16", "--ring-size", "4"))
    assert "ring of >= 17 slots" in error


@pytest.mark.parametrize("shape", ["3,a", ",", "0,4"])
def test_cli_refuses_a_bad_shape(shape: str) -> None:
    result = invoke("queues-benchmark", "--shape", shape, "--items", "1")
    assert result.exit_code in (1, 2), result.output
    assert "Traceback" not in result.output
    assert "--shape" in result.stderr or "dimensions must be >= 1" in result.stderr
