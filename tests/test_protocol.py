"""ipuserve.protocol: every command round-trips; every validation rule rejects what it should."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

from ipuserve import protocol as p
from ipuserve.errors import (
    InvalidInputError,
    IpuserveError,
    OverloadedError,
    PayloadTooLargeError,
    ProtocolError,
    UnsupportedVersionError,
    WorkerFailedError,
)

SPEC = p.ModelSpec(
    "add",
    inputs=(p.TensorSpec("a", "float32", (4, 3)), p.TensorSpec("b", "int64", (4,))),
    outputs=(p.TensorSpec("y", "float32", (4, 3)),),
    batch_size=4,
    batching_dim=0,
)


def tensors(**arrays: Any) -> p.Tensors:
    return p.Tensors.of(arrays)


ROUND_TRIPS: list[p.Message] = [
    p.Request(b"r1", "add", tensors(a=np.ones((2, 3), np.float32)), timeout_ms=250.0),
    p.Request(b"", "m", tensors()),
    p.Reply(b"r1", tensors(y=np.arange(6.0).reshape(2, 3)), {"broker_queue_us": 12.0}),
    p.ErrorReply(b"r1", "OVERLOADED", "model 'add' has 1000 queued requests"),
    p.ListModels(b"q"),
    p.ModelsReply(b"q", (p.ModelInfo(SPEC, 3, (p.WorkerLoad("host:1", 8, 2, 3),)),)),
    p.Ping(b"x"),
    p.Pong(b"x", "9f8e"),
    p.Hello("host:1", (SPEC,), 8),
    p.Welcome("9f8e", 1000, 3000),
    p.Welcome("9f8e", 1000, 3000, refused=(("m", "model 'm' is served with another schema"),)),
    p.Jobs((p.Job(b"\x00\x01", "add", tensors(a=np.zeros((1, 3), np.float32)), -5.0, 1),)),
    p.Jobs(
        (
            p.Job(b"\x00\x01", "add", tensors(a=np.zeros((1, 3), np.float32)), 12.25, 1),
            p.Job(b"\x00\x02", "add", tensors(), budget_ms=None, samples=1),
            p.Job(b"", "m", tensors(b=np.arange(3), a=np.ones(1, np.float32)), 7.0, 3),
            p.Job(b"\x00\x03", "add", tensors(a=np.ones((1, 3), np.float32)), 1e-3, 1),
        )
    ),
    p.Results(
        (p.Result(b"\x00\x01", tensors(y=np.zeros((1, 3), np.float32)), {"device_us": 3.5}),)
    ),
    p.Results(failures=(p.Fail(b"\x00\x01", "INFERENCE_FAILED", "boom"),)),
    p.Results(
        (
            p.Result(b"\x01", tensors(y=np.zeros((1, 3), np.float32)), {"device_us": 3.5}),
            p.Result(b"\x02", tensors(), {}),
            p.Result(b"\x03", tensors(y=np.ones((1, 3), np.float32)), {"a": 1.0, "b": 2.0}),
        ),
        (p.Fail(b"\x04", "DEADLINE_EXCEEDED", "late"), p.Fail(b"\x05", "OVERLOADED", "full")),
    ),
    p.Requests(
        (
            p.Request(b"r1", "add", tensors(a=np.ones((2, 3), np.float32)), timeout_ms=250.0),
            p.Request(b"r2", "add", tensors(a=np.zeros((1, 3), np.float32))),
            p.Request(b"r3", "m", tensors(b=np.arange(3)), 0.5),
        )
    ),
    p.Replies(
        (
            p.Reply(b"r1", tensors(y=np.arange(6.0).reshape(2, 3)), {"broker_queue_us": 12.0}),
            p.Reply(b"r3", tensors(), {}),
        ),
        (p.Fail(b"r2", "OVERLOADED", "full"),),
    ),
    p.Heartbeat(in_flight=3),
    p.Heartbeat(in_flight=0, credit=0),
    p.Heartbeat(),
    p.Reconnect(),
    p.Bye((b"\x00\x01", b"\xff" * 8)),
]


def _same(a: Any, b: Any) -> bool:
    """Equal messages, comparing tensors by their specs and values (frames differ in type)."""
    if isinstance(a, p.Jobs | p.Results | p.Requests | p.Replies):
        items_a, items_b = _items(a), _items(b)
        return len(items_a) == len(items_b) and all(map(_same, items_a, items_b))
    tensors_a = getattr(a, "tensors", None)
    if tensors_a is None:
        return bool(a == b)
    arrays_a, arrays_b = tensors_a.arrays(), b.tensors.arrays()
    same_arrays = arrays_a.keys() == arrays_b.keys() and all(
        np.array_equal(arrays_a[k], arrays_b[k]) and arrays_a[k].dtype == arrays_b[k].dtype
        for k in arrays_a
    )
    # the other fields that take part in equality
    others = [f.name for f in dataclasses.fields(a) if f.compare and f.name != "tensors"]
    same_others = all(getattr(a, f) == getattr(b, f) for f in others)
    return same_arrays and tensors_a.specs == b.tensors.specs and same_others


def _items(batch: p.Jobs | p.Results | p.Requests | p.Replies) -> list[Any]:
    if isinstance(batch, p.Jobs):
        return [*batch.jobs, *batch.rejected]
    if isinstance(batch, p.Requests):
        return [*batch.requests, *batch.rejected]
    if isinstance(batch, p.Replies):
        return [*batch.replies, *batch.errors]
    return [*batch.results, *batch.failures]


@pytest.mark.parametrize("message", ROUND_TRIPS, ids=lambda m: type(m).__name__)
def test_every_command_round_trips_in_process(message: p.Message) -> None:
    assert _same(p.decode(message.encode()), message)


@pytest.mark.parametrize("message", ROUND_TRIPS, ids=lambda m: type(m).__name__)
def test_every_command_round_trips_over_zeromq(
    message: p.Message, pair: tuple[zmq.Socket[Any], zmq.Socket[Any]]
) -> None:
    sender, receiver = pair
    sender.send_multipart(message.encode(), copy=False)
    assert _same(p.decode(receiver.recv_multipart(copy=False)), message)


_PAIRS = itertools.count()


@pytest.fixture
def pair() -> Any:
    context = zmq.Context.instance()
    a, b = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    address = f"inproc://protocol-test-{next(_PAIRS)}"  # an inproc name frees asynchronously
    a.bind(address)
    b.connect(address)
    yield a, b
    a.close(linger=0)
    b.close(linger=0)


def test_received_tensors_are_read_only_views_of_the_frames(pair: Any) -> None:
    sender, receiver = pair
    big = np.arange(1 << 16, dtype=np.float32)
    sender.send_multipart(p.Request(b"r", "m", tensors(x=big)).encode(), copy=False)
    frames = receiver.recv_multipart(copy=False)
    view = p.decode(frames).tensors.arrays()["x"]  # type: ignore[union-attr]
    assert not view.flags.writeable
    assert np.array_equal(view, big)
    assert np.shares_memory(view, np.frombuffer(frames[2].buffer, np.uint8))


def test_contiguous_arrays_are_sent_as_they_are_and_others_made_contiguous_once() -> None:
    a = np.ones((4, 4), np.float32)
    t = tensors(a=a, b=a.T, c=a.astype(">f4"))
    assert t.frames[0] is a
    assert t.frames[1].flags.c_contiguous  # type: ignore[union-attr]
    assert t.frames[2].dtype.byteorder in "<="  # type: ignore[union-attr]
    assert [s.dtype for s in t.specs] == ["float32"] * 3
    assert np.array_equal(p.decode(p.Request(b"", "m", t).encode()).tensors.arrays()["b"], a.T)  # type: ignore[union-attr]


def test_error_reply_turns_back_into_the_same_exception_type() -> None:
    frames = p.error_frames(b"r9", OverloadedError("queue full"))
    reply = p.decode(frames)
    assert isinstance(reply, p.ErrorReply) and reply.request_id == b"r9"
    error = reply.exception()
    assert type(error) is OverloadedError and str(error) == "queue full"
    unknown = p.ErrorReply(b"", "SOMETHING_NEW", "x").exception()
    assert type(unknown) is IpuserveError


def test_encoding_an_unsupported_dtype_is_an_invalid_input() -> None:
    with pytest.raises(InvalidInputError, match="complex64"):
        tensors(z=np.zeros(2, np.complex64))


# ---------------------------------------------------------------- validation


def frames_with(
    header: dict[str, Any] | bytes, *tensor_frames: bytes, cmd: int = 0x01
) -> list[Any]:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return [p.envelope(p.Command(cmd), b"id"), raw, *tensor_frames]


def request(shape: Any = (2,), dtype: Any = "float32", **extra: Any) -> dict[str, Any]:
    spec = {
        "name": "x",
        "dtype": dtype,
        "shape": list(shape) if isinstance(shape, tuple) else shape,
    }
    return {"model": "m", "tensors": [spec], **extra}


F8 = bytes(8)
LIMITS = p.Limits(
    max_payload_bytes=1024,
    max_header_bytes=512,
    max_tensors=3,
    max_rank=3,
    max_elements=10_000,
    max_batch=4,
)

SPEC_X = {"name": "x", "dtype": "float32", "shape": [2]}
#: more tensors than LIMITS allows
MANY = [{**SPEC_X, "name": f"x{i}"} for i in range(4)]
JOBS, RESULTS = 0x12, 0x13
REQUESTS, REPLIES = 0x08, 0x09


def jobs(*rows: Any, specs: Any = None) -> dict[str, Any]:
    return {
        "specs": [{"model": "m", "tensors": [SPEC_X]}] if specs is None else specs,
        "jobs": [_full(row) for row in rows],
    }


def _full(row: Any) -> Any:
    """A JOBS row as a test writes it, ``[id, spec, budget(, members)]``, with the
    members and samples (1) that version 4 requires added."""
    return [*row, 1, 1][:5] if isinstance(row, list) and len(row) in (3, 4) else row


def results(*rows: Any, **extra: Any) -> dict[str, Any]:
    return {"specs": [[SPEC_X]], "results": list(rows), **extra}


BAD: list[tuple[str, list[Any], type[IpuserveError], str]] = [
    ("empty message", [b""], ProtocolError, "at least 2 frames"),
    ("one frame", [p.envelope(p.Command.PING)], ProtocolError, "at least 2 frames"),
    ("wrong tag", [b"HTTP/\x01", b"{}"], ProtocolError, "must be an envelope"),
    ("no command", [b"IPUS\x05", b"{}"], ProtocolError, "must be an envelope"),
    ("wrong version", [b"IPUS\x09\x06", b"{}"], UnsupportedVersionError, "version 9"),
    ("version 1", [b"IPUS\x01", b"\x06", b"", b"{}"], UnsupportedVersionError, "version 1"),
    ("unknown command", [b"IPUS\x05\xee", b"{}"], ProtocolError, "unknown command 0xee"),
    ("retired FAIL", [b"IPUS\x05\x14", b"{}"], ProtocolError, "unknown command 0x14"),
    ("id too long", [b"IPUS\x05\x06" + b"i" * 65, b"{}"], ProtocolError, "id is 65 bytes"),
    (
        "huge envelope",
        [b"IPUS\x01\x06" + b"i" * 100_000, b"{}"],
        UnsupportedVersionError,
        "version 1",
    ),
    ("header too big", frames_with(b"{" + b" " * 600 + b"}"), ProtocolError, "header is 602"),
    ("header not utf-8", frames_with(b"\xff\xfe"), ProtocolError, "UTF-8 JSON"),
    ("header not json", frames_with(b"{model:"), ProtocolError, "UTF-8 JSON"),
    (
        "header NaN",
        frames_with(b'{"model":"m","tensors":[],"timeout_ms":NaN}'),
        ProtocolError,
        "UTF-8 JSON",
    ),
    ("header not object", frames_with(b"[1,2]"), ProtocolError, "Expected `object`, got `array`"),
    (
        "missing field",
        frames_with({"tensors": []}),
        ProtocolError,
        "missing required field `model`",
    ),
    ("unknown field", frames_with({**request(), "x": 1}, F8), ProtocolError, "unknown field"),
    (
        "wrong field type",
        frames_with({"model": 5, "tensors": []}),
        ProtocolError,
        "$.model is 5; it must be a string",
    ),
    (
        "empty model name",
        frames_with({"model": "", "tensors": []}),
        ProtocolError,
        '$.model is ""; it must be a string of length >= 1',
    ),
    ("timeout zero", frames_with(request(timeout_ms=0), F8), ProtocolError, "> 0"),
    (
        "timeout bool",
        frames_with(request(timeout_ms=True), F8),
        ProtocolError,
        "$.timeout_ms is true; it must be a number or null",
    ),
    (
        "tensors not list",
        frames_with({"model": "m", "tensors": {}}),
        ProtocolError,
        "$.tensors is {}; it must be a list",
    ),
    (
        "too many tensors listed",
        frames_with({"model": "m", "tensors": [{**SPEC_X, "name": f"x{i}"} for i in range(4)]}),
        ProtocolError,
        "limit is 3",
    ),
    (
        "tensor spec fields",
        frames_with({"model": "m", "tensors": [{"name": "x"}]}),
        ProtocolError,
        "missing required field `dtype` - at `$.tensors[0]`",
    ),
    (
        "dtype not allowed",
        frames_with(request(dtype="complex64"), F8),
        InvalidInputError,
        "complex64",
    ),
    ("dtype object", frames_with(request(dtype="object"), F8), InvalidInputError, "allowed"),
    (
        "negative dim",
        frames_with(request(shape=(-1,))),
        InvalidInputError,
        "$.tensors[0].shape[0] is -1; it must be >= 0",
    ),
    (
        "float dim",
        frames_with(request(shape=[2.0]), F8),
        InvalidInputError,
        "shape[0] is 2.0; it must be an integer",
    ),
    (
        "bool dim",
        frames_with(request(shape=[True]), F8),
        InvalidInputError,
        "shape[0] is true; it must be an integer",
    ),
    (
        "shape not list",
        frames_with(request(shape="2")),
        InvalidInputError,
        '$.tensors[0].shape is "2"; it must be a list',
    ),
    ("rank too big", frames_with(request(shape=(1, 1, 1, 1)), F8), InvalidInputError, "at most 3"),
    (
        "huge shape",
        frames_with(request(shape=(1 << 62, 1 << 62, 1 << 62))),
        InvalidInputError,
        "has a dimension above 10000",
    ),
    (
        "many elements",
        frames_with(request(shape=(100, 101))),
        InvalidInputError,
        "more than 10000 elements",
    ),
    (  # 0 bytes, so it passed; numpy then refused the view, deep in a broker or client
        "huge dimension beside a zero",
        frames_with(request(shape=(0, 1 << 64))),
        InvalidInputError,
        "has a dimension above 10000",
    ),
    (
        "duplicate names",
        frames_with({"model": "m", "tensors": [request()["tensors"][0]] * 2}),
        InvalidInputError,
        "twice",
    ),
    ("frames missing", frames_with(request()), ProtocolError, "1 tensor(s) but 0"),
    ("frames extra", frames_with(request(), F8, F8), ProtocolError, "1 tensor(s) but 2"),
    ("too many frames", frames_with(request(), F8, F8, F8, F8), ProtocolError, "at most 3"),
    ("byte count", frames_with(request(), bytes(7)), InvalidInputError, "needs 8 bytes"),
    (
        "payload too large",
        frames_with(request(shape=(300,)), bytes(1200)),
        PayloadTooLargeError,
        "limit is 1024",
    ),
    ("tensors on a PING", frames_with({}, F8, cmd=0x06), ProtocolError, "at most 0"),
    (
        "bad error code",
        frames_with({"code": "lower", "message": ""}, cmd=0x03),
        ProtocolError,
        "$.code is \"lower\"; it must be a string matching regex '^[A-Z0-9_]*[A-Z][A-Z0-9_]*$'",
    ),
    ("bad bye id", frames_with({"handed_back": ["zz"]}, cmd=0x17), ProtocolError, "hex job id"),
    (
        "negative credit",
        frames_with({"worker_id": "w", "credit": -1, "models": []}, cmd=0x10),
        ProtocolError,
        ">= 0",
    ),
    (
        "bad model spec",
        frames_with({"worker_id": "w", "credit": 1, "models": [{}]}, cmd=0x10),
        ProtocolError,
        "missing required field `name` - at `$.models[0]`",
    ),
    (
        "batching dim out of rank",
        frames_with(
            {"worker_id": "w", "credit": 1, "models": [{**SPEC.to_json(), "batching_dim": 2}]},
            cmd=0x10,
        ),
        ProtocolError,
        "batching_dim 2",
    ),
    (
        "timing not numbers",
        frames_with({"tensors": [], "timing": {"a": "x"}}, cmd=0x02),
        ProtocolError,
        '$.timing["a"] is "x"; it must be a number',
    ),
    (
        "jobs not rows",
        frames_with(jobs("x"), cmd=JOBS),
        ProtocolError,
        '$.jobs[0] is "x"; it must be a list (a row is [job_id, spec',
    ),
    (
        "job row short",
        frames_with(jobs(["01", 0]), F8, cmd=JOBS),
        ProtocolError,
        '$.jobs[0] is ["01",0]; it must be a list of at least length 5 (a row is [job_id, spec, ',
    ),
    (
        "job group of no members",
        frames_with(jobs(["01", 0, None, 0]), F8, cmd=JOBS),
        ProtocolError,
        "$.jobs[0].members is 0; it must be >= 1",
    ),
    (
        "job group members not a number",
        frames_with(jobs(["01", 0, None, "2"]), F8, cmd=JOBS),
        ProtocolError,
        '$.jobs[0].members is "2"; it must be an integer',
    ),
    (
        "job group frames missing",
        frames_with(jobs(["01", 0, None, 2]), cmd=JOBS),
        ProtocolError,
        "JOBS header lists 1 tensor(s) but 0 tensor frame(s)",
    ),
    (
        "job id not hex",
        frames_with(jobs(["zz", 0, None]), F8, cmd=JOBS),
        ProtocolError,
        "not a hex job id",
    ),
    (
        "job spec index",
        frames_with(jobs(["01", 0, None], ["02", 1, None]), F8, F8, cmd=JOBS),
        ProtocolError,
        "jobs[1] names spec 1; the header lists 1",
    ),
    (
        "job spec not a spec",
        frames_with(jobs(["01", 0, None], specs=[{"model": "m"}]), F8, cmd=JOBS),
        ProtocolError,
        "missing required field `tensors` - at `$.specs[0]`",
    ),
    (
        "job budget bool",
        frames_with(jobs(["01", 0, True]), F8, cmd=JOBS),
        ProtocolError,
        "$.jobs[0].budget_ms is true; it must be a number or null",
    ),
    (
        "job frames missing",
        frames_with(jobs(["01", 0, None], ["02", 0, None]), F8, cmd=JOBS),
        ProtocolError,
        "JOBS header lists 2 tensor(s) but 1",
    ),
    (
        "too many jobs",
        frames_with(jobs(*[["01", 0, None]] * 5), *[F8] * 5, cmd=JOBS),
        ProtocolError,
        "limit is 4",
    ),
    (
        "jobs missing",
        frames_with({"specs": []}, cmd=JOBS),
        ProtocolError,
        "missing required field `jobs`",
    ),
    (
        "result timing",
        frames_with(results(["01", 0, {"a": None}]), F8, cmd=RESULTS),
        ProtocolError,
        '$.results[0].timing["a"] is null; it must be a number',
    ),
    (
        "result spec index",
        frames_with(results(["01", 3, {}]), F8, cmd=RESULTS),
        ProtocolError,
        "results[0] names spec 3",
    ),
    (
        "failure row",
        frames_with(results(failures=[["01", "lower", "x"]]), cmd=RESULTS),
        ProtocolError,
        '$.failures[0].code is "lower"; it must be a string matching regex',
    ),
    (
        "failure message",
        frames_with(results(failures=[["01", "X", 5]]), cmd=RESULTS),
        ProtocolError,
        "$.failures[0].message is 5; it must be a string",
    ),
    (
        "welcome zero heartbeat",
        frames_with({"epoch": "e", "heartbeat_ms": 0, "liveness_ms": 1}, cmd=0x11),
        ProtocolError,
        ">= 1",
    ),
    (
        "welcome refusal not a pair",
        frames_with(
            {
                "epoch": "e",
                "heartbeat_ms": 1,
                "liveness_ms": 1,
                "max_payload_bytes": 1,
                "refused": [["m"]],
            },
            cmd=0x11,
        ),
        ProtocolError,
        '$.refused[0] is ["m"]; it must be a list of length 2',
    ),
]


@pytest.mark.parametrize(
    ("frames", "error", "message"), [b[1:] for b in BAD], ids=[b[0] for b in BAD]
)
def test_decode_rejects(frames: list[Any], error: type[IpuserveError], message: str) -> None:
    with pytest.raises(error) as info:
        p.decode(frames, LIMITS)
    assert type(info.value) is error
    assert message in str(info.value)


def test_peek_id_addresses_replies_to_malformed_messages() -> None:
    assert p.peek_id([p.envelope(p.Command.REQUEST, b"req-7"), b"junk"]) == b"req-7"
    assert p.peek_id([b"IPUS\x09\x01v9-id"]) == b"v9-id"  # told which version we speak
    assert p.peek_id([b""]) == b""
    assert p.peek_id([]) == b""
    assert p.peek_id([b"HTTP/1.1 id"]) == b""
    assert p.peek_id([p.envelope(p.Command.REQUEST, b"i" * 65)]) == b""


def test_peek_ids_names_the_jobs_of_a_batch_that_cannot_be_decoded() -> None:
    header = jobs(["01", 0, None], ["zz", 0, None], "junk", ["0a0b", 9])
    assert p.peek_ids(frames_with(header, cmd=JOBS)) == [b"\x01", b"\x0a\x0b"]
    failed = results(["02", 0, {}], failures=[["03", "X", "y"]])
    assert p.peek_ids(frames_with(failed, cmd=RESULTS)) == [b"\x02", b"\x03"]
    assert p.peek_ids(frames_with(b"{not json", cmd=JOBS)) == []
    assert p.peek_ids(frames_with(header, cmd=0x01)) == []  # not a batch
    assert p.peek_ids([b"IPUS\x05\x12"]) == []


def test_peek_ids_names_the_requests_of_a_client_batch_that_cannot_be_decoded() -> None:
    header = {"specs": [], "requests": [["01", 0, None], "junk", ["0a", 3, 1.0]]}
    assert p.peek_ids(frames_with(header, cmd=REQUESTS)) == [b"\x01", b"\x0a"]
    replied = {"specs": [], "replies": [["02", 0, {}]], "errors": [["03", "X", "y"]]}
    assert p.peek_ids(frames_with(replied, cmd=REPLIES)) == [b"\x02", b"\x03"]


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([["01", 0, 0.0]], "$.requests[0].timeout_ms is 0.0; it must be > 0.0"),  # never spent
        ([["01", 0, -5.0]], "$.requests[0].timeout_ms is -5.0; it must be > 0.0"),
        (
            [["01", 0]],
            '$.requests[0] is ["01",0]; it must be a list of at least length 3 (a row is ',
        ),
        ([[[], 0, None]], "a group lists no ids"),
        ([[["01", "01"], 0, None]], "a group lists an id twice"),
        ([[["01", 7], 0, None]], "$.requests[0].request_id[1] is 7; it must be a string"),
        ([[["01", "zz"], 0, None]], "not a hex job id"),
        ([["xy", 0, None]], "not a hex job id"),
        ([["01", 1, None]], "names spec 1"),
    ],
)
def test_bad_requests_rows_are_refused_with_where(rows: list[Any], message: str) -> None:
    header = {"specs": [{"model": "m", "tensors": [SPEC_X]}], "requests": rows}
    with pytest.raises(ProtocolError, match=re.escape(message)):
        p.decode(frames_with(header, F8, cmd=REQUESTS), LIMITS)


def test_a_request_of_a_batch_whose_frames_do_not_match_is_rejected_alone() -> None:
    good = tensors(x=np.zeros(2, np.float32))
    batch = p.Requests((p.Request(b"a", "m", good, 5.0), p.Request(b"b", "m", good)))
    frames = batch.encode()
    frames[3] = b"\0" * 3
    decoded = p.decode(frames)
    assert isinstance(decoded, p.Requests)
    assert [(r.request_id, r.timeout_ms) for r in decoded.requests] == [(b"a", 5.0)]
    assert [(f.job_id, f.code) for f in decoded.rejected] == [(b"b", "INVALID_INPUT")]


def test_a_client_batch_too_big_for_the_broker_is_split() -> None:
    x = tensors(x=np.zeros(2, np.float32))
    batch = p.Requests(tuple(p.Request(bytes([i]) * 20, "m", x, 1.5) for i in range(9)))
    parts = [p.decode(frames, LIMITS) for frames in p.encode_batch(batch, LIMITS)]
    assert len(parts) > 2
    got = [r.request_id for part in parts for r in part.requests]  # type: ignore[union-attr]
    assert got == [r.request_id for r in batch.requests]


def test_a_job_whose_frames_do_not_match_is_rejected_alone() -> None:
    good = tensors(x=np.zeros(2, np.float32))
    frames = p.Jobs((p.Job(b"a", "m", good, 5.0, 1), p.Job(b"b", "m", good, None, 1))).encode()
    frames[2] = b"\0" * 7
    decoded = p.decode(frames)
    assert isinstance(decoded, p.Jobs)
    assert [job.job_id for job in decoded.jobs] == [b"b"]
    (rejected,) = decoded.rejected
    assert (rejected.job_id, rejected.code) == (b"a", "INVALID_INPUT")
    assert "needs 8 bytes" in rejected.message


def test_a_result_over_the_payload_limit_fails_alone() -> None:
    big = tensors(y=np.zeros(300, np.float32))
    small = tensors(y=np.zeros(2, np.float32))
    frames = p.Results((p.Result(b"a", big, {}), p.Result(b"b", small, {}))).encode()
    decoded = p.decode(frames, LIMITS)
    assert isinstance(decoded, p.Results)
    assert [r.job_id for r in decoded.results] == [b"b"]
    # a worker keeps its outputs within the limit (else fails the job itself): the
    # broker blames it, never the client's request
    assert [(f.job_id, f.code) for f in decoded.failures] == [(b"a", "WORKER_FAILED")]
    assert type(decoded.failures[0].exception()) is WorkerFailedError
    assert "the limit is 1024" in decoded.failures[0].message


def test_a_batch_lists_each_distinct_spec_once() -> None:
    x = tensors(x=np.zeros(2, np.float32))
    batch = p.Jobs(tuple(p.Job(bytes([i]), "m", x, None, 1) for i in range(3)))
    header = json.loads(batch.encode()[1])
    assert len(header["specs"]) == 1
    assert [row[1] for row in header["jobs"]] == [0, 0, 0]


def test_a_batch_too_big_for_the_receiver_is_split() -> None:
    x = tensors(x=np.zeros(2, np.float32))
    batch = p.Jobs(tuple(p.Job(bytes([i]) * 20, "m", x, 1.5, 1) for i in range(9)))
    messages = p.encode_batch(batch, LIMITS)
    assert len(messages) > 2  # 9 rows, at most 4 per message
    decoded = [p.decode(frames, LIMITS) for frames in messages]
    assert all(len(frames[1]) <= LIMITS.max_header_bytes for frames in messages)
    got = [job.job_id for message in decoded for job in message.jobs]  # type: ignore[union-attr]
    assert got == [job.job_id for job in batch.jobs]
    failures = tuple(p.Fail(bytes([i]), "X", "m" * 200) for i in range(3))
    parts = p.encode_batch(p.Results(failures=failures), LIMITS)
    assert [f for frames in parts for f in p.decode(frames, LIMITS).failures] == list(failures)  # type: ignore[union-attr]


def test_a_cached_header_is_still_validated_against_its_frames() -> None:
    ok = frames_with(request(), F8)
    assert isinstance(p.decode(ok, LIMITS), p.Request)
    with pytest.raises(InvalidInputError, match="needs 8 bytes"):
        p.decode(frames_with(request(), bytes(4)), LIMITS)


# ---------------------------------------------------------------- check_inputs


def specs(**shapes: tuple[str, tuple[int, ...]]) -> list[p.TensorSpec]:
    return [p.TensorSpec(name, dtype, shape) for name, (dtype, shape) in shapes.items()]


def test_check_inputs_accepts_any_batch_along_the_batching_dim() -> None:
    p.check_inputs(SPEC, specs(a=("float32", (7, 3)), b=("int64", (7,))))
    fixed = p.ModelSpec("f", SPEC.inputs, SPEC.outputs, 4, None)
    p.check_inputs(fixed, specs(a=("float32", (4, 3)), b=("int64", (4,))))


@pytest.mark.parametrize(
    ("given", "model", "message"),
    [
        (specs(a=("float32", (2, 3))), SPEC, "missing: b"),
        (  # a misspelt name: both halves of the mistake are named
            specs(a=("float32", (2, 3)), bb=("int64", (2,))),
            SPEC,
            "model 'add' has no input 'bb'; its inputs are a, b (missing: b)",
        ),
        (specs(a=("float32", (2, 3)), b=("int64", (2,)), c=("int64", (2,))), SPEC, "no input 'c'"),
        (
            specs(a=("float64", (2, 3)), b=("int64", (2,))),
            SPEC,
            "must be float32, got float64 (convert it: x.astype(np.float32))",
        ),
        (  # one sample, sent without its batch dimension: said how to add it
            specs(a=("float32", (3,)), b=("int64", (2,))),
            SPEC,
            "got (3,); one sample still needs the batch dimension: np.expand_dims(x, 0)",
        ),
        (specs(a=("float32", (2, 4)), b=("int64", (2,))), SPEC, "must have shape (4, 3)"),
        (specs(a=("float32", (2, 3, 1)), b=("int64", (2,))), SPEC, "must have shape"),
        (specs(a=("float32", (0, 3)), b=("int64", (0,))), SPEC, "any size >= 1"),
        (specs(a=("float32", (2, 3)), b=("int64", (3,))), SPEC, "disagree on the batch size"),
        (
            specs(a=("float32", (2, 3)), b=("int64", (2,))),
            p.ModelSpec("f", SPEC.inputs, SPEC.outputs, 4, None),
            "must have shape (4, 3), got",
        ),
    ],
)
def test_check_inputs_says_what_is_wrong(
    given: list[p.TensorSpec], model: p.ModelSpec, message: str
) -> None:
    with pytest.raises(InvalidInputError) as info:
        p.check_inputs(model, given)
    assert message in str(info.value)


def test_check_inputs_remembers_a_pass_only_for_the_same_model_and_specs() -> None:
    given = tuple(specs(a=("float32", (2, 3)), b=("int64", (2,))))
    p.check_inputs(SPEC, given)
    p.check_inputs(SPEC, given)  # the remembered pass
    fixed = p.ModelSpec("f", SPEC.inputs, SPEC.outputs, 4, None)
    with pytest.raises(InvalidInputError, match="must have shape"):
        p.check_inputs(fixed, given)  # same specs, another model: checked again
    wrong = tuple(specs(a=("float64", (2, 3)), b=("int64", (2,))))
    with pytest.raises(InvalidInputError, match="must be float32"):
        p.check_inputs(SPEC, wrong)


# ---------------------------------------------------------------- groups


def members(count: int, rows: int = 2, seed: int = 0) -> list[p.Tensors]:
    rng = np.random.default_rng(seed)
    return [
        p.Tensors.of(
            {
                "a": rng.standard_normal((rows, 3)).astype(np.float32),
                "b": rng.integers(0, 100, (rows,)).astype(np.int64),
            }
        )
        for _ in range(count)
    ]


def received(frames: list[Any]) -> list[Any]:
    """The frames as a receiver holds them (bytes; zmq.Frame reads the same way)."""
    return [f.tobytes() if isinstance(f, np.ndarray) else bytes(f) for f in frames]


def test_a_group_of_requests_round_trips_member_by_member() -> None:
    given = members(4)
    ids = (b"r1", b"r2", b"r3", b"r4")
    group = p.Request(b"r1", "m", p.Tensors.group(given), 5.0, ids)
    batch = p.Requests((group, p.Request(b"s", "m", given[0], None)))
    frames = batch.encode()
    assert len(frames) == 2 + 2 + 2  # one frame per tensor for the whole group
    decoded = p.decode(received(frames))
    assert isinstance(decoded, p.Requests)
    row = decoded.requests[0]
    assert (row.group, row.tensors.members, row.timeout_ms) == (ids, 4, 5.0)
    for one, want, ident in zip(row.members(), given, ids, strict=True):
        assert one.request_id == ident and not one.group
        for name, array in one.tensors.arrays().items():
            np.testing.assert_array_equal(array, want.arrays()[name])
    assert decoded.requests[1].group == () and decoded.requests[1].tensors.members == 1


@pytest.mark.parametrize("dim", [0, 1])
def test_a_group_job_is_stacked_along_the_batching_dim_and_cut_back(dim: int) -> None:
    rng = np.random.default_rng(dim)
    parts = [rng.standard_normal((2, 3, 4)).astype(np.float32) for _ in range(3)]
    group = p.Tensors.group([p.Tensors.of({"a": part}) for part in parts])
    jobs = p.decode(received(p.Jobs((p.Job(b"j", "m", group, 9.0, group.members),)).encode()))
    assert isinstance(jobs, p.Jobs)
    stacked = jobs.jobs[0].tensors.stacked(dim)["a"]
    np.testing.assert_array_equal(stacked, np.concatenate(parts, axis=dim))
    outputs = p.Tensors.unstacked({"a": stacked * 2}, 3, dim)
    results = p.decode(received(p.Results((p.Result(b"j", outputs, {}),)).encode()))
    assert isinstance(results, p.Results)
    back = results.results[0].tensors
    assert back.members == 3 and back.specs[0].shape == (2, 3, 4)
    for member, part in zip(back.split(), parts, strict=True):
        np.testing.assert_array_equal(member.arrays()["a"], part * 2)


def test_a_group_reply_answers_each_request_of_the_group() -> None:
    given = members(3, seed=5)
    ids = (b"x", b"y", b"z")
    batch = p.Replies((p.Reply(b"x", p.Tensors.group(given), {"device_us": 3.0}, ids),))
    decoded = p.decode(received(batch.encode()))
    assert isinstance(decoded, p.Replies)
    answers = decoded.replies[0].members()
    assert [a.request_id for a in answers] == list(ids)
    for answer, want in zip(answers, given, strict=True):
        assert answer.timing == {"device_us": 3.0}
        np.testing.assert_array_equal(answer.tensors.arrays()["a"], want.arrays()["a"])


def test_outputs_that_do_not_split_into_the_members_are_refused() -> None:
    with pytest.raises(InvalidInputError, match="does not split into 3 equal parts"):
        p.Tensors.unstacked({"a": np.zeros((4, 2), np.float32)}, 3, 0)
    with pytest.raises(ValueError, match="share their specs"):
        p.Tensors.group([*members(1), *members(1, rows=3)])


def test_a_group_whose_frame_is_short_is_rejected_whole_and_alone() -> None:
    given = members(2)
    batch = p.Requests(
        (
            p.Request(b"g1", "m", p.Tensors.group(given), None, (b"g1", b"g2")),
            p.Request(b"ok", "m", given[0]),
        )
    )
    frames = received(batch.encode())
    frames[2] = frames[2][:-4]  # the group's "a": one member's worth short of 4 bytes
    decoded = p.decode(frames)
    assert isinstance(decoded, p.Requests)
    assert [f.job_id for f in decoded.rejected] == [b"g1", b"g2"]
    assert "for each of 2 members" in decoded.rejected[0].message
    assert [r.request_id for r in decoded.requests] == [b"ok"]


def test_peek_ids_reads_the_ids_of_groups() -> None:
    header = {"specs": [], "requests": [[["01", "02"], 0, None], ["03", 0, None], [["01"], 0]]}
    assert p.peek_ids(frames_with(header, cmd=REQUESTS)) == [b"\x01", b"\x02", b"\x03"]


def test_groupable_models_have_the_batching_dim_in_every_tensor() -> None:
    x = p.TensorSpec("x", "float32", (4, 2))
    scalar = p.TensorSpec("s", "float32", ())
    assert p.ModelSpec("m", (x,), (x,), 4, 0).groupable
    assert not p.ModelSpec("m", (x,), (x,), 4, None).groupable
    assert not p.ModelSpec("m", (x,), (scalar,), 4, 0).groupable


def test_a_model_signature_tells_apart_schemas_that_differ_only_in_batching() -> None:
    """What a refused worker's message shows: once it printed both sides the same."""
    assert SPEC.signature() == (
        "a:float32[4, 3], b:int64[4] -> y:float32[4, 3]; batch 4 along dimension 0"
    )
    unbatched = msgspec.structs.replace(SPEC, batching_dim=None)
    assert unbatched.signature().endswith("; batch 4, no dynamic batching")
    assert unbatched.signature() != SPEC.signature()


def _edited(message: p.Message, old: bytes, new: bytes) -> list[Any]:
    """``message`` encoded, with ``old`` replaced by ``new`` in its JSON header."""
    frames = list(message.encode())
    header = bytes(frames[1])
    assert old in header
    frames[1] = header.replace(old, new)
    return frames


ONE_RESULT = p.Results(
    (p.Result(b"j1", p.Tensors.of({"z": np.zeros((1, 2), np.float32)}), {"device_us": 1.5}),)
)
#: a 400-digit number, shown as its start and its length
HUGE = '$.results[0].timing["device_us"] is 1' + "0" * 39 + "... (401 characters): out of range"


@pytest.mark.parametrize(
    ("message", "old", "new", "problem"),
    [  # each once crashed the broker (or the worker) reading it: not an IpuserveError
        (ONE_RESULT, b"1.5", b"1" + b"0" * 400, HUGE),
        (ONE_RESULT, b"1.5", b"1e400", 'timing["device_us"] is 1E+400: out of range'),
        (ONE_RESULT, b"1.5", b"-1e400", 'timing["device_us"] is -1E+400: out of range'),
        (p.Welcome("e", 1000, 3000, 1024), b"3000", b"1" + b"0" * 400, "liveness_ms"),
        (
            p.Welcome("e", 1000, 3000, 1024),
            b"3000",
            b"1" + b"0" * 13,
            "$.liveness_ms is 10000000000000; it must be <= 999999999999",
        ),
        (
            p.Hello("w", (), 5),
            b"5",
            b"1" + b"0" * 400,
            "$.credit is 1" + "0" * 39 + "... (401 characters); it must be <= 9007199254740992",
        ),
    ],
    ids=[
        "timing-huge-int",
        "timing-inf",
        "timing-minus-inf",
        "liveness-huge",
        "liveness-1e13",
        "credit-huge",
    ],
)
def test_numbers_out_of_range_are_protocol_errors(
    message: p.Message, old: bytes, new: bytes, problem: str
) -> None:
    with pytest.raises(ProtocolError) as info:
        p.decode(_edited(message, old, new))
    assert problem in str(info.value)


def test_a_timing_value_may_be_a_unix_time_in_microseconds() -> None:
    """Extra timing keys are allowed; the first range check (1e15) refused a wall-clock
    stamp, failing every job of the RESULTS with it."""
    stamp = b"1795603194296393.0"
    (result,) = p.decode(_edited(ONE_RESULT, b"1.5", stamp)).results  # type: ignore[union-attr]
    assert result.timing["device_us"] == float(stamp)


def test_a_jobs_row_carries_the_samples_of_its_job() -> None:
    tensors = p.Tensors.of({"x": np.zeros((3, 2), np.float32)})
    sent = p.Jobs((p.Job(b"j", "m", tensors, 5.0, samples=3), p.Job(b"k", "m", tensors, None, 6)))
    header = json.loads(bytes(sent.encode()[1]))
    assert header["jobs"] == [["6a", 0, 5.0, 1, 3], ["6b", 0, None, 1, 6]]
    decoded = p.decode(sent.encode())
    assert isinstance(decoded, p.Jobs)
    assert [job.samples for job in decoded.jobs] == [3, 6]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (["01", 0, None, 1, 0], "$.jobs[0].samples is 0; it must be >= 1"),
        (
            ["01", 0, None, 1, 2**53 + 1],
            "$.jobs[0].samples is 9007199254740993; it must be <= 9007199254740992",
        ),
        (["01", 0, None, 1, 1.5], "$.jobs[0].samples is 1.5; it must be an integer"),
        (
            ["01", 0, None, 1],
            '$.jobs[0] is ["01",0,null,1]; it must be a list of at least length 5 (a row',
        ),
    ],
)
def test_a_jobs_row_without_a_valid_sample_count_is_refused(row: list[Any], message: str) -> None:
    with pytest.raises(ProtocolError) as info:
        p.decode(
            frames_with(
                {"specs": [{"model": "m", "tensors": [SPEC_X]}], "jobs": [row]}, F8, cmd=JOBS
            ),
            LIMITS,
        )
    assert message in str(info.value)


def test_a_version_4_peer_is_told_which_side_to_upgrade() -> None:
    with pytest.raises(UnsupportedVersionError) as info:
        p.decode([b"IPUS\x04\x01id", b"{}"])
    assert str(info.value) == (
        "protocol version 4 is not supported; this peer speaks 5: "
        "upgrade ipuserve on the side that speaks 4"
    )
    assert p.peek_id([b"IPUS\x04\x01id", b"{}"]) == b"id"  # so the refusal reaches it


WORKER = {"worker_id": "w", "credit": 8, "in_flight": 2, "requests": 3}
LISTED = {"spec": SPEC.to_json(), "queued": 0, "workers": [WORKER]}


def test_a_worker_listed_without_its_request_count_is_refused() -> None:
    """Version 4 requires each worker's ``requests`` in MODELS_REPLY: read as 0, a
    missing count would make a busy worker look idle to a client choosing by load."""
    whole = p.decode(frames_with({"models": [LISTED]}, cmd=0x05))
    assert isinstance(whole, p.ModelsReply) and whole.models[0].workers[0].requests == 3
    partial = {**LISTED, "workers": [{k: v for k, v in WORKER.items() if k != "requests"}]}
    with pytest.raises(ProtocolError) as info:
        p.decode(frames_with({"models": [partial]}, cmd=0x05))
    assert str(info.value) == (
        "MODELS_REPLY header: Object missing required field `requests` - at "
        "`$.models[0].workers[0]`"
    )


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (
            {"tensors": [], "timing": {"a": 1.0, "b": 1e300}},
            '$.timing["b"] is 1E+300; it must be <',
        ),
        ({"tensors": [], "timing": {"": 1.0}}, '$.timing has the key ""; it must be a string'),
        ({"tensors": [], "timing": {"a": True}}, '$.timing["a"] is true; it must be a number'),
        ({"tensors": [{**SPEC_X, "shape": [2, -3]}], "timing": {}}, "shape[1] is -3; it must be"),
    ],
)
def test_a_refusal_names_the_value_sent_and_where(header: dict[str, Any], message: str) -> None:
    with pytest.raises(IpuserveError) as info:
        p.decode(frames_with(header, F8, cmd=0x02), LIMITS)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("specs", "cmd", "where"),
    [
        ([{"model": "m", "tensors": [SPEC_X]}, {"model": "m", "tensors": MANY}], JOBS, "JOBS"),
        ([[SPEC_X], MANY], RESULTS, "RESULTS"),
    ],
)
def test_a_spec_table_entry_over_the_tensor_limit_is_named(
    specs: Any, cmd: int, where: str
) -> None:
    key = "jobs" if cmd == JOBS else "results"
    row = _full(["01", 1, None]) if cmd == JOBS else ["01", 1, {}]
    with pytest.raises(ProtocolError) as info:
        p.decode(frames_with({"specs": specs, key: [row]}, F8, cmd=cmd), LIMITS)
    field = ".tensors" if cmd == JOBS else ""
    assert str(info.value) == f"{where} header: $.specs[1]{field} has 4 entries; the limit is 3"


NAN, INF = float("nan"), float("inf")
X = p.Tensors.of({"x": np.zeros(2, np.float32)})


@pytest.mark.parametrize(
    ("message", "what"),
    [
        (p.Jobs((p.Job(b"j", "m", X, NAN, 1),)), "budget_ms is nan"),
        (p.Jobs((p.Job(b"j", "m", X, -INF, 1),)), "budget_ms is -inf"),
        (p.Request(b"r", "m", X, INF), "timeout_ms is inf"),
        (p.Requests((p.Request(b"r", "m", X, NAN),)), "timeout_ms is nan"),
        (p.Reply(b"r", X, {"a": 1.0, "b": NAN}), "only finite numbers"),
        (p.Results((p.Result(b"j", X, {"a": INF}),)), "only finite numbers"),
        (p.Replies((p.Reply(b"r", X, {"a": -INF}),)), "only finite numbers"),
    ],
)
def test_a_number_json_cannot_carry_is_refused_when_sent(message: Any, what: str) -> None:
    """msgspec writes NaN and infinities as null: a NaN budget or timeout would arrive
    as no deadline at all, so the sender refuses it, as the JSON encoder once did."""
    with pytest.raises(ValueError, match=re.escape(what)):
        message.encode()


def test_a_refusal_is_kept_as_msgspec_gave_it_when_the_header_cannot_be_read_again() -> None:
    """msgspec stops at the first bad field; bad UTF-8 after it (the fuzzer found this)
    must not turn the refusal into a crash while the value is looked up."""
    raw = b'{"model": "", "tensors": [], "x": "m\xa7"}'
    with pytest.raises(ProtocolError) as info:
        p.decode([p.envelope(p.Command.REQUEST), raw])
    assert str(info.value) == "REQUEST header: Expected `str` of length >= 1 - at `$.model`"


def test_a_value_that_quotes_a_shape_path_is_still_a_protocol_error() -> None:
    with pytest.raises(IpuserveError) as info:
        p.decode(frames_with({"model": ["m].shape"], "tensors": []}))
    assert type(info.value) is ProtocolError, info.value
    assert str(info.value) == 'REQUEST header: $.model is ["m].shape"]; it must be a string'
