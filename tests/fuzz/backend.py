"""Fuzzing the broker's backend: a fake worker that misbehaves in every way it can.

The fake worker is a raw DEALER serving model ``fz`` (the ``add`` of tests/fn_worker.py
under another name, so that only it gets those jobs). A raw client keeps a few ``fz``
requests in flight; for every JOBS the fake picks one behaviour — right results,
wrong outputs (shape, dtype, name, batch size, byte count), failures with valid,
unknown and BROKER_SHUTDOWN codes, results for ids never sent, duplicates, huge frame
counts, timing abuse (32 and 33 entries, bad values), late answers, mutated RESULTS,
BYE, HELLO again — and between batches it abuses HELLO, HEARTBEAT and BYE.

Each request collects the answers the protocol allows for it (from what the fake
did with its job); the answer the client gets must be one of them, exactly once,
or DEADLINE_EXCEEDED. A misbehaving worker can lose its own jobs, not make the
broker lie: a REPLY always carries outputs that fit the model and that a worker
really sent for that request. Meanwhile ``add`` requests to the real worker
(the probe) are answered correctly within a second after every 500 messages.

This module is the fake worker and the sockets; what each request may be answered
with, and the judgement of each answer, is the :class:`~tests.fuzz.ledger.Ledger`'s.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from ipuserve import protocol as wire
from ipuserve.protocol import Command
from tests.fuzz.engine import (
    ADD_WIDTH,
    CLIENT_CODES,
    PROBE_EVERY,
    Report,
    add_arrays,
    decodes,
    frames_of,
    mutate,
    rss_bytes,
    spec_json,
)
from tests.fuzz.frontend import probe
from tests.fuzz.ledger import TIMEOUT_MS, Ledger
from tests.fuzz.worker_frames import model_spec, results_frames, worker_timing

MODEL = "fz"
CREDIT = 8
IN_FLIGHT = 6
BEHAVIOURS = [
    "ok",
    "ok",
    "ok",
    "split",
    "timing-32",
    "timing-abuse",
    "wrong-shape",
    "wrong-dtype",
    "wrong-name",
    "extra-output",
    "wrong-batch",
    "wrong-bytes",
    "fail-valid",
    "fail-unknown",
    "fail-shutdown",
    "strangers",
    "duplicate-row",
    "duplicate-message",
    "huge-frames",
    "mutated",
    "mutated",
    "late",
    "bye",
    "hello-again",
]


class BackendFuzzer:
    """Runs the fake worker for ``messages`` messages against a broker with a real
    ``add`` worker (the probe's)."""

    def __init__(
        self, frontend: str, backend: str, broker_pid: int, seed: int, ops: list[str] | None = None
    ) -> None:
        self.rng = random.Random(seed)
        #: the mutations to draw from (engine.mutate; None: all), and the behaviours:
        #: with ``ops`` given, mostly RESULTS so mutated
        self.ops = ops
        self.behaviours = BEHAVIOURS if ops is None else ["ok", "mutated", "mutated", "mutated"]
        self.report = Report("backend", seed)
        self.ledger = Ledger(self.report)
        self.pid = broker_pid
        context: zmq.Context[Any] = zmq.Context.instance()
        self.client = self._dealer(context, frontend)
        self.prober = self._dealer(context, frontend)
        self.backend = backend
        self.worker = self._dealer(context, backend)
        self.late: list[tuple[float, list[bytes]]] = []
        self.serial = 0
        self.junk = 0

    @staticmethod
    def _dealer(context: zmq.Context[Any], endpoint: str) -> zmq.Socket[Any]:
        socket: zmq.Socket[Any] = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(endpoint)
        return socket

    def close(self) -> None:
        for socket in (self.client, self.prober, self.worker):
            socket.close(linger=0)

    # ------------------------------------------------------------ the run

    def run(self, messages: int, alive: Callable[[], bool] = lambda: True) -> Report:
        """``messages`` messages, or until the broker is no longer ``alive``."""
        report = self.report
        report.rss_before = rss_bytes(self.pid)
        self.hello()
        self.welcomed()
        next_probe = PROBE_EVERY
        while report.sent < messages and alive():
            self.fill()
            self.turn(misbehave=True)
            if report.sent >= next_probe:
                probe(self.prober, self.rng, report, report.sent)
                next_probe += PROBE_EVERY
                # 400 new model names, then none: what the broker keeps of them must
                # stay bounded, and MODELS must keep working (check_models)
                self.hello(extra_models=400)
                self.hello()
        self.drain()
        self.check_models()
        report.rss_after = rss_bytes(self.pid)
        return report

    def welcomed(self) -> None:
        """Wait for the first WELCOME: before it, ``fz`` is nobody's model."""
        while self.worker.poll(5000):
            if isinstance(decodes(self.worker.recv_multipart())[0], wire.Welcome):
                return
        raise AssertionError("the broker sent the fake worker no WELCOME within 5 s")

    def fill(self) -> None:
        """Keep IN_FLIGHT requests for ``fz`` pending (one not answered a second after its
        deadline is given up, and reported, so that it does not hold its slot)."""
        self.ledger.give_up_overdue()
        while len(self.ledger.pending) < IN_FLIGHT:
            self.serial += 1
            rid = b"b%07d" % self.serial
            rows = self.rng.randrange(1, 4)
            x, y = add_arrays(self.rng, rows)
            header = {
                "model": MODEL,
                "tensors": [spec_json("x", rows), spec_json("y", rows)],
                "timeout_ms": TIMEOUT_MS,
            }
            self.client.send_multipart(
                frames_of(Command.REQUEST, rid, header, x.tobytes(), y.tobytes())
            )
            self.ledger.expect(rid, x, y)

    def turn(self, misbehave: bool, wait_ms: int = 5) -> None:
        poller = zmq.Poller()
        poller.register(self.client, zmq.POLLIN)
        poller.register(self.worker, zmq.POLLIN)
        ready = dict(poller.poll(wait_ms))
        if self.client in ready:
            self.ledger.received(self.client.recv_multipart())
        if self.worker in ready:
            self.on_worker(self.worker.recv_multipart(), misbehave)
        now = time.monotonic()
        due = [frames for when, frames in self.late if when <= now or not misbehave]
        self.late = [(when, frames) for when, frames in self.late if when > now and misbehave]
        for frames in due:
            self.send(frames)
        if misbehave and self.rng.random() < 0.3:
            self.abuse()

    def drain(self) -> None:
        """Behave until every request is answered (or long past its deadline)."""
        deadline = time.monotonic() + 2 * TIMEOUT_MS / 1000 + 2
        while self.ledger.pending and time.monotonic() < deadline:
            self.turn(misbehave=False, wait_ms=50)
            if self.rng.random() < 0.2:
                self.send(frames_of(Command.HEARTBEAT, b"", {"in_flight": 0, "credit": CREDIT}))
        for rid in list(self.ledger.pending):
            self.ledger.unanswered(rid)

    def check_models(self) -> None:
        """`ipuserve models` (MODELS) must still work after the fake's HELLOs."""
        self.prober.send_multipart(frames_of(Command.MODELS, b"models", {}))
        while self.prober.poll(5000):
            message, why = decodes(self.prober.recv_multipart())
            if message is None:
                finding = "models-reply-size" if "header" in why else None
                self.report.violate("MODELS answered", f"undecodable reply: {why}", finding)
                return
            if isinstance(message, wire.ModelsReply):
                return
            if isinstance(message, wire.ErrorReply) and message.request_id == b"models":
                self.report.violate("MODELS answered", f"{message}", "models-reply-size")
                return
        self.report.violate("MODELS answered", "no MODELS_REPLY within 5 s")

    # ------------------------------------------------------------ the fake worker

    def send(self, frames: list[bytes]) -> None:
        self.worker.send_multipart(frames, copy=False)
        self.report.sent += 1

    def hello(self, extra_models: int = 0) -> None:
        models = [model_spec(MODEL)]
        for _ in range(extra_models):
            self.junk += 1
            models.append(model_spec(f"junk{self.junk}"))
        header = {"worker_id": "fuzz-worker", "models": models, "credit": CREDIT}
        self.send(frames_of(Command.HELLO, b"", header))

    def on_worker(self, raw: list[bytes], misbehave: bool) -> None:
        message, why = decodes(raw)
        if isinstance(message, wire.Reconnect):
            self.hello()
        if not isinstance(message, wire.Jobs):
            if message is None:
                self.report.violate("broker sends only well-formed messages", why)
            return
        rows = []
        for job in message.jobs:
            arrays = job.tensors.arrays()
            rid = self.ledger.job(job.job_id, arrays["x"])
            rows.append((job.job_id, rid, arrays["x"] + 2 * arrays["y"]))
        behaviour = self.rng.choice(self.behaviours) if misbehave else "ok"
        self.report.mutations[behaviour] += 1
        for _job, rid, _z in rows:
            self.ledger.note(rid, behaviour)
        self.behave(behaviour, rows)

    def behave(self, behaviour: str, rows: list[tuple[bytes, bytes, Any]]) -> None:
        results = [(job, z, worker_timing()) for job, _rid, z in rows]
        for _job, rid, z in rows:
            self.ledger.allow(rid, reply=z, code="WORKER_FAILED")  # a re-queued job may fail so
        if behaviour in ("ok", "strangers", "duplicate-message", "late", "huge-frames"):
            frames = results_frames(results)
            if behaviour == "strangers":
                self.send(results_frames([(self.rng.randbytes(8), z, {}) for _j, z, _t in results]))
            elif behaviour == "duplicate-message":
                self.send(frames)
                wrong = [(job, z[:, :7].copy(), t) for job, z, t in results]
                frames = results_frames(wrong)
            elif behaviour == "late":
                self.late.append((time.monotonic() + TIMEOUT_MS / 1000 * 1.2, frames))
                return
            elif behaviour == "huge-frames":
                frames = frames + [b""] * self.rng.choice([65, 1000, 5000])
            self.send(frames)
        elif behaviour == "split":
            for result in results:
                self.send(results_frames([result]))
        elif behaviour in ("timing-32", "timing-abuse"):
            for _job, _z, timing in results:
                if behaviour == "timing-32":  # an unanswered request after it: finding timing-32
                    timing.clear()
                    timing.update({f"t{i}": float(i) for i in range(32)})
                else:
                    timing[self.rng.choice(["worker_us", "x" * 300, ""])] = self.rng.choice(
                        [-1.0, 1e308, "fast", None, [1], {"a": 1}, True]
                    )
                    if self.rng.random() < 0.5:
                        timing.update({f"t{i}": 1.0 for i in range(33)})
            self.send_checked(results_frames(results))
        elif behaviour in (
            "wrong-shape",
            "wrong-dtype",
            "wrong-name",
            "extra-output",
            "wrong-batch",
            "wrong-bytes",
        ):
            self.send(self.wrong_outputs(behaviour, results, rows))
        elif behaviour.startswith("fail-"):
            code = {
                "fail-valid": self.rng.choice(sorted(CLIENT_CODES - {"BROKER_SHUTDOWN"})),
                "fail-unknown": self.rng.choice(["NOPE", "", "x" * 100, "bad_message"]),
                "fail-shutdown": "BROKER_SHUTDOWN",
            }[behaviour]
            finding = {
                "fail-unknown": "unknown-failure-code",
                "fail-shutdown": "broker-shutdown-from-worker",
            }.get(behaviour)
            for _job, rid, _z in rows:
                self.ledger.amend(rid, f"({code})")  # which: DEADLINE_EXCEEDED is one of them
                self.ledger.allow(
                    rid,
                    code=code if behaviour == "fail-valid" else None,
                    symptom=(code, finding) if finding else None,
                )
                if finding == "unknown-failure-code":  # the bare IpuserveError's code
                    self.ledger.allow(rid, symptom=("INTERNAL", finding))
            failures = [[job.hex(), code, "fuzz"] for job, _rid, _z in rows]
            self.send(
                frames_of(Command.RESULTS, b"", {"specs": [], "results": [], "failures": failures})
            )
        elif behaviour == "duplicate-row":
            self.send_checked(results_frames(results + results[:1]))
        elif behaviour == "mutated":
            op, frames = mutate(self.rng, results_frames(results), self.ops)
            self.report.mutations[f"mutated/{op}"] += 1
            for _job, rid, _z in rows:
                self.ledger.note(rid, op)
            self.send_checked(frames)
        elif behaviour == "bye":
            self.send(frames_of(Command.BYE, b"", {"handed_back": [j.hex() for j, _r, _z in rows]}))
            self.hello()
        elif behaviour == "hello-again":
            self.hello(extra_models=self.rng.choice([0, 0, 400]))

    def send_checked(self, frames: list[bytes]) -> None:
        """Send RESULTS that may not decode, once the ledger knows what they allow."""
        self.ledger.results_sent(frames)
        self.send(frames)

    def wrong_outputs(self, behaviour: str, results: list[Any], rows: list[Any]) -> list[bytes]:
        specs, out_rows, frames = [], [], []
        for i, (job, z, timing) in enumerate(results):
            rid, b = rows[i][1], z.shape[0]
            spec = [spec_json("z", b)]
            data = z.tobytes()
            if behaviour == "wrong-shape":
                spec, data = [spec_json("z", b, width=ADD_WIDTH - 1)], z[:, :7].copy().tobytes()
            elif behaviour == "wrong-dtype":
                spec, data = [spec_json("z", b, "float64")], z.astype(np.float64).tobytes()
            elif behaviour == "wrong-name":
                spec = [spec_json("w", b)]
            elif behaviour == "extra-output":
                spec, data = [spec_json("z", b), spec_json("w", b)], data + data
            elif behaviour == "wrong-batch":
                spec, data = [spec_json("z", b + 1)], np.vstack([z, z[:1]]).tobytes()
                self.ledger.allow(rid, symptom=("REPLY", "wrong-batch-size"))
            elif behaviour == "wrong-bytes":
                data = data[: -self.rng.choice([1, 4, len(data)])]
                self.ledger.allow(rid, symptom=("INVALID_INPUT", "wrong-bytes-blamed-on-client"))
            specs.append(spec)
            out_rows.append([job.hex(), len(specs) - 1, timing])
            frames += [data[: len(data) // 2], data[len(data) // 2 :]] if len(spec) == 2 else [data]
        return frames_of(Command.RESULTS, b"", {"specs": specs, "results": out_rows}, *frames)

    def abuse(self) -> None:
        """A message between batches: HEARTBEAT, HELLO or BYE abuse, or garbage."""
        kind = self.rng.choice(
            [
                "heartbeat",
                "heartbeat",
                "credit-0",
                "hello",
                "bye-strangers",
                "garbage",
                "stranger-results",
            ]
        )
        self.report.mutations[f"abuse/{kind}"] += 1
        if kind == "heartbeat":
            value = self.rng.choice([-1, 2**63, 1.5, "x", None, True, CREDIT])
            self.send(
                frames_of(
                    Command.HEARTBEAT,
                    b"",
                    {self.rng.choice(["credit", "in_flight", "other"]): value},
                )
            )
        elif kind == "credit-0":
            self.send(frames_of(Command.HEARTBEAT, b"", {"in_flight": 0, "credit": 0}))
            self.send(frames_of(Command.HEARTBEAT, b"", {"in_flight": 0, "credit": CREDIT}))
        elif kind == "hello":
            header = {
                "worker_id": self.rng.choice(["", "x" * 300, "fuzz-worker", "other"]),
                "models": [model_spec(MODEL)],
                "credit": CREDIT,
            }
            _op, frames = mutate(self.rng, frames_of(Command.HELLO, b"", header), self.ops)
            self.send(frames)
            self.hello()
        elif kind == "bye-strangers":
            ids = [self.rng.randbytes(self.rng.choice([0, 8, 70])).hex() for _ in range(3)]
            self.send(frames_of(Command.BYE, b"", {"handed_back": ids}))
            self.hello()
        elif kind == "garbage":
            base = frames_of(Command.HEARTBEAT, b"", {"in_flight": 0})
            self.send(mutate(self.rng, base, self.ops)[1])
        else:
            z = np.zeros((2, ADD_WIDTH), np.float32)
            self.send(results_frames([(self.rng.randbytes(8), z, worker_timing())]))
