"""RunnerBackend in-process: each job is one runtime request, checked against numpy."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ipuserve.errors import IpuserveError
from ipuserve.runtime.popef import examples
from ipuserve.worker import runner_backend
from ipuserve.worker.backend import WorkItem, WorkResult
from ipuserve.worker.runner_backend import RunnerBackend
from tests.helpers import time_scale_for_run, write_example

Array = np.ndarray[Any, Any]


class Outcomes:
    """``done`` for the backend: collects each job's outcome; :meth:`wait` for all."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.got: dict[bytes, WorkResult | IpuserveError] = {}
        self._lock = threading.Lock()
        self._all = threading.Event()

    def __call__(self, job: WorkItem, outcome: WorkResult | IpuserveError) -> None:
        with self._lock:
            assert job.job_id not in self.got, "answered twice"
            self.got[job.job_id] = outcome
            if len(self.got) == self.expected:
                self._all.set()

    def wait(self) -> dict[bytes, WorkResult | IpuserveError]:
        assert self._all.wait(30), f"{len(self.got)} of {self.expected} jobs answered"
        return self.got


@pytest.fixture(params=[0, 1], ids=["batch-dim-0", "batch-dim-1"])
def simple(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[RunnerBackend, int]]:
    dim = int(request.param)
    path = write_example(
        tmp_path / "simple.popef", "simple", "--batch-size", "4", "--batch-dim", str(dim)
    )
    backend = RunnerBackend([path], batching_dim=dim)
    check_against_reference(backend, jobs_of([1], dim, seed=9), dim)  # its device time known
    yield backend, dim
    backend.close()


@pytest.fixture
def cold(tmp_path: Path) -> Iterator[RunnerBackend]:
    """A backend that has run nothing yet: it does not know its device time."""
    backend = RunnerBackend(
        [write_example(tmp_path / "simple.popef", "simple", "--batch-size", "4")]
    )
    yield backend
    backend.close()


def jobs_of(rows: list[int], dim: int, seed: int = 0) -> list[WorkItem]:
    rng = np.random.default_rng(seed)
    jobs = []
    for i, n in enumerate(rows):
        shape = (n, 4) if dim == 0 else (4, n)
        inputs = {
            name: rng.standard_normal(shape).astype(np.float32) for name in ("tensor_A", "tensor_B")
        }
        jobs.append(WorkItem(b"job%d" % i, "simple", inputs, samples=n))
    return jobs


def check_against_reference(backend: RunnerBackend, jobs: list[WorkItem], dim: int) -> None:
    done = Outcomes(len(jobs))
    assert backend.submit_all(jobs, done) == []
    got = done.wait()
    data = examples.tensor_arrays(backend.runner.model)
    for job in jobs:
        outcome = got[job.job_id]
        assert isinstance(outcome, WorkResult), outcome
        want = examples.reference("simple", job.inputs, data, batch_dim=dim)["output"]
        assert outcome.outputs["output"].shape == want.shape
        np.testing.assert_allclose(outcome.outputs["output"], want, rtol=1e-5, atol=1e-6)


def runtime_requests(backend: RunnerBackend, warm_up: int = 1) -> int:
    """Runtime requests since the fixture's warm-up run."""
    counts = backend.runner.getMonitoringStatisticsTotalCount({}, replica_id=0)
    return int(counts["request_monitoring_statistics_count"]) - warm_up


def test_each_job_is_one_runtime_request_and_gets_its_own_rows(
    simple: tuple[RunnerBackend, int],
) -> None:
    """A client's group arrives as one job and stays one request; jobs that start
    together are not merged again (the runtime's queues pack them into one batch)."""
    backend, dim = simple
    jobs = jobs_of([1, 2, 1, 3], dim)
    check_against_reference(backend, jobs, dim)
    assert runtime_requests(backend) == len(jobs)


def test_a_closed_backend_refuses_every_job_it_is_handed(
    simple: tuple[RunnerBackend, int],
) -> None:
    backend, dim = simple
    backend.close()
    jobs = jobs_of([1, 1, 2], dim)
    done = Outcomes(len(jobs))
    refused = backend.submit_all(jobs, done)
    assert [job.job_id for job, _error in refused] == [job.job_id for job in jobs]
    assert {error.code for _job, error in refused} == {"UNAVAILABLE"}
    assert done.got == {}  # refused at once: never answered through done


def _prefetch_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.endswith("-prefetch")}


@pytest.mark.parametrize(("look_ahead", "prefetches"), [("unlimited", True), ("0", False)])
def test_look_ahead_0_runs_without_the_prefetch_thread_and_gives_the_same_results(
    tmp_path: Path, look_ahead: str, prefetches: bool
) -> None:
    """--look-ahead 0: the device thread packs its own inputs, one hand-off fewer per
    request; partial batches must still be flushed (eager batching) and rows kept apart."""
    path = write_example(tmp_path / "simple.popef", "simple", "--batch-size", "4")
    before = _prefetch_threads()
    backend = RunnerBackend([path], look_ahead=look_ahead)
    try:
        assert backend.runner.config().max_look_ahead == look_ahead
        assert bool(_prefetch_threads() - before) is prefetches
        for seed, rows in enumerate(([1], [3, 2], [4], [1, 1, 1])):
            check_against_reference(backend, jobs_of(rows, 0, seed=seed), 0)
    finally:
        backend.close()


def test_a_busy_runner_takes_only_a_few_jobs_ahead_so_the_rest_can_expire_in_the_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Jobs in the runtime's queues run however late; the worker keeps the rest, where an
    expired job is answered DEADLINE_EXCEEDED. The runner once took its whole credit (63
    jobs of a whole batch each): 295 of 300 requests expired at the client while the
    worker ran every one of them and counted it 'ok'."""
    path = write_example(tmp_path / "simple.popef", "simple", "--batch-size", "4")
    monkeypatch.setenv("IPUSERVE_SIM_TIME_SCALE", time_scale_for_run(path, 2.0))  # a batch
    backend = RunnerBackend([path])
    jobs = jobs_of([4] * 8 + [1], 0)
    done = Outcomes(runner_backend.AHEAD_JOBS)
    try:
        assert backend.room_for(jobs) == runner_backend.AHEAD_JOBS  # one batch per job
        assert backend.submit_all(jobs[: runner_backend.AHEAD_JOBS], done) == []
        # nothing can have finished: each batch takes 2 s of simulated device time
        assert backend.room_for(jobs[runner_backend.AHEAD_JOBS :]) == 0
    finally:
        backend.close()
    assert len(done.wait()) == runner_backend.AHEAD_JOBS  # answered (failed) at close


def test_a_job_bigger_than_the_window_still_starts_on_an_idle_replica(tmp_path: Path) -> None:
    backend = RunnerBackend(
        [write_example(tmp_path / "simple.popef", "simple", "--batch-size", "4")]
    )
    try:
        big = jobs_of([4 * runner_backend.AHEAD_JOBS * 3], 0)
        assert backend.room_for(big) == 1
        check_against_reference(backend, big, 0)
    finally:
        backend.close()
