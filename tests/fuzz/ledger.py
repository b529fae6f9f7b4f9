"""The backend fuzzer's oracle: what each request may be answered with, and the judgement
of every answer the client gets.

The fake worker (tests/fuzz/backend.py) decides what to do with each JOBS and tells the
ledger what that allows: a REPLY with the outputs it really sent, an error code, or
the symptom (a finding of issue 16) that a given wrong answer would show. The ledger
judges the client's side against that alone, so the rules of the protocol (a
misbehaving worker can lose its own jobs, not make the broker lie) live in one place,
apart from the sockets and the misbehaviour that exercise them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ipuserve import protocol as wire
from tests.fuzz.engine import Report, decodes
from tests.fuzz.worker_frames import named_jobs

TIMEOUT_MS = 1500.0
ANSWER_GRACE_S = 1.0
# a job named by undecodable RESULTS sent this soon after its request must fail at once,
# not at its deadline: the broker has TIMEOUT_MS - DEADLINE_SURE_S to read the frames
DEADLINE_SURE_S = TIMEOUT_MS / 1000 / 2


@dataclass
class Pending:
    """A client request: the answers it may get, and the finding each wrong one shows."""

    x: np.ndarray[Any, Any]
    y: np.ndarray[Any, Any]
    replies: list[np.ndarray[Any, Any]] = field(default_factory=list)
    # the codes something the fake did allows; a job may fail WORKER_FAILED without
    # reaching the fake: each HELLO or BYE of the fake drops it, and a job its JOBS were
    # still travelling to is re-queued, an attempt counted (max_attempts of them fail it)
    codes: set[str] = field(default_factory=lambda: {"WORKER_FAILED"})
    # whether the broker may answer DEADLINE_EXCEEDED of its own: kept apart from
    # ``codes``, so that ruling the deadline out never rules out a DEADLINE_EXCEEDED the
    # fake itself reported for the job (a fail-valid may pick that code)
    deadline_may_pass: bool = True
    symptoms: dict[str, str] = field(default_factory=dict)
    sent_at: float = field(default_factory=time.monotonic)
    history: list[str] = field(default_factory=list)  # what the fake did with its job

    def allowed(self) -> set[str]:
        """The error codes this request may be answered with now."""
        return self.codes | ({"DEADLINE_EXCEEDED"} if self.deadline_may_pass else set())


class Ledger:
    """The requests in flight, by request id, and the jobs the broker made of them."""

    def __init__(self, report: Report) -> None:
        self.report = report
        self.pending: dict[bytes, Pending] = {}
        self.jobs: dict[bytes, bytes] = {}  # job id -> request id
        self.given_up: set[bytes] = set()

    # ------------------------------------------------------------ the fake's side

    def job(self, job_id: bytes, x: np.ndarray[Any, Any]) -> bytes:
        """A job the broker sent the fake: the request it carries (``b"?"``: none known)."""
        rid = next(
            (r for r, p in self.pending.items() if p.x.shape == x.shape and np.array_equal(p.x, x)),
            b"?",
        )
        self.jobs[job_id] = rid
        return rid

    def note(self, rid: bytes, what: str) -> None:
        """Add to what the fake did with a request's job (for the violation's detail)."""
        if rid in self.pending:
            self.pending[rid].history.append(what)

    def amend(self, rid: bytes, detail: str) -> None:
        """Add ``detail`` to the last thing the fake did with a request's job."""
        if rid in self.pending:
            self.pending[rid].history[-1] += detail

    def allow(
        self,
        rid: bytes,
        *,
        reply: Any = None,
        code: str | None = None,
        symptom: tuple[str, str] | None = None,
    ) -> None:
        """What the fake did allows ``rid`` this REPLY or this code; ``symptom``: the
        answer (REPLY or a code) that would show this finding."""
        pending = self.pending.get(rid)
        if pending is None:
            return
        if reply is not None:
            pending.replies.append(reply)
        if code is not None:
            pending.codes.add(code)
        if symptom is not None:
            pending.symptoms[symptom[0]] = symptom[1]

    def results_sent(self, frames: list[bytes]) -> None:
        """RESULTS that may not decode, about to be sent: what decodes is what a REPLY
        may carry; the jobs undecodable ones name fail at once (docs/protocol.md §4)."""
        message, _why = decodes(frames)
        if isinstance(message, wire.Results):
            for result in message.results:
                rid = self.jobs.get(result.job_id, b"?")
                z = result.tensors.arrays().get("z") if result.tensors.members == 1 else None
                if z is not None and z.shape == self.pending.get(rid, Pending(z, z)).x.shape:
                    self.allow(rid, reply=np.array(z))
            for fail in message.failures:
                self.allow(self.jobs.get(fail.job_id, b"?"), code=fail.code)
        elif message is None:
            for job_id in named_jobs(frames):
                pending = self.pending.get(self.jobs.get(job_id, b"?"))
                # ...unless their deadline may pass before the broker reads these frames:
                # a loaded machine can delay it by a few hundred ms (CI saw it at 1.5 s)
                if pending is not None and time.monotonic() < pending.sent_at + DEADLINE_SURE_S:
                    pending.deadline_may_pass = False
                    pending.history.append("deadline ruled out")

    # ------------------------------------------------------------ the client's side

    def expect(self, rid: bytes, x: np.ndarray[Any, Any], y: np.ndarray[Any, Any]) -> None:
        """A request sent: from now on it may be answered only as the fake allows."""
        self.pending[rid] = Pending(x, y)

    def give_up_overdue(self) -> None:
        """Report every request not answered a grace period after its deadline, so
        that it does not hold its slot."""
        given_up = time.monotonic() - TIMEOUT_MS / 1000 - ANSWER_GRACE_S
        for rid in [rid for rid, p in self.pending.items() if p.sent_at < given_up]:
            self.unanswered(rid)

    def unanswered(self, rid: bytes) -> None:
        pending = self.pending.pop(rid)
        self.given_up.add(rid)
        self.report.violate(
            "every request is answered",
            f"{rid!r} unanswered {ANSWER_GRACE_S} s after its deadline, after {pending.history}",
            "timing-32" if "timing-32" in pending.history else None,  # its REPLY undecodable
        )

    def received(self, raw: list[bytes]) -> None:
        """A message the client got: it must decode and answer one of its requests."""
        message, why = decodes(raw)
        if message is None:
            finding = "timing-32" if "timing" in why else None
            self.report.violate("broker sends only well-formed messages", why, finding)
            return
        if isinstance(message, wire.ErrorReply):
            self.answer(message.request_id, message.code)
        elif isinstance(message, wire.Reply):
            self.answer(message.request_id, message.tensors.arrays().get("z"))
        else:
            self.report.violate("client gets only its answers", f"{type(message).__name__}")

    def answer(self, rid: bytes, answer: Any) -> None:
        """Judge an answer: an error code, or the REPLY's ``z`` (None if it had none)."""
        pending = self.pending.pop(rid, None)
        self.report.answers[answer if isinstance(answer, str) else "REPLY"] += 1
        if pending is None and rid in self.given_up:
            return  # already reported as unanswered
        if pending is None:
            self.report.violate("exactly one answer per request", f"{rid!r}: {answer!r:.80}")
            return
        if isinstance(answer, str):
            if answer not in pending.allowed():
                waited_ms = (time.monotonic() - pending.sent_at) * 1e3
                self.report.violate(
                    "a misbehaving worker's answer reaches the client as the protocol says",
                    f"{rid!r} got {answer} {waited_ms:.0f} ms after its request; allowed "
                    f"{sorted(pending.allowed())} after {pending.history}",
                    pending.symptoms.get(answer),
                )
            return
        if not any(
            answer is not None
            and answer.shape == r.shape
            and np.array_equal(answer, r, equal_nan=True)
            for r in pending.replies
        ):
            self.report.violate(
                "no well-formed request gets a wrong answer",
                f"{rid!r} got z of shape {getattr(answer, 'shape', None)} for x {pending.x.shape}"
                f" after {pending.history}",
                pending.symptoms.get("REPLY"),
            )
