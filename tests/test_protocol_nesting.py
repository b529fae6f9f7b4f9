"""Headers are bounded in nesting depth as they are in bytes (issue 28, item 4).

A header 1,000 deep once made msgspec raise RecursionError, in the decoder's error
path and again in ``peek_ids``, outside any guard: it killed the broker, and would
have killed a worker. The depth is now measured before anything parses a header; the
measure is checked here against a reference that parses, and every command's decoder
(what broker, worker and client all call) is shown to refuse such a header cleanly.
Also: batch rows have exactly their entries, and the error path never raises.
"""

from __future__ import annotations

import json
import random
from typing import Any

import msgspec
import pytest

from ipuserve import protocol as wire
from ipuserve.errors import ProtocolError
from ipuserve.protocol import batches, client_messages, control, worker_messages
from ipuserve.protocol.codec import nesting, too_deep

DEEP = 1000
#: the issue's repro: a REQUESTS row whose id nests 1,000 deep
REPRO = b'{"specs":[],"requests":[[' + b"[" * DEEP + b"]" * DEEP + b",0,null]]}"


def depth_of(value: Any) -> int:
    """The reference: the depth of a parsed JSON value (a scalar is 0 deep)."""
    if isinstance(value, dict):
        return 1 + max((depth_of(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((depth_of(v) for v in value), default=0)
    return 0


def random_value(rng: random.Random, depth: int) -> Any:
    """JSON with strings full of brackets, quotes and backslashes, to fool a scan."""
    kind = rng.randrange(5 if depth < 12 else 3)
    if kind == 0:
        return rng.choice([0, -1.5, None, True, 10**30])
    if kind in (1, 2):
        return "".join(rng.choice('[]{}"\\ab\n\u00e9') for _ in range(rng.randrange(8)))
    if kind == 3:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = ["".join(rng.choice('[{"\\k') for _ in range(3)) for _ in range(rng.randrange(4))]
    return {key: random_value(rng, depth + 1) for key in keys}


def test_the_measure_is_the_depth_a_parser_finds() -> None:
    rng = random.Random(28)
    for _ in range(2000):
        value = random_value(rng, 0)
        raw = json.dumps(value, ensure_ascii=rng.random() < 0.5).encode()
        assert nesting(raw) == depth_of(value), raw


@pytest.mark.parametrize(
    ("raw", "least"),
    [
        (b"[" * DEEP, DEEP),  # never closed: a parser recurses all the same
        (b'{"a":' * DEEP, DEEP),
        (b'["x\\"' + b"[" * DEEP, 1),  # all inside a string that never ends
        (b'["x\\\\"' + b"[" * DEEP, DEEP + 1),  # the string ends: \\ is one backslash
        (b"[1]]]]]]]]" + b"[" * DEEP, DEEP - 8),  # nothing is read after the first ]
    ],
)
def test_what_is_no_json_measures_at_least_what_a_parser_reaches(raw: bytes, least: int) -> None:
    assert nesting(raw) >= least


def test_the_limit_holds_every_declared_header_with_room() -> None:
    """The deepest header any command declares, read from the structs themselves."""
    kinds = [*client_messages.MESSAGES, *worker_messages.MESSAGES, *batches.MESSAGES]
    headers = [getattr(kind, "HEADER", kind) for kind in (*kinds, *control.MESSAGES)]
    assert len(headers) == len(wire.Command)
    deepest = max(_declared_depth(msgspec.inspect.type_info(header)) for header in headers)
    assert 4 <= deepest <= wire.MAX_HEADER_DEPTH // 4


def _declared_depth(info: msgspec.inspect.Type, seen: frozenset[type] = frozenset()) -> int:
    inspect = msgspec.inspect
    if isinstance(info, inspect.Metadata):
        return _declared_depth(info.type, seen)
    if isinstance(info, inspect.UnionType):
        return max(_declared_depth(t, seen) for t in info.types)
    if isinstance(info, inspect.StructType):
        assert info.cls not in seen, f"{info.cls} is recursive: unbounded"
        inner = [_declared_depth(f.type, seen | {info.cls}) for f in info.fields]
        return 1 + max(inner, default=0)
    if isinstance(info, inspect.DictType):
        return 1 + _declared_depth(info.value_type, seen)
    if isinstance(info, inspect.TupleType):
        return 1 + max((_declared_depth(t, seen) for t in info.item_types), default=0)
    if isinstance(info, (inspect.ListType, inspect.VarTupleType, inspect.SetType)):
        return 1 + _declared_depth(info.item_type, seen)
    return 0


@pytest.mark.parametrize("command", list(wire.Command), ids=lambda c: c.name)
@pytest.mark.parametrize("opener", [b"[", b'{"a":'], ids=["arrays", "objects"])
def test_every_decoder_refuses_a_deep_header_before_parsing_it(
    command: wire.Command, opener: bytes
) -> None:
    """What broker, worker and client decode: a clean ProtocolError, and no ids read
    (the error path parses nothing the limit refused)."""
    closer = b"]" if opener == b"[" else b"}"
    header = b'{"x":' + opener * DEEP + b"1" + closer * DEEP + b"}"
    frames = [wire.envelope(command, b"id"), header]
    with pytest.raises(ProtocolError, match=rf"nests {DEEP + 1} deep; the limit is 32"):
        wire.decode(frames)
    assert wire.peek_ids(frames) == []
    assert wire.peek_id(frames) == b"id"


def test_the_repro_is_refused_and_its_ids_are_not_read() -> None:
    frames = [wire.envelope(wire.Command.REQUESTS), REPRO]
    with pytest.raises(ProtocolError, match="REQUESTS header nests 1003 deep"):
        wire.decode(frames)
    assert wire.peek_ids(frames) == []


def test_a_header_at_the_limit_is_parsed_one_past_it_is_not() -> None:
    limit = wire.MAX_HEADER_DEPTH

    def timing(depth: int) -> bytes:  # a RESULTS row's timing value, depth levels in all
        value = b"[" * (depth - 4) + b"]" * (depth - 4)
        return b'{"specs":[],"results":[["01",0,{"a":' + value + b"}]]}"

    assert too_deep(timing(limit)) is None
    with pytest.raises(ProtocolError, match=r"\$\.results\[0\]\.timing\["):
        wire.decode([wire.envelope(wire.Command.RESULTS), timing(limit)])  # a type error
    assert too_deep(timing(limit + 1)) == limit + 1
    with pytest.raises(ProtocolError, match=f"nests {limit + 1} deep"):
        wire.decode([wire.envelope(wire.Command.RESULTS), timing(limit + 1)])


def test_a_batch_of_many_rows_is_measured_not_refused() -> None:
    """Over 32 brackets takes the slow path: a full batch must still pass it."""
    rows = [[f"{n:08x}", 0, None] for n in range(1024)]
    header = json.dumps({"specs": [{"model": "m", "tensors": []}], "requests": rows}).encode()
    assert too_deep(header) is None
    message = wire.decode([wire.envelope(wire.Command.REQUESTS), header])
    assert isinstance(message, wire.Requests) and len(message.requests) == 1024


@pytest.mark.parametrize(
    ("command", "header", "message"),
    [
        (
            wire.Command.REQUESTS,
            b'{"specs":[],"requests":[["01",0,null],["02",0,null,1]]}',
            "$.requests[1] has 4 entries; at most 3 (a row is [request_id, spec, timeout_ms])",
        ),
        (
            wire.Command.JOBS,
            b'{"specs":[],"jobs":[["01",0,null,1,1,"x"]]}',
            "$.jobs[0] has 6 entries; at most 5 (a row is [job_id, spec, budget_ms, members, "
            "samples])",
        ),
        (
            wire.Command.RESULTS,
            b'{"specs":[],"results":[["01",0,{},1]],"failures":[["02","X","m",'
            + b"[" * 20
            + b"]" * 20
            + b"]]}",
            "$.failures[0] has 4 entries; at most 3 (a row is [job_id, code, message])",
        ),
        (
            wire.Command.REPLIES,
            b'{"specs":[],"replies":[["01",0,{},"1",null]]}',
            "$.replies[0] has 5 entries; at most 4 (a row is [request_id, spec, timing, version])",
        ),
    ],
    ids=["REQUESTS", "JOBS", "RESULTS failures", "REPLIES"],
)
def test_a_batch_row_with_an_entry_after_its_last_field_is_refused(
    command: wire.Command, header: bytes, message: str
) -> None:
    """docs/protocol.md §3: rows have exactly their entries (msgspec skipped extra ones,
    however deep, unread)."""
    with pytest.raises(ProtocolError) as info:
        wire.decode([wire.envelope(command), header])
    assert str(info.value) == f"{command.name} header: {message}"


@pytest.mark.parametrize(
    "value",
    [b"1e" + b"9" * 5000, b"9" * 5000, b"-1e99999", b"1" + b"0" * 400],
    ids=["exponent", "digits", "negative exponent", "400 digits"],
)
def test_a_huge_number_is_refused_and_the_refusal_never_raises(value: bytes) -> None:
    """The error path reads the value again to quote it: a number Decimal cannot hold
    (InvalidOperation) made it raise instead of refuse."""
    header = b'{"model":"m","tensors":[],"timeout_ms":' + value + b"}"
    with pytest.raises(ProtocolError, match=r"timeout_ms"):
        wire.decode([wire.envelope(wire.Command.REQUEST, b"r"), header])
