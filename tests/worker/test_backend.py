"""FunctionBackend: the reference backend, and the Mailbox between threads."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import numpy as np
import pytest

from ipuserve.errors import (
    ClosedError,
    DeadlineExceeded,
    InferenceError,
    IpuserveError,
    UnavailableError,
    UnknownModelError,
)
from ipuserve.worker.backend import FunctionBackend, Mailbox, WorkItem, WorkResult
from tests.worker.fakes import ADD, GatedAdd, add_inputs

Outcomes = queue.SimpleQueue[tuple[WorkItem, WorkResult | IpuserveError, str]]


def collect() -> tuple[Outcomes, Any]:
    outcomes: Outcomes = queue.SimpleQueue()

    def done(job: WorkItem, outcome: WorkResult | IpuserveError) -> None:
        outcomes.put((job, outcome, threading.current_thread().name))

    return outcomes, done


def test_runs_the_function_on_its_own_thread_and_reports_timing() -> None:
    backend = GatedAdd().backend()
    outcomes, done = collect()
    inputs = add_inputs()
    try:
        backend.submit(WorkItem(b"1", "add", inputs), done)
        job, result, thread = outcomes.get(timeout=10)
    finally:
        backend.close()
    assert job.job_id == b"1" and thread.startswith("function-backend")
    assert isinstance(result, WorkResult)
    np.testing.assert_allclose(result.outputs["z"], inputs["x"] + 2 * inputs["y"])
    assert set(result.timing) == {"queue_us", "device_us"}
    assert backend.describe() == [ADD] and backend.capacity() == 4


def test_an_expired_job_is_answered_without_running() -> None:
    model = GatedAdd()
    backend = model.backend()
    outcomes, done = collect()
    try:
        backend.submit(WorkItem(b"1", "add", add_inputs(), deadline=time.monotonic() - 1), done)
        _job, outcome, _thread = outcomes.get(timeout=10)
    finally:
        backend.close()
    assert isinstance(outcome, DeadlineExceeded) and model.most_running == 0


def test_an_exception_from_the_model_becomes_an_inference_error() -> None:
    def broken(_inputs: Any) -> Any:
        raise ZeroDivisionError("nope")

    backend = FunctionBackend({ADD: broken})
    outcomes, done = collect()
    try:
        backend.submit(WorkItem(b"1", "add", add_inputs()), done)
        _job, outcome, _thread = outcomes.get(timeout=10)
    finally:
        backend.close()
    assert isinstance(outcome, InferenceError)
    assert "'add' raised ZeroDivisionError: nope" in str(outcome)


def test_unknown_models_are_refused_at_submit() -> None:
    backend = GatedAdd().backend()
    try:
        with pytest.raises(UnknownModelError, match="'mul'"):
            backend.submit(WorkItem(b"1", "mul", {}), collect()[1])
    finally:
        backend.close()


def test_close_answers_jobs_it_never_ran_and_refuses_new_ones() -> None:
    model = GatedAdd(gated=True)
    backend = model.backend(threads=1)
    outcomes, done = collect()
    backend.submit(WorkItem(b"running", "add", add_inputs()), done)
    model.wait_started()
    backend.submit(WorkItem(b"waiting", "add", add_inputs()), done)
    closer = threading.Thread(target=backend.close)
    closer.start()
    model.gate.set()
    closer.join(10)
    answers = {
        job.job_id: outcome
        for job, outcome, _ in (outcomes.get(timeout=10), outcomes.get(timeout=10))
    }
    assert isinstance(answers[b"running"], WorkResult)
    assert isinstance(answers[b"waiting"], UnavailableError)
    with pytest.raises(ClosedError):
        backend.submit(WorkItem(b"late", "add", add_inputs()), done)


def test_the_mailbox_wakes_on_the_first_put_and_loses_nothing() -> None:
    mailbox = Mailbox()
    job = WorkItem(b"1", "add", {})
    try:
        threads = [
            threading.Thread(
                target=lambda: [mailbox.put((job, UnavailableError("x"))) for _ in range(500)]
            )
            for _ in range(4)
        ]
        for thread in threads:
            thread.start()
        got = 0
        import select

        while got < 2000:
            ready, _, _ = select.select([mailbox.fd], [], [], 10)
            assert ready, "the eventfd never became readable with items pending"
            got += len(mailbox.take())
        for thread in threads:
            thread.join()
        assert got == 2000 and not mailbox.take()
    finally:
        mailbox.close()
