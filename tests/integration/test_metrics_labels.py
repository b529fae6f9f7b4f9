"""Per model and version, end to end: after traffic from the real Client, a real broker's
and a real worker's /metrics show every latency histogram (and the worker's batch
histogram) under ``model`` and ``version``, each counting what was sent."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ipuserve.client import Client
from ipuserve.runtime.popef import examples
from ipuserve.runtime.popef.reader import load_model
from tests.helpers import (
    Processes,
    runner_worker_argv,
    scrape,
    start_broker,
    start_worker,
    wait_until,
)

pytestmark = pytest.mark.slow

SIZES = (1, 3, 16, 2, 40, 1, 7, 5)  # samples per request: one job each, sent one by one


def test_broker_and_worker_histograms_count_each_model_version(
    processes: Processes, tmp_path: Path
) -> None:
    [path] = examples.mlp(batch_size=16, input_size=8, hidden_size=8).write(tmp_path / "m.popef")
    weights = examples.tensor_arrays(load_model([str(path)]))
    broker = start_broker(processes)
    options = ("--metrics-port", "0", "--metrics-host", "127.0.0.1")
    worker = start_worker(processes, broker, runner_worker_argv(str(path), args=options))
    worker_url = worker.wait_for(r"metrics on (http://127\.0\.0\.1:\d+/metrics)")[1]
    rng = np.random.default_rng(7)
    with Client(broker.frontend, timeout=60) as client:
        for samples in SIZES:
            x = rng.standard_normal((samples, 8)).astype(np.float32)
            got = client.infer("mlp", {"input": x})
            padded = np.concatenate([x, np.zeros((-samples % 16, 8), np.float32)])
            chunks = np.split(padded, len(padded) // 16)  # the compiled batch is 16
            for name, array in got.items():
                runs = [examples.reference("mlp", {"input": c}, weights)[name] for c in chunks]
                want = np.concatenate(runs)[:samples]
                np.testing.assert_allclose(array, want, rtol=1e-5, atol=1e-6)
    sent, mlp = len(SIZES), '{model="mlp",version="1"}'

    # the broker: each histogram counts every request once (the last observed just
    # after its reply left, on the broker's thread)
    def broker_counts() -> list[float]:
        page = scrape(broker.metrics_url)
        names = ("queue_seconds_count", "worker_seconds_count", "request_seconds_count",
                 "requests_total", "replies_total")  # fmt: skip
        return [page.get(f"ipuserve_broker_{name}{mlp}", 0.0) for name in names]

    wait_until(lambda: broker_counts() == [sent] * 5, timeout=30)
    page = scrape(broker.metrics_url)
    for histogram in ("queue", "worker", "request"):
        assert page[f'ipuserve_broker_{histogram}_seconds_bucket{{le="+Inf",{mlp[1:]}'] == sent
    # placed at admission, on a worker with room: no time queued, the same clock reading
    assert page[f"ipuserve_broker_queue_seconds_sum{mlp}"] >= 0
    for histogram in ("worker", "request"):
        assert page[f"ipuserve_broker_{histogram}_seconds_sum{mlp}"] > 0

    # the worker: every job (one a request here) in each latency histogram, and every
    # real sample in the batch histogram, all under the model and its version
    page = scrape(worker_url)
    assert page['ipuserve_worker_jobs_total{model="mlp",outcome="ok",version="1"}'] == sent
    for histogram in ("queue", "device", "job"):
        assert page[f"ipuserve_worker_{histogram}_seconds_count{mlp}"] == sent
        assert page[f'ipuserve_worker_{histogram}_seconds_bucket{{le="+Inf",{mlp[1:]}'] == sent
    assert page[f"ipuserve_worker_batch_samples_sum{mlp}"] == sum(SIZES)
    assert page[f"ipuserve_worker_batch_samples_count{mlp}"] >= sent  # 40 samples: 3 runs
    unlabelled = [key for key in page if key.startswith("ipuserve_worker_") and "_seconds" in key
                  and 'version="1"' not in key]  # fmt: skip
    assert unlabelled == []
