"""SIGTERM drains a real worker process: what it cannot finish in time goes elsewhere."""

from __future__ import annotations

import pytest

from tests.helpers import (
    Processes,
    RawClient,
    add_inputs,
    assert_add_reply,
    fn_worker_argv,
    start_broker,
    start_worker,
)

pytestmark = pytest.mark.slow


# "hands back": the jobs run 100 times longer than the drain allows, so a loaded
# machine that is slow to deliver SIGTERM cannot let them finish first (at 400 ms
# they sometimes did). Not longer: the worker's exit waits for its backend threads.
@pytest.mark.parametrize(
    ("drain_ms", "job_ms", "handed_back"),
    [(10_000, 400, 0), (50, 5_000, 2)],
    ids=["finishes", "hands back"],
)
def test_sigterm_finishes_or_hands_back_and_exits_0(
    processes: Processes, drain_ms: int, job_ms: int, handed_back: int
) -> None:
    broker = start_broker(processes)
    leaving = start_worker(
        processes,
        broker,
        fn_worker_argv(
            "add",
            "--credit",
            "2",
            "--threads",
            "2",
            "--delay-ms",
            str(job_ms),
            "--drain-timeout-ms",
            str(drain_ms),
        ),
        name="leaving",
    )
    with RawClient(broker.frontend) as client:
        inputs = {
            client.request("add", add_inputs(2, seed=i)): add_inputs(2, seed=i) for i in range(3)
        }  # two run, the third waits in the broker's queue
        leaving.wait_for_count("running a job", 2)
        leaving.terminate()
        assert leaving.wait() == 0
        finished = 2 - handed_back
        leaving.wait_for(rf"drained: finished {finished} job\(s\), handed back {handed_back}")
        start_worker(processes, broker, name="successor")
        for _ in inputs:
            reply = client.recv()
            assert_add_reply(reply, inputs[reply.request_id])  # type: ignore[union-attr]
