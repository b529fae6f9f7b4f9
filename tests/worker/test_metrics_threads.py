"""WorkerMetrics is updated from the socket thread and every replica's device thread."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import pytest

from ipuserve.worker.metrics import WorkerMetrics


@pytest.fixture
def frequent_thread_switches() -> Iterator[None]:
    """Switch threads every microsecond, so a racy read-modify-write shows up at once."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


@pytest.mark.usefixtures("frequent_thread_switches")
def test_no_update_is_lost_when_threads_finish_jobs_at_once() -> None:
    metrics, threads, jobs = WorkerMetrics("m"), 4, 20_000
    start = threading.Barrier(threads)

    def work() -> None:
        start.wait()
        for _ in range(jobs):
            metrics.submitted()
            metrics.finished("ok", 0.001, 1.0, 1.0)

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    assert metrics.value("ipuserve_worker_jobs_total", model="m", outcome="ok") == threads * jobs
    assert metrics.value("ipuserve_worker_in_flight", model="m", version="1") == 0
    assert metrics.value("ipuserve_worker_job_seconds_count", model="m") == threads * jobs
