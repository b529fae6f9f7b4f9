"""The backend fuzzer's own judgement of an error answer (issue 21).

A loaded run of ``benchmarks/fuzz.py --messages 20000`` once reported a request
answered DEADLINE_EXCEEDED "where WORKER_FAILED was allowed", after the fake worker
had failed its job ("fail-valid") and then sent RESULTS for it that did not decode
("timing-abuse"). The broker was right: its job had been placed twice on the fake
(a HELLO of the fake re-queued it onto the same connection), the fake failed the
first copy with the code it drew, DEADLINE_EXCEEDED, and the broker forwarded that
code a few milliseconds after the request. The fuzzer was wrong: DEADLINE_EXCEEDED
stood in one set both as "the broker's own timer may fire" and as "the fake
reported it", so ruling the timer out for the undecodable RESULTS (their jobs fail
at once) also struck the code the fake had reported.

These tests replay that sequence on the fuzzer against a real broker (which only
receives the frames), and check that the rule still bites where it should.
"""

from __future__ import annotations

import random

from tests.fuzz.backend import BackendFuzzer
from tests.fuzz.engine import add_arrays, decodes
from tests.fuzz.ledger import Pending
from tests.fuzz.worker_frames import results_frames, worker_timing
from tests.helpers import Processes, start_broker

RID = b"b0000001"
JOB = b"job-0001"


def _fuzzer(processes: Processes) -> BackendFuzzer:
    broker = start_broker(processes)
    return BackendFuzzer(broker.frontend, broker.backend, broker.proc.pid, seed=21)


def _undecodable_results(fuzzer: BackendFuzzer) -> None:
    """What "timing-abuse" sends for the job: RESULTS with 33 timing entries."""
    x, y = fuzzer.ledger.pending[RID].x, fuzzer.ledger.pending[RID].y
    timing = worker_timing() | {f"t{i}": 1.0 for i in range(33)}
    frames = results_frames([(JOB, x + 2 * y, timing)])
    assert decodes(frames)[0] is None  # the premise: the broker cannot read it
    fuzzer.send_checked(frames)


def _pending(fuzzer: BackendFuzzer, history: list[str]) -> None:
    x, y = add_arrays(random.Random(21), 2)
    fuzzer.ledger.pending[RID] = Pending(x, y, history=history)
    fuzzer.ledger.jobs[JOB] = RID


def test_a_deadline_exceeded_the_fake_reported_stays_allowed(processes: Processes) -> None:
    fuzzer = _fuzzer(processes)
    try:
        _pending(fuzzer, ["fail-valid(DEADLINE_EXCEEDED)", "timing-abuse"])
        fuzzer.ledger.allow(RID, code="DEADLINE_EXCEEDED")  # what fail-valid does with that code
        _undecodable_results(fuzzer)
        fuzzer.ledger.answer(RID, "DEADLINE_EXCEEDED")  # the broker forwards the fake's failure
        assert fuzzer.report.violations == []
    finally:
        fuzzer.close()


def test_the_broker_may_not_time_out_a_job_named_by_undecodable_results(
    processes: Processes,
) -> None:
    """Without the fake's own DEADLINE_EXCEEDED the rule holds: the job should have
    failed WORKER_FAILED at once, its deadline was still far."""
    fuzzer = _fuzzer(processes)
    try:
        _pending(fuzzer, ["timing-abuse"])
        _undecodable_results(fuzzer)
        fuzzer.ledger.answer(RID, "DEADLINE_EXCEEDED")
        (violation,) = fuzzer.report.violations
        assert "got DEADLINE_EXCEEDED" in violation.detail
        assert "allowed ['WORKER_FAILED']" in violation.detail
    finally:
        fuzzer.close()
