"""A worker's /metrics: its jobs and the runtime's monitoring statistics, from a real process."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ipuserve.client import Client
from ipuserve.errors import InvalidInputError
from ipuserve.runtime.popef import examples
from tests.helpers import Processes, runner_worker_argv, scrape, start_broker, start_worker

pytestmark = pytest.mark.slow


def test_worker_metrics_count_jobs_and_runtime_batches(
    processes: Processes, tmp_path: Path
) -> None:
    [path] = examples.mlp(batch_size=16, input_size=8, hidden_size=8).write(tmp_path / "m.popef")
    broker = start_broker(processes)
    argv = runner_worker_argv(
        str(path), args=("--metrics-port", "0", "--metrics-host", "127.0.0.1", "--replicas", "2")
    )
    worker = start_worker(processes, broker, argv)
    found = worker.wait_for(r"metrics on (http://127\.0\.0\.1:\d+/metrics)")
    with Client(broker.frontend, timeout=30) as client:
        for samples in (1, 5, 16, 40):
            client.infer("mlp", {"input": np.ones((samples, 8), np.float32)})
        with pytest.raises(InvalidInputError, match="must be float32, got float64"):
            client.infer("mlp", {"input": np.ones((2, 8), np.float64)})  # stopped at the broker
    metrics = scrape(found[1])
    mlp = '{model="mlp",version="1"}'
    assert metrics['ipuserve_worker_jobs_total{model="mlp",outcome="ok",version="1"}'] == 4
    assert metrics[f"ipuserve_worker_in_flight{mlp}"] == 0
    assert metrics[f"ipuserve_worker_job_seconds_count{mlp}"] == 4
    assert metrics[f"ipuserve_worker_device_seconds_count{mlp}"] == 4
    # two replicas: each family's samples stay together (scrape checks the format)
    replicas = ('{model="mlp",replica="0",version="1"}', '{model="mlp",replica="1",version="1"}')
    assert sum(metrics[f"ipuserve_runtime_requests_total{r}"] for r in replicas) == 4
    assert sum(metrics[f"ipuserve_runtime_batches_total{r}"] for r in replicas) >= 5  # 1+5+16+40
    phases = [f'{{model="mlp",phase="computation",replica="{r}",version="1"}}' for r in (0, 1)]
    assert max(metrics.get(f"ipuserve_runtime_phase_mean_microseconds{p}", 0) for p in phases) > 0
