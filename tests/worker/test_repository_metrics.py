"""What a worker hosting several model versions shows on its page, served over real HTTP:
the job families once, a series per version; and the repository's gauges and
histograms as its model host reports loads and unloads (RepositoryMetrics)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ipuserve.metrics import MetricsServer
from ipuserve.worker.metrics import CreditMetrics, RepositoryMetrics, WorkerFamilies, WorkerMetrics
from tests.helpers import scrape


@pytest.fixture
def parts() -> tuple[WorkerFamilies, RepositoryMetrics, CreditMetrics]:
    return WorkerFamilies(), RepositoryMetrics(), CreditMetrics(8)


@pytest.fixture
def url(parts: tuple[WorkerFamilies, RepositoryMetrics, CreditMetrics]) -> Iterator[str]:
    server = MetricsServer([part.registry for part in parts], "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.port}/metrics"
    finally:
        server.close()


def test_two_versions_of_a_model_share_the_families_with_a_series_each(
    parts: tuple[WorkerFamilies, RepositoryMetrics, CreditMetrics], url: str
) -> None:
    families = parts[0]
    v1 = WorkerMetrics("mlp", "adaptive", "1", families)
    v2 = WorkerMetrics("mlp", "adaptive", "2", families)
    for metrics, jobs in ((v1, 3), (v2, 5)):
        for _ in range(jobs):
            metrics.submitted()
            metrics.finished("ok", 0.002, 150.0, 900.0)
            metrics.batch_closed(4, 0.0003)
    v2.submitted()
    v2.finished("DEADLINE_EXCEEDED", 0.5)
    v2.refused("ghost", "UNKNOWN_MODEL")  # a made-up name: no series of its own
    page = scrape(url)  # checks each family appears once
    for version, jobs in (("1", 3), ("2", 5)):
        mv = f'model="mlp",version="{version}"'
        ok = f'model="mlp",outcome="ok",version="{version}"'
        assert page[f"ipuserve_worker_jobs_total{{{ok}}}"] == jobs
        assert page[f"ipuserve_worker_device_seconds_count{{{mv}}}"] == jobs
        assert page[f"ipuserve_worker_batch_samples_sum{{{mv}}}"] == 4 * jobs
        assert page[f"ipuserve_worker_in_flight{{{mv}}}"] == 0
    assert page['ipuserve_worker_job_seconds_count{model="mlp",version="2"}'] == 6
    failed = 'ipuserve_worker_jobs_total{model="mlp",outcome="DEADLINE_EXCEEDED",version="2"}'
    assert page[failed] == 1
    assert page['ipuserve_worker_jobs_total{model="",outcome="UNKNOWN_MODEL",version=""}'] == 1
    assert not any('"ghost"' in key for key in page)
    assert page["ipuserve_worker_capacity"] == 8  # another registry, the same page


def test_the_repository_reports_loads_unloads_and_free_ipus(
    parts: tuple[WorkerFamilies, RepositoryMetrics, CreditMetrics], url: str
) -> None:
    repository = parts[1]
    repository.free_ipus(4)
    repository.loaded("mlp", "1", 0.3)
    repository.loaded("mlp", "2", 1.7)
    repository.free_ipus(2)
    repository.unloaded("mlp", "1", 0.04)
    repository.load_failed("big", "1")
    page = scrape(url)
    assert page['ipuserve_model_loaded{model="mlp",version="1"}'] == 0
    assert page['ipuserve_model_loaded{model="mlp",version="2"}'] == 1
    assert page["ipuserve_worker_free_ipus"] == 2
    assert page['ipuserve_model_load_seconds_count{model="mlp",version="2"}'] == 1
    assert page['ipuserve_model_load_seconds_bucket{le="1.0",model="mlp",version="2"}'] == 0
    assert page['ipuserve_model_load_seconds_bucket{le="2.5",model="mlp",version="2"}'] == 1
    assert page['ipuserve_model_unload_seconds_sum{model="mlp",version="1"}'] == 0.04
    assert page['ipuserve_model_load_failures_total{model="big",version="1"}'] == 1
    assert 'ipuserve_model_loaded{model="big",version="1"}' not in page  # never loaded
