"""Malformed input from a raw socket against real broker and worker processes.

Each kind of bad message gets an ERROR with the right code (addressed to the id it
carried, when it carried one), and the very next well-formed request is served.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from ipuserve import protocol as wire
from tests.helpers import (
    BrokerProc,
    Processes,
    RawClient,
    add_inputs,
    assert_add_reply,
    metric,
    scrape,
    start_broker,
    start_worker,
)

pytestmark = pytest.mark.slow

REQ = wire.Command.REQUEST
F32 = {"name": "x", "dtype": "float32", "shape": [2, 8]}
Y32 = {**F32, "name": "y"}
ROWS = bytes(64)


def request(header: dict[str, Any] | bytes, *tensors: bytes, rid: bytes = b"bad") -> list[bytes]:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return [wire.envelope(REQ, rid), raw, *tensors]


ADD_SPEC = {"model": "add", "tensors": [F32, Y32]}


def batch(header: dict[str, Any], hex_of: bytes, *tensors: bytes) -> list[bytes]:
    """A REQUESTS message; ``hex_of`` stands for the hex id in its rows (b"bad" here)."""
    raw = json.dumps(header).replace('"bad"', f'"{hex_of.hex()}"').encode()
    return [wire.envelope(wire.Command.REQUESTS), raw, *tensors]


def spec(**changes: Any) -> dict[str, Any]:
    return {**F32, **changes}


#: name, frames, the error code, and the id the error is addressed to when not b"bad"
CASES: list[tuple[str, list[bytes], str] | tuple[str, list[bytes], str, bytes]] = [
    ("empty message", [b""], "BAD_MESSAGE", b""),
    ("envelope only", [wire.envelope(REQ, b"bad")], "BAD_MESSAGE"),
    ("wrong tag", [b"GET /\x01bad", b"{}"], "BAD_MESSAGE", b""),
    ("wrong version", [b"IPUS\x07\x01bad", b"{}"], "UNSUPPORTED_VERSION"),
    ("version 1 layout", [b"IPUS\x01", bytes([REQ]), b"bad", b"{}"], "UNSUPPORTED_VERSION", b""),
    ("version 2", [b"IPUS\x02\x01bad", b"{}"], "UNSUPPORTED_VERSION"),
    ("version 3", [b"IPUS\x03\x01bad", b"{}"], "UNSUPPORTED_VERSION"),
    ("no command", [wire.TAG, b"{}"], "BAD_MESSAGE", b""),
    ("unknown command", [wire.TAG + b"\x7fbad", b"{}"], "BAD_MESSAGE"),
    (
        "worker command",
        [wire.envelope(wire.Command.BYE, b"bad"), b'{"handed_back":[]}'],
        "BAD_MESSAGE",
    ),
    ("id too long", [wire.envelope(REQ, b"x" * 65), b"{}"], "BAD_MESSAGE", b""),
    ("header not json", request(b"{nope"), "BAD_MESSAGE"),
    ("header not utf-8", request(b"\xc3\x28"), "BAD_MESSAGE"),
    ("header not an object", request(b'"add"'), "BAD_MESSAGE"),
    ("header too big", request(b'{"model":"' + b"a" * 300_000 + b'"}'), "BAD_MESSAGE"),
    ("missing field", request({"tensors": []}), "BAD_MESSAGE"),
    ("unknown field", request({"model": "add", "tensors": [], "priority": 1}), "BAD_MESSAGE"),
    ("wrong field type", request({"model": ["add"], "tensors": []}), "BAD_MESSAGE"),
    ("NaN timeout", request(b'{"model":"add","tensors":[],"timeout_ms":NaN}'), "BAD_MESSAGE"),
    ("negative timeout", request({"model": "add", "tensors": [], "timeout_ms": -5}), "BAD_MESSAGE"),
    (
        "dtype not allowed",
        request({"model": "add", "tensors": [spec(dtype="complex128")]}, ROWS),
        "INVALID_INPUT",
    ),
    ("negative dim", request({"model": "add", "tensors": [spec(shape=[-2, 8])]}), "INVALID_INPUT"),
    (
        "huge shape",
        request({"model": "add", "tensors": [spec(shape=[2**40, 2**40])]}),
        "INVALID_INPUT",
    ),
    (
        "rank too big",
        request({"model": "add", "tensors": [spec(shape=[1] * 9)]}, bytes(4)),
        "INVALID_INPUT",
    ),
    (
        "byte count",
        request({"model": "add", "tensors": [F32, Y32]}, ROWS, bytes(63)),
        "INVALID_INPUT",
    ),
    ("frames missing", request({"model": "add", "tensors": [F32, Y32]}, ROWS), "BAD_MESSAGE"),
    ("too many frames", request({"model": "add", "tensors": [F32]}, *[ROWS] * 70), "BAD_MESSAGE"),
    (
        "payload too large",
        request({"model": "add", "tensors": [spec(shape=[40_000, 8])]}, bytes(1_280_000)),
        "PAYLOAD_TOO_LARGE",
    ),
    (
        "duplicate names",
        request({"model": "add", "tensors": [F32, F32]}, ROWS, ROWS),
        "INVALID_INPUT",
    ),
    (
        "unknown model",
        request({"model": "mul", "tensors": [F32, Y32]}, ROWS, ROWS),
        "UNKNOWN_MODEL",
    ),
    (
        "wrong tensor name",
        request({"model": "add", "tensors": [F32, spec(name="w")]}, ROWS, ROWS),
        "INVALID_INPUT",
    ),
    (
        "wrong dtype",
        request({"model": "add", "tensors": [F32, spec(name="y", dtype="int32")]}, ROWS, ROWS),
        "INVALID_INPUT",
    ),
    (
        "wrong shape",
        request(
            {"model": "add", "tensors": [spec(shape=[2, 9]), spec(name="y", shape=[2, 9])]},
            bytes(72),
            bytes(72),
        ),
        "INVALID_INPUT",
    ),
    # REQUESTS: a bad batch is answered for each request it names that can be read
    (
        "batch row not a list",
        batch({"specs": [ADD_SPEC], "requests": [["bad", 0, None], "junk"]}, b"bad"),
        "BAD_MESSAGE",
    ),
    (
        "batch row names no spec",
        batch({"specs": [ADD_SPEC], "requests": [["bad", 3, None]]}, b"bad"),
        "BAD_MESSAGE",
    ),
    (
        "batch zero timeout",
        batch({"specs": [ADD_SPEC], "requests": [["bad", 0, 0.0]]}, b"bad", ROWS, ROWS),
        "BAD_MESSAGE",
    ),
    # issue 28: a header nested 1,000 deep killed the broker (RecursionError), and
    # msgspec skipped a row's extra entries unread
    (
        "header nests 1,000 deep",
        [
            wire.envelope(wire.Command.REQUESTS),
            b'{"specs":[],"requests":[[' + b"[" * 1000 + b"]" * 1000 + b",0,null]]}",
        ],
        "BAD_MESSAGE",
        b"",
    ),
    ("request nests 1,000 deep", request(b'{"model":' + b"[" * 1000), "BAD_MESSAGE"),
    (
        "batch row with an entry too many",
        batch({"specs": [ADD_SPEC], "requests": [["bad", 0, None, 1]]}, b"bad", ROWS, ROWS),
        "BAD_MESSAGE",
    ),
    (
        "batch frame short",
        batch({"specs": [ADD_SPEC], "requests": [["bad", 0, None]]}, b"bad", ROWS, bytes(8)),
        "INVALID_INPUT",
    ),
]


@pytest.fixture(scope="module")
def fabric() -> Iterator[BrokerProc]:
    procs = Processes()
    try:
        broker = start_broker(procs, "--max-payload-bytes", str(1 << 20))
        start_worker(procs, broker)
        yield broker
    finally:
        procs.close()


@pytest.fixture
def client(fabric: BrokerProc) -> Iterator[RawClient]:
    with RawClient(fabric.frontend) as raw:
        yield raw


def test_there_are_at_least_twenty_kinds() -> None:
    assert len({case[0] for case in CASES}) >= 20


@pytest.mark.parametrize(
    ("frames", "code", "expected_id"),
    [(c[1], c[2], c[3] if len(c) > 3 else b"bad") for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_malformed_input_gets_an_error_and_the_next_request_is_served(
    client: RawClient, frames: list[bytes], code: str, expected_id: bytes
) -> None:
    client.send_frames(frames)
    reply = client.recv()
    assert isinstance(reply, wire.ErrorReply), reply
    assert reply.code == code, reply.message
    assert reply.request_id == expected_id
    assert reply.message
    inputs = add_inputs(3)
    assert_add_reply(client.call("add", inputs), inputs)


def test_a_version_3_client_is_told_to_upgrade(client: RawClient) -> None:
    """A REQUEST exactly as a version-3 client sends it (version 4 changed only the
    header's declaration and the JOBS rows) is refused, saying which versions and what
    to do, and addressed to its id so that client fails at once, not at its timeout."""
    header = {"model": "add", "tensors": [F32, Y32], "timeout_ms": 1000.0}
    client.send_frames([b"IPUS\x03\x01v3-id", json.dumps(header).encode(), ROWS, ROWS])
    reply = client.recv()
    assert isinstance(reply, wire.ErrorReply), reply
    assert (reply.request_id, reply.code) == (b"v3-id", "UNSUPPORTED_VERSION")
    assert reply.message.startswith(
        f"protocol version 3 is not supported; this peer speaks {wire.PROTOCOL_VERSION}: "
        "upgrade ipuserve on the side that speaks 3"
    ), reply.message


def test_garbage_on_the_worker_socket_is_dropped_and_counted(fabric: BrokerProc) -> None:
    before = scrape(fabric.metrics_url).get(
        'ipuserve_broker_dropped_total{reason="malformed_from_worker"}', 0.0
    )
    with RawClient(fabric.backend) as stranger:
        stranger.send_frames([b"\x00garbage"])
        stranger.send_frames([wire.envelope(wire.Command.RESULTS), b"[]"])
        stranger.send(wire.Heartbeat(in_flight=0))
        assert isinstance(stranger.recv(), wire.Reconnect)  # the broker read all three
    after = scrape(fabric.metrics_url)
    assert after['ipuserve_broker_dropped_total{reason="malformed_from_worker"}'] == before + 2
    with RawClient(fabric.frontend) as client:
        inputs = add_inputs(1)
        assert_add_reply(client.call("add", inputs), inputs)
    served = scrape(fabric.metrics_url)
    assert metric(served, "ipuserve_broker_request_seconds_count") >= 1
    assert np.isfinite(metric(served, "ipuserve_broker_request_seconds_sum"))


def group(header: dict[str, Any], *tensors: bytes) -> list[bytes]:
    """A REQUESTS message whose ids "g1", "g2" stand for the ids b"g1", b"g2" (a group's
    tensor frame holds every member's tensor, one after another)."""
    raw = json.dumps(header).replace('"g1"', f'"{b"g1".hex()}"').replace('"g2"', f'"{b"g2".hex()}"')
    return [wire.envelope(wire.Command.REQUESTS), raw.encode(), *tensors]


GROUP_CASES = [
    (
        "member frame short",
        group(
            {"specs": [ADD_SPEC], "requests": [[["g1", "g2"], 0, None]]}, ROWS * 2, ROWS + bytes(8)
        ),
        "INVALID_INPUT",
    ),
    (
        "members' shape wrong for the model",
        group(
            {
                "specs": [{"model": "add", "tensors": [spec(shape=[2, 9]), Y32]}],
                "requests": [[["g1", "g2"], 0, None]],
            },
            bytes(2 * 72),
            ROWS * 2,
        ),
        "INVALID_INPUT",
    ),
    (
        "group for an unknown model",
        group(
            {
                "specs": [{"model": "mul", "tensors": [F32, Y32]}],
                "requests": [[["g1", "g2"], 0, None]],
            },
            ROWS * 2,
            ROWS * 2,
        ),
        "UNKNOWN_MODEL",
    ),
    (
        "group lists an id twice",
        group(
            {"specs": [ADD_SPEC], "requests": [[["g1", "g2", "g1"], 0, None]]}, ROWS * 3, ROWS * 3
        ),
        "BAD_MESSAGE",
    ),
]


@pytest.mark.parametrize(
    ("frames", "code"), [c[1:] for c in GROUP_CASES], ids=[c[0] for c in GROUP_CASES]
)
def test_a_bad_group_gets_an_error_for_each_of_its_requests(
    client: RawClient, frames: list[bytes], code: str
) -> None:
    client.send_frames(frames)
    replies = [client.recv() for _ in range(2)]
    assert all(isinstance(r, wire.ErrorReply) and r.code == code for r in replies), replies
    assert {r.request_id for r in replies if isinstance(r, wire.ErrorReply)} == {b"g1", b"g2"}
    inputs = add_inputs(3)
    assert_add_reply(client.call("add", inputs), inputs)
