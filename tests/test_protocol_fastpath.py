"""The protocol's fast paths (ipuserve/protocol/fastpath.py, the one-job JOBS encoder,
Result.reply's timing text) agree with the full decoder and encoders: on the hot
messages as senders write them, and on random corruptions of them, where the fast
path must either give the full decoder's message or leave the message to it."""

from __future__ import annotations

import dataclasses
import json
import random
import re
from typing import Any

import numpy as np
import pytest
import zmq

from ipuserve import protocol as p
from ipuserve.errors import IpuserveError
from ipuserve.protocol import batches, codec, fastpath


def _comparable(message: Any) -> Any:
    """A decoded message as plain values: frames as bytes, numbers with their type."""
    if isinstance(message, tuple):
        return tuple(_comparable(item) for item in message)
    if isinstance(message, dict):
        return {key: (type(value).__name__, value) for key, value in message.items()}
    if isinstance(message, p.Tensors):
        frames = tuple(bytes(memoryview(f)) for f in message.frames)  # type: ignore[arg-type]
        return (message.specs, frames, message.members)
    if dataclasses.is_dataclass(message):
        fields = [f.name for f in dataclasses.fields(message) if f.compare]
        return (type(message).__name__, *[_comparable(getattr(message, f)) for f in fields])
    return message


def _full(frames: list[Any], limits: p.Limits = p.DEFAULT_LIMITS) -> Any:
    try:
        return ("ok", _comparable(codec._full_decode(frames, limits)))
    except IpuserveError as exc:
        return ("error", type(exc).__name__, str(exc))


def _tensors(shape: tuple[int, ...] = (1, 16), names: tuple[str, ...] = ("x",)) -> p.Tensors:
    array = (np.arange(int(np.prod(shape))) % 7).astype(np.float32).reshape(shape)
    return p.Tensors.of({name: array for name in names})


_TIMING = {"device_us": 123.456, "worker_us": 7.0, "queue_us": 1e-07}


def _hot_messages() -> list[list[Any]]:
    """The messages the fast paths are for, as senders encode them."""
    one, two = _tensors(), _tensors((2, 3), ("a", "b"))
    group = p.Tensors.group([one, one, one])
    return [
        p.Request(b"\x01" * 8, "echo", one, 60_000.0).encode(),
        p.Request(b"", "echo", two).encode(),
        p.Results((p.Result(b"\x00\x07", one, _TIMING),)).encode(),
        p.Results((p.Result(b"job", two, {}),)).encode(),
        p.Results((p.Result(b"g", group, _TIMING),)).encode(),
        p.Reply(b"r" * 16, one, {**_TIMING, "broker_queue_us": 3.5}).encode(),
        p.Jobs((p.Job(b"\x02" * 8, "echo", one, 59_999.123456789),)).encode(),
        p.Jobs((p.Job(b"", "m", two, None),)).encode(),
        p.Jobs((p.Job(b"g", "echo", group, -3.0),)).encode(),
        p.Jobs((p.Job(b"i", "echo", one, 7),)).encode(),  # type: ignore[arg-type]
    ]


def _as_zmq(frames: list[Any]) -> list[Any]:
    return [zmq.Frame(bytes(memoryview(frame))) for frame in frames]


@pytest.mark.parametrize("index", range(len(_hot_messages())))
def test_the_fast_path_takes_the_hot_messages_and_agrees(index: int) -> None:
    frames = _as_zmq(_hot_messages()[index])
    codec._full_decode(frames, p.DEFAULT_LIMITS)  # a REQUEST's header: cached once seen
    fast = fastpath.fast_decode(frames, p.DEFAULT_LIMITS)
    assert fast is not None
    assert ("ok", _comparable(fast)) == _full(frames)
    assert _comparable(p.decode(frames)) == _comparable(fast)


def test_a_request_not_seen_before_takes_the_full_path() -> None:
    frames = _as_zmq(p.Request(b"1", "never-seen-" + "x" * 20, _tensors()).encode())
    assert fastpath.fast_decode(frames, p.DEFAULT_LIMITS) is None
    p.decode(frames)
    assert fastpath.fast_decode(frames, p.DEFAULT_LIMITS) is not None
    # cached under other limits: not taken
    assert fastpath.fast_decode(frames, p.Limits(max_payload_bytes=1)) is None


_TOKENS = [
    b"0", b"1", b"-1", b"1.5", b"1e400", b"NaN", b"Infinity", b"null", b"true", b'"x"',
    b"[]", b"{}", b" ", b",", b'"AB"', b'"zz"', b"1e18", b"-0.0", b"2", b'"\\u00e9"',
    b"\xff", b"]", b"}", b"-0", b"1E3", b"0.5e-2", b"1e12", b"-1e12", b"01", b"1025",
    b'"' + b"a" * 65 + b'"', b'"' + b"ab" * 65 + b'"',
]  # fmt: skip
_SCALAR = re.compile(rb'"[^"]*"|-?[0-9][0-9.e+-]*|null')


def _corrupt(frames: list[bytes], rng: random.Random) -> list[bytes]:
    """One random corruption of a message: its header, a frame's size, the frame count,
    the envelope, or a timing object made too long or given an integer."""
    frames = list(frames)
    header = bytearray(frames[1])
    kind = rng.randrange(7)
    if kind == 0:
        header[rng.randrange(len(header))] = rng.randrange(256)
    elif kind == 1:
        start = rng.randrange(len(header))
        del header[start : start + rng.randrange(1, 4)]
    elif kind == 2:
        at = rng.randrange(len(header) + 1)
        header[at:at] = rng.choice(_TOKENS)
    elif kind == 3:
        token = rng.choice(list(_SCALAR.finditer(bytes(header))))
        header[token.start() : token.end()] = rng.choice(_TOKENS)
    elif kind == 4 and len(frames) > 2:
        at = rng.randrange(2, len(frames))
        frames[at] = frames[at][:-1] if rng.random() < 0.5 else frames[at] + b"\0"
    elif kind == 5:
        frames.append(b"\0" * 4)
    else:
        parsed = json.loads(bytes(header))
        timings = [row[2] for row in parsed.get("results", ())] + [parsed.get("timing")]
        for timing in timings:
            if isinstance(timing, dict):
                for n in range(rng.choice([1, 30, 33])):
                    timing[f"k{n}"] = rng.choice([1.0, 2, -1e17, 1e18])
        header = bytearray(json.dumps(parsed, separators=(",", ":")).encode())
    frames[1] = bytes(header)
    return frames


@pytest.mark.parametrize("seed", range(4))
def test_a_corrupted_message_gets_what_the_full_decoder_gives(seed: int) -> None:
    rng = random.Random(seed)
    messages = [[bytes(memoryview(f)) for f in m] for m in _hot_messages()]
    limits = [p.DEFAULT_LIMITS, p.Limits(max_payload_bytes=40, max_batch=1)]
    taken = 0
    for _ in range(1500):
        frames = _corrupt(rng.choice(messages), rng)
        for limit in limits:
            for given in (frames, _as_zmq(frames)):
                full = _full(given, limit)
                fast = fastpath.fast_decode(given, limit)
                if fast is not None:
                    taken += 1
                    assert ("ok", _comparable(fast)) == full, frames[:2]
                try:
                    got = ("ok", _comparable(p.decode(given, limit)))
                except IpuserveError as exc:
                    got = ("error", type(exc).__name__, str(exc))
                assert got == full, frames[:2]
    assert taken  # some corruptions leave a valid message: the fast path took those


def test_a_reply_passes_the_timing_text_on_as_the_dict_would_encode() -> None:
    for result in (
        p.Result(b"\x05", _tensors(), _TIMING),
        p.Result(b"\x05", _tensors(), {}),
        p.Result(b"\x05", p.Tensors.group([_tensors()] * 2), {"device_us": 1.5}),
    ):
        frames = _as_zmq(p.Results((result,)).encode())
        received = p.decode(frames)
        assert isinstance(received, p.Results)
        fast = received.results[0]
        assert fast.timing_json is not None  # read by the fast path
        group = (b"a", b"b") if fast.tensors.members == 2 else ()
        reply = fast.reply(b"\x09", group, "broker_queue_us", 12.25)
        timing = {**fast.timing, "broker_queue_us": 12.25}
        slow = p.Reply(b"\x09", fast.tensors, timing, group)
        assert reply.timing == timing and reply.timing_json is not None
        assert [bytes(f) for f in reply.encode()[:2]] == [bytes(f) for f in slow.encode()[:2]]


def test_replies_pass_the_timing_text_on_as_the_dicts_would_encode() -> None:
    received = p.decode(_as_zmq(p.Results((p.Result(b"\x05", _tensors(), _TIMING),)).encode()))
    assert isinstance(received, p.Results)
    result = received.results[0]
    replies = [result.reply(bytes([n]), (), "broker_queue_us", n + 0.5) for n in range(3)]
    assert all(reply.timing_json is not None for reply in replies)
    plain = [p.Reply(r.request_id, r.tensors, r.timing, r.group) for r in replies]
    fast, slow = p.Replies(tuple(replies)).encode(), p.Replies(tuple(plain)).encode()
    assert [bytes(memoryview(f)) for f in fast] == [bytes(memoryview(f)) for f in slow]
    batch = p.Results((result, result)).encode()
    plain_results = p.Results((dataclasses.replace(result, timing_json=None),) * 2).encode()
    assert [bytes(memoryview(f)) for f in batch] == [bytes(memoryview(f)) for f in plain_results]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 3])
def test_a_reply_the_text_cannot_carry_is_encoded_from_the_dict(value: float) -> None:
    result = p.Result(b"\x05", _tensors(), _TIMING, json.dumps(_TIMING))
    reply = result.reply(b"\x09", (), "broker_queue_us", value)
    assert reply.timing_json is None
    assert reply.timing["broker_queue_us"] is value
    # an entry the worker sent already is replaced, not sent twice
    replaced = result.reply(b"\x09", (), "device_us", 1.0)
    assert replaced.timing_json is None and replaced.timing["device_us"] == 1.0


@pytest.mark.parametrize(
    "job",
    [
        p.Job(b"\x01\x02", "echo", _tensors(), 1234.5),
        p.Job(b"", "m", _tensors((2, 3), ("a", "b")), None),
        p.Job(b"g", "echo", p.Tensors.group([_tensors()] * 3), -5.0),
        p.Job(b"i", "echo", _tensors(), 7),  # type: ignore[arg-type]
    ],
)
def test_a_one_job_jobs_encodes_as_the_batch_encoder_does(job: p.Job) -> None:
    rows = [(job.job_id, job.model, job.tensors, job.budget_ms, ())]
    slow = batches._encode_inputs(p.Command.JOBS, "jobs", rows)
    fast = p.Jobs((job,)).encode()
    assert [bytes(memoryview(f)) for f in fast] == [bytes(memoryview(f)) for f in slow]


@pytest.mark.parametrize(
    "result",
    [
        p.Result(b"\x01\x02", _tensors(), _TIMING),
        p.Result(b"", _tensors((2, 3), ("a", "b")), {}),
        p.Result(b"g", p.Tensors.group([_tensors()] * 3), {"device_us": 2.5}),
    ],
)
def test_a_one_result_results_encodes_as_the_batch_encoder_does(result: p.Result) -> None:
    rows = [(result.job_id, result.tensors, result.timing, ())]
    slow = batches._encode_outputs(p.Command.RESULTS, ("results", "failures"), rows, ())
    fast = p.Results((result,)).encode()
    assert [bytes(memoryview(f)) for f in fast] == [bytes(memoryview(f)) for f in slow]
    received = p.decode(_as_zmq(fast))  # with the text it was read from: the same again
    assert isinstance(received, p.Results)
    again = p.Results(received.results).encode()
    assert [bytes(memoryview(f)) for f in again] == [bytes(memoryview(f)) for f in slow]


def test_a_one_job_jobs_refuses_a_budget_json_cannot_hold() -> None:
    with pytest.raises(ValueError, match="cannot travel as JSON"):
        p.Jobs((p.Job(b"1", "echo", _tensors(), float("nan")),)).encode()


def test_readable_says_whether_a_message_waits() -> None:
    context = zmq.Context()
    sender, receiver = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    try:
        receiver.bind("inproc://readable")
        sender.connect("inproc://readable")
        assert not p.readable(receiver)
        p.send(sender, p.Ping(b"1").encode())
        assert receiver.poll(10_000)  # delivered: the readable check must see it
        assert p.readable(receiver)
        assert isinstance(p.decode(p.recv(receiver)), p.Ping)
        assert not p.readable(receiver)
    finally:
        sender.close(0)
        receiver.close(0)
        context.term()
