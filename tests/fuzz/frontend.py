"""Fuzzing the broker's frontend: mutated REQUEST, REQUESTS, MODELS, PING and REPOSITORY,
requests naming versions, and garbage.

One raw DEALER sends one message at a time and reads what comes back until the
message is answered (or a second has passed): every message a client sends is
addressable — the broker's ROUTER knows the sender — so every one must be answered,
a malformed one with an ERROR carrying its id as far as the id can be read
(docs/protocol.md §4). A well-formed request of model ``add`` that is answered
with a REPLY must carry ``x + 2 y`` of the tensors actually sent, and say version
"1" when it named it (the ``add`` worker serves version 1). REPOSITORY commands
(tests/fuzz/repository.py) are answered with a REPOSITORY_REPLY or an ERROR of an
allowed code (the fuzzer's loopback peer is an admin in protected mode).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from ipuserve import protocol as wire
from ipuserve.protocol import Command
from tests.fuzz.engine import (
    PROBE_EVERY,
    PROBE_TIMEOUT_S,
    Report,
    add_arrays,
    decodes,
    envelope_id,
    frames_of,
    header_depth,
    mutate,
    row_ids,
    rss_bytes,
    spec_json,
)
from tests.fuzz.repository import (
    check_repository_answer,
    repository_message,
    version_field,
)

ANSWER_TIMEOUT_S = 1.0
#: The share of messages that are valid REQUESTs with distinct headers of 200-255 KiB:
#: 15 % of 2,000 is 300 of them, ~70 MiB that a cache bounded in entries would keep.
BIG_HEADERS = 0.15
CLIENT_MESSAGES = (
    wire.Request,
    wire.Requests,
    wire.ListModels,
    wire.Ping,
    wire.RepositoryCommand,
)


def valid_message(rng: random.Random, serial: int, kind: str = "") -> tuple[str, list[bytes]]:
    """A well-formed message of a random client command (or of ``kind``)."""
    rid = b"f%07d" % serial
    kind = kind or rng.choice(
        ["request", "request", "requests", "requests", "models", "ping", "repository"]
    )
    if kind == "repository":
        return kind, repository_message(rng, rid)
    if kind == "request":
        rows = rng.randrange(1, 5)
        x, y = add_arrays(rng, rows)
        header: dict[str, Any] = {
            "model": rng.choice(["add", "add", "add", "nope"]),
            "tensors": [spec_json("x", rows), spec_json("y", rows)],
        }
        if rng.random() < 0.7:
            header["timeout_ms"] = 5000.0
        if rng.random() < 0.3:  # existing ("1"), unknown or malformed
            header["version"] = version_field(rng)
        return kind, frames_of(Command.REQUEST, rid, header, x.tobytes(), y.tobytes())
    if kind == "requests":
        specs, rows_out, tensors = [], [], []
        for row in range(rng.randrange(1, 4)):
            rows = rng.randrange(1, 4)
            members = rng.choice([1, 1, 2, 3])
            ids = [(rid + b"-%d-%d" % (row, m)).hex() for m in range(members)]
            spec = {"model": "add", "tensors": [spec_json("x", rows), spec_json("y", rows)]}
            if rng.random() < 0.2:
                spec["version"] = version_field(rng)
            specs.append(spec)
            rows_out.append([ids if members > 1 else ids[0], row, 5000.0])
            x, y = add_arrays(rng, rows * members)
            tensors += [x.tobytes(), y.tobytes()]
        header = {"specs": specs, "requests": rows_out}
        return kind, frames_of(Command.REQUESTS, b"", header, *tensors)
    command = Command.MODELS if kind == "models" else Command.PING
    return kind, frames_of(command, rid, {})


class FrontendFuzzer:
    """Sends ``messages`` mutated client messages to ``frontend``; checks every answer."""

    def __init__(
        self, frontend: str, broker_pid: int, seed: int, ops: list[str] | None = None
    ) -> None:
        self.frontend, self.pid = frontend, broker_pid
        self.ops = ops  # the mutations to draw from (engine.mutate: None, all)
        self.rng = random.Random(seed)
        self.report = Report("frontend", seed)
        self.context: zmq.Context[Any] = zmq.Context.instance()
        self.socket = self._dealer()

    def _dealer(self) -> zmq.Socket[Any]:
        socket: zmq.Socket[Any] = self.context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self.frontend)
        return socket

    def close(self) -> None:
        self.socket.close(linger=0)

    def run(self, messages: int, alive: Callable[[], bool] = lambda: True) -> Report:
        """``messages`` messages, or until the broker is no longer ``alive``."""
        report = self.report
        report.rss_before = rss_bytes(self.pid)
        for serial in range(messages):
            if not alive():
                break
            op = "none"
            if self.rng.random() < BIG_HEADERS and self.ops is None:  # a cache's bound
                kind, frames = valid_message(self.rng, serial, "request")
                op, frames = "header-padded", _padded(self.rng, frames)
            else:
                kind, frames = valid_message(self.rng, serial)
                if self.rng.random() < 0.85:
                    op, frames = mutate(self.rng, frames, self.ops)
            report.mutations[f"{kind}/{op}"] += 1
            self.exchange(kind, op, frames)
            report.sent += 1
            if (serial + 1) % PROBE_EVERY == 0:
                probe(self.socket, self.rng, report, serial)
        report.rss_after = rss_bytes(self.pid)
        return report

    def exchange(self, kind: str, op: str, frames: list[bytes]) -> None:
        """Send one message and check what answers it."""
        message, why = decodes(frames)
        if message is not None and not isinstance(message, CLIENT_MESSAGES):
            message, why = None, f"{type(message).__name__} is no client's command"
        own = envelope_id(frames)
        # what must be answered: each request of a well-formed message; for a malformed
        # one, each request id its header still names, or else its envelope's id
        wanted = set(_request_ids(message)) if message is not None else row_ids(frames) or {own}
        must = set(wanted)
        self.socket.send_multipart(frames, copy=False)
        deadline = time.monotonic() + ANSWER_TIMEOUT_S
        while wanted and (left := deadline - time.monotonic()) > 0:
            if not self.socket.poll(int(left * 1000) + 1):
                break
            raw = self.socket.recv_multipart()
            for rid, answer, carrier in _answers(raw, self.report, f"{kind}/{op}"):
                if rid not in must and rid != own:
                    continue  # a late answer to an earlier message
                self.report.answers[answer if isinstance(answer, str) else "REPLY"] += 1
                wanted.discard(rid)
                if isinstance(message, wire.RepositoryCommand) or kind == "repository":
                    check_repository_answer(frames, message, carrier, self.report, f"{kind}/{op}")
                _check_depth(frames, message, answer, carrier, self.report, f"{kind}/{op}")
                if message is None and not isinstance(answer, str):
                    self.report.violate(
                        "malformed message answered with a REPLY", f"{kind}/{op}: {why}"
                    )
                elif message is not None and not isinstance(answer, str):
                    _check_reply(message, rid, answer, self.report, f"{kind}/{op}")
                    _check_version(message, rid, carrier, self.report, f"{kind}/{op}")
        if wanted and message is None:
            known = op == "envelope-id" or (kind == "models" and op == "header-padded")
            self.report.violate(
                "malformed message from an addressable peer gets an ERROR",
                f"{kind}/{op}: no ERROR for {sorted(wanted)[:3]} within {ANSWER_TIMEOUT_S} s "
                f"for {why} (frames {[bytes(f[:80]) for f in frames[:3]]})",
                "frontend-no-error" if known else None,
            )
        elif wanted and not (kind == "requests" and wanted == {b""}):
            self.report.violate(
                "well-formed request answered",
                f"{kind}/{op}: {len(wanted)} id(s) unanswered within "
                f"{ANSWER_TIMEOUT_S} s: {sorted(wanted)[:4]}",
            )


def _check_depth(
    frames: list[bytes],
    message: wire.Message | None,
    answer: Any,
    carrier: Any,
    report: Report,
    what: str,
) -> None:
    """A header deeper than MAX_HEADER_DEPTH (as an oracle of its own measures it) is
    refused BAD_MESSAGE; a header of valid JSON within it is never refused for depth."""
    if len(frames) < 2 or not frames[0].startswith(wire.TAG):
        return
    deep = header_depth(frames[1]) > wire.MAX_HEADER_DEPTH
    if deep and (message is not None or answer not in ("BAD_MESSAGE", "UNSUPPORTED_VERSION")):
        report.violate("a header deeper than the limit is refused", f"{what}: {answer}")
    elif not deep and "deep; the limit is" in getattr(carrier, "message", ""):
        try:
            json.loads(frames[1])  # (no JSON: a scan may count what no parser reads)
        except (ValueError, RecursionError):
            return
        report.violate("a header within the depth limit is parsed", f"{what}: {carrier}")


def _padded(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    """A valid message whose header is 200-255 KiB (JSON whitespace) and distinct."""
    pad = b" " * rng.randrange(200 * 1024, 255 * 1024)
    return [frames[0], frames[1][:1] + pad + frames[1][1:], *frames[2:]]


def _request_ids(message: wire.Message) -> list[bytes]:
    if isinstance(message, wire.Requests):
        return [rid for r in message.requests for rid in (r.group or (r.request_id,))] + [
            f.job_id for f in message.rejected
        ]
    return [getattr(message, "request_id", b"")]


def _answers(raw: list[bytes], report: Report, what: str) -> list[tuple[bytes, Any, Any]]:
    """(request id, REPLY tensors z or an ERROR code / command name, the message that
    carried it) for each answer."""
    message, why = decodes(raw)
    if message is None:
        report.violate("broker sends only well-formed messages", f"after {what}: {why}")
        return []
    if isinstance(message, wire.ErrorReply):
        return [(message.request_id, message.code, message)]
    if isinstance(message, (wire.Pong, wire.ModelsReply)):
        return [(message.request_id, type(message).__name__, message)]
    if isinstance(message, wire.RepositoryReply):
        return [(message.request_id, "REPOSITORY_REPLY", message)]
    if isinstance(message, wire.Reply):
        return _reply_rows(message)
    if isinstance(message, wire.Replies):
        rows = [row for reply in message.replies for row in _reply_rows(reply)]
        return rows + [(fail.job_id, fail.code, fail) for fail in message.errors]
    report.violate("broker sends clients only client messages", f"{type(message).__name__}")
    return []


def _reply_rows(reply: wire.Reply) -> list[tuple[bytes, Any, Any]]:
    ids = reply.group or (reply.request_id,)
    parts = [member.arrays().get("z") for member in reply.tensors.split()]
    return [(rid, z, reply) for rid, z in zip(ids, parts, strict=True)]


def _check_reply(message: wire.Message, rid: bytes, z: Any, report: Report, what: str) -> None:
    """A REPLY must be x + 2 y of the request it answers (numpy reference)."""
    requests = message.requests if isinstance(message, wire.Requests) else (message,)
    for request in requests:
        members = getattr(request, "group", ()) or (getattr(request, "request_id", None),)
        if rid not in members or not isinstance(request, wire.Request):
            continue
        arrays = request.tensors.split()[members.index(rid)].arrays()
        x, y = arrays.get("x"), arrays.get("y")
        ok = False
        if request.model == "add" and x is not None and y is not None and z is not None:
            with np.errstate(all="ignore"):  # flipped bits may make inf and NaN
                expected = x + 2 * y
                ok = z.shape == x.shape and np.allclose(z, expected, rtol=1e-6, equal_nan=True)
        if not ok:
            report.violate("no well-formed request gets a wrong answer", f"{what}: {rid!r}")
        return


def _check_version(
    message: wire.Message, rid: bytes, reply: Any, report: Report, what: str
) -> None:
    """A REPLY says which version answered: the one the request named, if it named one
    (the ``add`` worker serves version "1": any other is refused)."""
    requests = message.requests if isinstance(message, wire.Requests) else (message,)
    for request in requests:
        members = getattr(request, "group", ()) or (getattr(request, "request_id", None),)
        if rid in members and isinstance(request, wire.Request):
            named = request.version
            said = getattr(reply, "version", None)
            if said != (named or "1"):
                report.violate(
                    "a REPLY names the version that answered",
                    f"{what}: {rid!r} named version {named!r}, the REPLY says {said!r}",
                )
            return


def probe(socket: zmq.Socket[Any], rng: random.Random, report: Report, serial: int) -> None:
    """A well-formed REQUEST must be answered correctly within a second."""
    rid = b"probe%d" % serial
    x, y = add_arrays(rng, 2)
    header = {"model": "add", "tensors": [spec_json("x", 2), spec_json("y", 2)]}
    socket.send_multipart(frames_of(Command.REQUEST, rid, header, x.tobytes(), y.tobytes()))
    report.probes += 1
    deadline = time.monotonic() + PROBE_TIMEOUT_S
    while (left := deadline - time.monotonic()) > 0 and socket.poll(int(left * 1000) + 1):
        message, _why = decodes(socket.recv_multipart())
        if getattr(message, "request_id", None) != rid:
            continue
        if not isinstance(message, wire.Reply) or not np.allclose(
            message.tensors.arrays()["z"], x + 2 * y, rtol=1e-6
        ):
            report.violate("probe answered correctly", f"after {serial + 1}: {message}")
        return
    report.violate("probe answered within a second", f"after message {serial + 1}")
