"""A repository worker's /metrics, from real processes: the version it loaded is
reported loaded, with its load time and the IPUs left free, and its requests are
counted under that version, by the worker's histograms and by the broker's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.helpers import Processes, RawClient, scrape, start_broker, wait_until
from tests.worker.test_host import (
    HOST,
    Versions,
    host_argv,
    mlp_inputs,
    repo,  # noqa: F401  (a fixture)
)

pytestmark = pytest.mark.slow

ROWS = (1, 3, 16, 20, 2)


def test_a_repository_worker_reports_its_load_and_labels_its_requests_with_the_version(
    processes: Processes,
    repo: Path,  # noqa: F811
) -> None:
    broker = start_broker(processes)
    args = ("--load", "mlp:2", "--metrics-port", "0")
    host = processes.start("host", host_argv(repo, broker.backend, args=args))
    host.wait_for(rf"worker {HOST}/mlp/2 registered with \S+ \(epoch {broker.epoch}")
    url = host.wait_for(r"metrics on (http://127\.0\.0\.1:\d+/metrics)")[1]
    v2 = '{model="mlp",version="2"}'
    wait_until(lambda: scrape(url).get(f"ipuserve_model_loaded{v2}") == 1)
    versions = Versions(repo)
    rng = np.random.default_rng(3)
    with RawClient(broker.frontend) as client:
        for rows in ROWS:
            inputs = mlp_inputs(rng, rows)
            assert versions.which(inputs, client.call("mlp", inputs)) == "2"

    page = scrape(url)
    assert page["ipuserve_worker_free_ipus"] == 3  # of 4: one replica on one IPU
    assert page[f"ipuserve_model_load_seconds_count{v2}"] == 1
    assert page[f"ipuserve_model_load_seconds_sum{v2}"] > 0
    assert 'ipuserve_model_loaded{model="mlp",version="1"}' not in page  # never loaded
    ok = 'ipuserve_worker_jobs_total{model="mlp",outcome="ok",version="2"}'
    assert page[ok] == len(ROWS)
    for histogram in ("queue", "device", "job"):
        assert page[f"ipuserve_worker_{histogram}_seconds_count{v2}"] == len(ROWS)
    assert page[f"ipuserve_worker_batch_samples_sum{v2}"] == sum(ROWS)
    assert page['ipuserve_runtime_requests_total{model="mlp",replica="0",version="2"}'] == len(ROWS)

    def broker_requests() -> float:
        return scrape(broker.metrics_url).get(f"ipuserve_broker_request_seconds_count{v2}", 0)

    wait_until(lambda: broker_requests() == len(ROWS))  # the last one after its reply left
    host.terminate()
    assert host.wait() == 0
