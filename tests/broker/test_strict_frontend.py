"""Every malformed message from an addressable client gets an ERROR it can read
(issue 16): an error quoting what the client sent once made an ERROR whose header
passed the limit, which the client refused, so it heard nothing."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from ipuserve import protocol as wire
from ipuserve.broker.loop import Broker
from ipuserve.errors import InferenceError
from tests.broker.conftest import StartBroker
from tests.helpers import RawClient, add_inputs

#: valid JSON objects near the header limit (256 KiB) whose field is unknown
HUGE_FIELDS = {
    "a long name": json.dumps({"a" * 250_000: 1}).encode(),
    # raw UTF-8 in, \u00e9 escapes out: three times the bytes
    "a non-ASCII name": json.dumps({"\u00e9" * 125_000: 1}, ensure_ascii=False).encode(),
    "many names": json.dumps({f"\u00e9{n}": 1 for n in range(18_000)}, ensure_ascii=False).encode(),
}


@pytest.fixture
def client(start_broker_thread: StartBroker) -> Iterator[RawClient]:
    broker: Broker = start_broker_thread()
    with RawClient(broker.frontend_endpoint) as raw:
        yield raw


@pytest.mark.parametrize("command", [wire.Command.MODELS, wire.Command.PING, wire.Command.REQUEST])
@pytest.mark.parametrize("header", HUGE_FIELDS.values(), ids=HUGE_FIELDS.keys())
def test_a_huge_valid_header_with_an_unknown_field_gets_a_readable_error(
    client: RawClient, command: wire.Command, header: bytes
) -> None:
    assert len(header) <= wire.DEFAULT_LIMITS.max_header_bytes
    client.send_frames([wire.envelope(command, b"m1"), header])
    error = client.recv()  # decoded with the default limits, as a Client does
    assert isinstance(error, wire.ErrorReply), error
    assert (error.request_id, error.code) == (b"m1", "BAD_MESSAGE")
    assert "unknown field" in error.message and len(error.message) <= wire.MAX_MESSAGE_CHARS
    inputs = add_inputs(2)  # served on: no worker, so UNKNOWN_MODEL, readable too
    reply = client.call("add", inputs)
    assert isinstance(reply, wire.ErrorReply) and reply.code == "UNKNOWN_MODEL"


def test_an_error_message_of_any_length_makes_a_readable_error() -> None:
    """Also what a worker's failure carries on to the client."""
    frames = wire.ErrorReply.of(b"r", InferenceError("\u00e9" * 100_000)).encode()
    decoded = wire.decode(frames)
    assert isinstance(decoded, wire.ErrorReply) and decoded.code == "INFERENCE_FAILED"
    assert decoded.message.endswith("(100000 characters)")
