"""The shared part of the protocol fuzzer: findings, mutations, probes and the broker's RSS.

The fuzzer (tests/fuzz/frontend.py, tests/fuzz/backend.py with its oracle
tests/fuzz/ledger.py) drives a real broker process with raw DEALER sockets. It is used
by tests/fuzz/test_fuzz.py (a CI-sized run with a fixed seed) and by ``python
benchmarks/fuzz.py`` (longer runs). Every random choice comes from one seeded
``random.Random``, so a run is reproducible from its seed (up to the broker's own
timing: which messages share a turn of its loop).

The invariants (issue 16), checked on every run:

* the broker process stays up;
* after every PROBE_EVERY (500) messages a well-formed ``add`` REQUEST is answered
  correctly (numpy reference) within PROBE_TIMEOUT_S (1 s);
* frontend: every malformed message gets an ERROR, carrying its envelope's id when
  that can be read, and one for each request id a batch's header still names
  (docs/protocol.md §4) — every client is addressable (the ROUTER knows it);
* no well-formed request gets a wrong answer: a REPLY is x + 2 y of what was sent, or
  (backend) outputs that fit the model and that the fake worker really sent for it;
  a misbehaving worker's answer reaches the client as the protocol says (WORKER_FAILED
  for outputs that do not fit, or codes a worker may not send), exactly once;
* a header deeper than MAX_HEADER_DEPTH (as the fuzzer's own oracle,
  :func:`header_depth`, measures it) is refused BAD_MESSAGE and no id it names is
  read (frontend: only its envelope's is answered; backend: the jobs a deep RESULTS
  names wait for their deadline or a good RESULTS); valid JSON within it is never
  refused for depth (the nesting mutations, NESTING_OPS, issue 28);
* the broker sends only well-formed messages, and MODELS keeps working;
* the broker's RSS (/proc/PID/status VmRSS) grows by at most RSS_BOUND_BYTES.

The frontend half is lock-step (one message, then its answers), so a seed fixes the
whole run; the backend half depends on which jobs the broker batches together, so a
seed fixes the choices but not every outcome.

A check that fails records a :class:`Violation`. A violation is tagged with a
finding of issue 16 when it is exactly that finding's symptom; the run fails on
every violation whose finding is not in :data:`KNOWN`, so once the broker fixes a
finding, deleting its entry makes the fuzzer guard the fix.
"""

from __future__ import annotations

import json
import random
import string
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ipuserve import protocol as wire
from ipuserve.protocol import Command

#: Findings the broker on main still shows, by key. A violation tagged with one of these
#: keys is reported but does not fail the run. Empty: every finding of issue 16 is fixed
#: (tests/broker/test_strict_*.py); a new one goes here only while its fix is under way.
KNOWN: dict[str, str] = {}

#: The broker's RSS may grow by at most this much over a run. Legitimately it holds only
#: what is in flight (the fuzzer keeps at most a few messages of at most ~1 MiB pending),
#: its bounded caches of *small* validated values, ZeroMQ's pipe buffers and allocator
#: slack: a few MiB. 64 MiB is far above that, and well below what an unbounded (or
#: entry-bounded) cache of 256 KiB headers reaches: 1,024 x 256 KiB = 256 MiB.
RSS_BOUND_BYTES = 64 << 20

#: A probe must be answered within this (the issue's "within a second").
PROBE_TIMEOUT_S = 1.0

#: After this many bad messages, a probe.
PROBE_EVERY = 500

ADD_WIDTH = 8
COMMANDS = [int(c) for c in Command]
CLIENT_CODES = {
    "BAD_MESSAGE",
    "UNSUPPORTED_VERSION",
    "UNKNOWN_MODEL",
    "INVALID_INPUT",
    "PAYLOAD_TOO_LARGE",
    "OVERLOADED",
    "DEADLINE_EXCEEDED",
    "WORKER_FAILED",
    "INFERENCE_FAILED",
    "UNAVAILABLE",
    "BROKER_SHUTDOWN",
}


@dataclass
class Violation:
    """A broken invariant: which, the finding it is (if known), and what was seen."""

    invariant: str
    detail: str
    finding: str | None = None


@dataclass
class Report:
    """What a fuzz run did and found."""

    socket: str
    seed: int
    sent: int = 0
    probes: int = 0
    violations: list[Violation] = field(default_factory=list)
    mutations: Counter[str] = field(default_factory=Counter)
    answers: Counter[str] = field(default_factory=Counter)
    rss_before: int = 0
    rss_after: int = 0

    def violate(self, invariant: str, detail: str, finding: str | None = None) -> None:
        self.violations.append(Violation(invariant, detail[:300], finding))

    def unexpected(self) -> list[Violation]:
        """The violations that fail the run: those of no finding still in KNOWN."""
        return [v for v in self.violations if v.finding not in KNOWN]

    def summary(self) -> str:
        by = Counter((v.invariant, v.finding) for v in self.violations)
        lines = [
            f"{self.socket}: seed {self.seed}, {self.sent} messages, {self.probes} probes, "
            f"RSS {self.rss_before >> 20} -> {self.rss_after >> 20} MiB",
            f"  answers: {dict(sorted(self.answers.items()))}",
        ]
        for (invariant, finding), count in sorted(by.items(), key=str):
            example = next(
                v for v in self.violations if (v.invariant, v.finding) == (invariant, finding)
            )
            tag = f"finding {finding!r}" if finding else "NEW"
            lines.append(f"  {count} x {invariant} [{tag}]: {example.detail}")
        return "\n".join(lines)


def rss_bytes(pid: int) -> int:
    """VmRSS of a process, from /proc; 0 once it has exited (the run reports that)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except FileNotFoundError:
        pass
    return 0  # a zombie has no VmRSS


def add_arrays(rng: random.Random, rows: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    gen = np.random.default_rng(rng.getrandbits(32))
    x = gen.standard_normal((rows, ADD_WIDTH), dtype=np.float32)
    y = gen.standard_normal((rows, ADD_WIDTH), dtype=np.float32)
    return x, y


def spec_json(
    name: str, rows: int, dtype: str = "float32", width: int = ADD_WIDTH
) -> dict[str, Any]:
    return {"name": name, "dtype": dtype, "shape": [rows, width]}


def frames_of(command: int, ident: bytes, header: Any, *tensors: bytes) -> list[bytes]:
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    return [wire.TAG + bytes([command]) + ident, head, *tensors]


# ---------------------------------------------------------------- mutations


def random_json(rng: random.Random, depth: int = 0) -> Any:
    """A JSON value of a random type (what a field is replaced with)."""
    kind = rng.randrange(9 if depth < 2 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 1, 2**31, 2**63, -(2**63), 10**30, 64, 65, 1024, 1025])
    if kind == 3:
        return rng.choice([0.0, -1.5, 1e308, -1e308, 5e-324, 0.5, 1e9])
    if kind == 4:
        return "".join(rng.choice(string.printable) for _ in range(rng.randrange(0, 12)))
    if kind == 5:
        return rng.choice(["", "x" * 300, "\u0000", "\ud7ff", "float32", "add", "00ff", "zz"])
    if kind == 6:
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    if kind == 7:
        return {str(rng.randrange(9)): random_json(rng, depth + 1)}
    return [[random_json(rng, depth + 1)] * rng.randrange(0, 3)]


def _mutate_json(rng: random.Random, value: Any) -> Any:
    """``value`` with one random change somewhere inside it."""
    if isinstance(value, dict) and value and rng.random() < 0.8:
        key = rng.choice(list(value))
        op = rng.randrange(4)
        out = dict(value)
        if op == 0:
            del out[key]
        elif op == 1:
            out[key] = random_json(rng)
        elif op == 2:
            out["extra" if rng.random() < 0.5 else key.upper()] = random_json(rng)
        else:
            out[key] = _mutate_json(rng, value[key])
        return out
    if isinstance(value, list) and value and rng.random() < 0.8:
        out_list = list(value)
        i = rng.randrange(len(out_list))
        op = rng.randrange(4)
        if op == 0:
            del out_list[i]
        elif op == 1:
            out_list.insert(i, random_json(rng))
        elif op == 2:
            out_list.append(out_list[i])
        else:
            out_list[i] = _mutate_json(rng, out_list[i])
        return out_list
    return random_json(rng)


OPS = [
    "envelope-id", "envelope-command", "envelope-version", "envelope-tag", "envelope-cut",
    "drop-frame", "add-frame", "duplicate-frame", "swap-frames",
    "header-bytes", "header-cut", "header-json", "header-json", "header-json",
    "header-padded", "header-oversize", "header-not-object",
    "tensor-cut", "tensor-grow", "tensor-bytes", "many-frames", "garbage",
    "nest-deep", "nest-at-limit", "row-extra", "huge-number",
]  # fmt: skip
#: The nesting, depth and shape-of-JSON mutations (issue 28): a value nested deep
#: (arrays, objects, both; closed or not) in any header field, or exactly as deep as
#: the limit allows; rows with entries after their last field; numbers no field can
#: hold; a value of another type; brackets and escapes inside a string (no depth).
NESTING_OPS = [
    "nest-deep", "nest-deep", "nest-deep", "nest-unclosed", "nest-at-limit",
    "row-extra", "row-extra", "huge-number", "wrong-type", "brackets-in-string",
]  # fmt: skip
#: Depths a nested value is given: around the limit, around where parsers recurse no
#: more (~1,000: RecursionError), and far beyond (within the 256 KiB header limit).
DEPTHS = [33, 40, 100, 500, 990, 999, 1000, 1001, 3000, 50_000]


def mutate(
    rng: random.Random, frames: list[bytes], ops: list[str] | None = None
) -> tuple[str, list[bytes]]:
    """One random mutation of a valid message's frames (of ``ops``, default all of
    OPS): its name and the new frames."""
    out = list(frames)
    op = rng.choice(ops or OPS)
    env = out[0]
    if op in NESTING_OPS and len(out) > 1:
        out[1] = mutate_shape(rng, op, out[1])
    elif op == "envelope-id":
        out[0] = env[:6] + rng.randbytes(rng.choice([0, 1, 8, 63, 64, 65, 200]))
    elif op == "envelope-command":
        out[0] = env[:5] + bytes([rng.randrange(256)]) + env[6:]
    elif op == "envelope-version":
        out[0] = env[:4] + bytes([rng.choice([0, 1, 2, 4, 255])]) + env[5:]
    elif op == "envelope-tag":
        out[0] = rng.randbytes(4) + env[4:]
    elif op == "envelope-cut":
        out[0] = env[: rng.randrange(len(env))]
    elif op == "drop-frame":
        del out[rng.randrange(len(out))]
    elif op == "add-frame":
        out.insert(rng.randrange(len(out) + 1), rng.randbytes(rng.randrange(0, 64)))
    elif op == "duplicate-frame":
        i = rng.randrange(len(out))
        out.insert(i, out[i])
    elif op == "swap-frames" and len(out) > 1:
        i, j = rng.sample(range(len(out)), 2)
        out[i], out[j] = out[j], out[i]
    elif op == "header-bytes":
        head = bytearray(out[1])
        for _ in range(rng.randrange(1, 4)):
            head[rng.randrange(len(head))] = rng.randrange(256)
        out[1] = bytes(head)
    elif op == "header-cut":
        out[1] = out[1][: rng.randrange(len(out[1]))]
    elif op == "header-json":
        out[1] = json.dumps(_mutate_json(rng, json.loads(out[1]))).encode()
    elif op == "header-padded":  # valid JSON, distinct, close to the 256 KiB limit
        pad = b" " * (rng.randrange(200, 255) * 1024) + b"\n" * rng.randrange(1000)
        out[1] = out[1][:1] + pad + out[1][1:]
    elif op == "header-oversize":
        out[1] = out[1][:1] + b" " * (257 * 1024) + out[1][1:]
    elif op == "header-not-object":
        out[1] = rng.choice([b"[]", b"null", b"1", b'"x"', b"NaN", b"{}" * 2, b"\xff\xfe"])
    elif op == "tensor-cut" and len(out) > 2:
        i = rng.randrange(2, len(out))
        out[i] = out[i][: rng.randrange(len(out[i]) + 1)]
    elif op == "tensor-grow" and len(out) > 2:
        i = rng.randrange(2, len(out))
        out[i] = out[i] + rng.randbytes(rng.choice([1, 4, 32]))
    elif op == "tensor-bytes" and len(out) > 2:  # still valid: other numbers
        i = rng.randrange(2, len(out))
        data = bytearray(out[i])
        if data:
            data[rng.randrange(len(data))] ^= 0x40
        out[i] = bytes(data)
    elif op == "many-frames":
        out += [b""] * rng.choice([63, 65, 200, 2000])
    elif op == "garbage":
        out = [rng.randbytes(rng.randrange(0, 16)) for _ in range(rng.randrange(1, 5))]
    return op, out


#: a value json.dumps writes as itself, unlike anything a header holds: where raw bytes go
_SLOT = json.dumps("\u0000slot\u0000").encode()
_ROW_KEYS = ("jobs", "requests", "results", "replies", "failures", "errors")


def mutate_shape(rng: random.Random, op: str, header: bytes) -> bytes:
    """``header`` (a valid one's JSON) with one value changed by the NESTING_OPS ``op``."""
    value = json.loads(header)
    rows = [r for key in _ROW_KEYS for r in (value.get(key) or []) if isinstance(r, list)]
    if op == "row-extra" and rows:
        row = rng.choice(rows)
        extra = rng.choice([None, 1, "x", [], {}, 2**70, "\u0000slot\u0000"])
        row.extend([extra] * rng.choice([1, 1, 2, 50]))
        return json.dumps(value).encode().replace(_SLOT, nested(rng, rng.choice(DEPTHS)))
    path = _walk(rng, value)
    if op == "wrong-type":
        return json.dumps(_put(value, path, random_json(rng))).encode()
    if op == "brackets-in-string":  # no depth: what a scan that ignores strings would see
        text = rng.choice(["[", "{", '\\"[', '"]', "\\", "["]) * rng.choice([40, 200, 1000])
        return json.dumps(_put(value, path, text)).encode()
    if op == "huge-number":
        raw = rng.choice(
            [b"9" * 19, b"9" * 400, b"9" * 5000, b"1e99999", b"-1e400", b"1" + b"0" * 310]
        )
    elif op == "nest-at-limit":  # the whole header exactly MAX_HEADER_DEPTH deep
        depth = max(1, wire.MAX_HEADER_DEPTH - len(path))
        raw = b"[" * depth + b"]" * depth
    else:
        raw = nested(rng, rng.choice(DEPTHS), closed=op != "nest-unclosed")
    return json.dumps(_put(value, path, "\u0000slot\u0000")).encode().replace(_SLOT, raw, 1)


def nested(rng: random.Random, depth: int, closed: bool = True) -> bytes:
    """A JSON value ``depth`` deep: arrays, objects, or both in turn; ``closed`` or not."""
    unit, inner, end = rng.choice(
        [(b"[", b"", b"]"), (b'{"k":', b"1", b"}"), (b'[{"k":', b"1", b"}]")]
    )
    count = depth // len(end)
    return unit * count + (inner + end * count if closed else b"")


def _walk(rng: random.Random, value: Any) -> list[Any]:
    """A random path from the root into ``value``: a field, an entry, a row, a leaf."""
    path: list[Any] = []
    while isinstance(value, (dict, list)) and value and (not path or rng.random() < 0.7):
        step = rng.choice(list(value)) if isinstance(value, dict) else rng.randrange(len(value))
        path.append(step)
        value = value[step]
    return path or ["extra"]


def _put(value: Any, path: list[Any], new: Any) -> Any:
    """``value`` with ``new`` at ``path`` (in place: a header is parsed afresh each time)."""
    target = value
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = new
    return value


def header_depth(raw: bytes) -> int:
    """How deep a JSON parser nests reading ``raw``: an oracle that shares nothing with
    the codec's scan (a loop over the bytes, slow, so only run past a bracket count
    within the limit, which it returns as the bound it is)."""
    if raw.count(b"[") + raw.count(b"{") <= wire.MAX_HEADER_DEPTH:
        return raw.count(b"[") + raw.count(b"{")
    depth = deepest = 0
    in_string = escaped = False
    for byte in raw:
        if in_string:
            escaped, in_string = (False, True) if escaped else (byte == 0x5C, byte != 0x22)
        elif byte == 0x22:
            in_string = True
        elif byte in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif byte in b"]}":
            depth -= 1
            if depth < 0:
                break  # a parser stops here
    return deepest


def decodes(frames: list[bytes]) -> tuple[wire.Message | None, str]:
    """The message ``frames`` decode to (None if malformed), and why not."""
    try:
        return wire.decode(frames), ""
    except Exception as error:  # every decoder error means "malformed"
        return None, f"{type(error).__name__}: {error}"


def envelope_id(frames: list[bytes]) -> bytes:
    """The id an ERROR for ``frames`` must carry: the envelope's when it can be read (the
    tag, then at most 64 bytes after version and command), else none (docs/protocol.md
    §4: "empty if it carried none or a bad one")."""
    head = frames[0] if frames else b""
    readable = head[:4] == wire.PROTOCOL_TAG and 6 <= len(head) <= 6 + 64
    return head[6:] if readable else b""


def row_ids(frames: list[bytes]) -> set[bytes]:
    """The request ids a batch (REQUESTS, or another batch sent to the frontend) still
    names, as far as it can be read: its envelope intact, its header at most 256 KiB of
    JSON, each id hex of at most 64 bytes. The broker answers each with an ERROR
    (docs/protocol.md §4)."""
    ids: set[bytes] = set()
    batches = [Command.REQUESTS, Command.REPLIES, Command.JOBS, Command.RESULTS]
    if len(frames) < 2 or len(frames[0]) > 6 + 64:
        return ids
    if not any(frames[0].startswith(wire.TAG + bytes([batch])) for batch in batches):
        return ids  # (any batch's rows are read: a JOBS sent to the frontend names ids too)
    if len(frames[1]) > wire.DEFAULT_LIMITS.max_header_bytes:
        return ids
    if header_depth(frames[1]) > wire.MAX_HEADER_DEPTH:
        return ids  # refused unread: docs/protocol.md §3
    try:
        header = json.loads(frames[1])
    except (ValueError, RecursionError):
        return ids
    for key in ("requests", "replies", "errors", "jobs", "results", "failures"):
        rows = header.get(key) if isinstance(header, dict) else None
        for row in rows if isinstance(rows, list) else []:
            first = row[0] if isinstance(row, list) and row else None
            for value in first if isinstance(first, list) else [first]:
                if isinstance(value, str) and len(value) <= 128:
                    try:
                        ids.add(bytes.fromhex(value))
                    except ValueError:
                        pass
    return ids
