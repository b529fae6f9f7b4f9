"""Frame 0 and the frame list: the protocol's constants, commands and limits, and the
encoders' shared step that turns a header into a message's frames.

Every message module builds its frames with :func:`_frames`; nothing here imports
zmq, so the tensor model and the schema checks can be used without it.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ipuserve.protocol.tensors import Frame, Tensors, TensorSpec

PROTOCOL_TAG = b"IPUS"
PROTOCOL_VERSION = 3
#: The envelope's first bytes: the protocol tag and version.
TAG = PROTOCOL_TAG + bytes([PROTOCOL_VERSION])
#: Tag, version and command: the envelope's fixed part; the id follows.
ENVELOPE_BYTES = len(TAG) + 1
MAX_ID_BYTES = 64
# MAX_NAME_CHARS and MAX_DURATION_MS: ipuserve.limits (the runtime's CLI needs them
# without ZeroMQ), re-exported from here
#: The largest integer a header field may hold (JSON's are unbounded; 2**53: exact as a float).
MAX_COUNT = 2**53
#: Timing values are finite and below this (a Unix time in microseconds is ~1.8e15).
MAX_TIMING_VALUE = 1e18
MAX_TIMING_KEYS = 32
#: The longest error message sent (ERROR, and failures): a message that quoted what a
#: peer sent (a 250 KiB unknown field name; non-ASCII text, which JSON escapes to 6
#: bytes a character) made an ERROR whose header the receiver refused as too big, so
#: the peer got no error it could read.
MAX_MESSAGE_CHARS = 2000
#: Envelope and header; tensor frames follow.
HEADER_FRAMES = 2


class Command(enum.IntEnum):
    REQUEST = 0x01  # client -> broker
    REPLY = 0x02  # broker -> client
    ERROR = 0x03  # broker -> client
    MODELS = 0x04  # client -> broker
    MODELS_REPLY = 0x05  # broker -> client
    PING = 0x06  # client -> broker
    PONG = 0x07  # broker -> client
    REQUESTS = 0x08  # client -> broker: several requests in one message
    REPLIES = 0x09  # broker -> client: the replies to several REQUESTS rows
    HELLO = 0x10  # worker -> broker
    WELCOME = 0x11  # broker -> worker
    JOBS = 0x12  # broker -> worker
    RESULTS = 0x13  # worker -> broker  (0x14 was version 1's FAIL)
    HEARTBEAT = 0x15  # both ways
    RECONNECT = 0x16  # broker -> worker
    BYE = 0x17  # worker -> broker


#: command -> the fixed part of its envelope
_ENVELOPES = {c: TAG + bytes([c]) for c in Command}


def envelope(command: Command, ident: bytes = b"") -> bytes:
    """Frame 0 of a message: for tests and tools that build frames by hand."""
    return _ENVELOPES[command] + ident


@dataclass(frozen=True, slots=True)
class Limits:
    """What :func:`decode` accepts; the broker and worker make the payload limit configurable.

    ``max_payload_bytes`` and ``max_tensors`` hold per request (per job of a batch);
    ``max_batch`` bounds the jobs (or outcomes) of one JOBS (or RESULTS) message.
    """

    max_payload_bytes: int = 64 << 20
    max_header_bytes: int = 256 << 10
    max_tensors: int = 64
    max_rank: int = 8
    max_elements: int = 1 << 36
    max_batch: int = 1024


DEFAULT_LIMITS = Limits()


class CacheBudget:
    """What one of the protocol's caches may hold, in bytes as well as entries.

    A cache bounded by entries alone held whatever its peers sent: 1,024 distinct valid
    REQUEST headers of 250 KiB (JSON padded with spaces) took the broker's RSS from
    46 to 120 MiB. So each cache counts the bytes of what it keeps (about: its key's
    and value's text), is cleared whole when an entry would take it past ``max_bytes``
    (the caches' users rebuild what they need on the next miss), and does not keep an
    entry bigger than ``max_entry_bytes`` at all: what the caches are for (a client's
    repeated header, a batch's spec table) is a few hundred bytes, and a huge one would
    only evict them. The lookups stay plain dict gets; only an insertion pays.
    """

    __slots__ = ("entries", "max_bytes", "max_entry_bytes", "used")

    def __init__(
        self, max_bytes: int = 4 << 20, entries: int = 1024, max_entry_bytes: int = 64 << 10
    ) -> None:
        self.max_bytes, self.entries, self.max_entry_bytes = max_bytes, entries, max_entry_bytes
        #: bytes counted since the table was last cleared
        self.used = 0

    def admit(self, table: dict[Any, Any], size: int) -> bool:
        """Whether an entry of about ``size`` bytes may go into ``table``; room is made
        for it (the table cleared) when the table is full."""
        if size > self.max_entry_bytes:
            return False
        if len(table) >= self.entries or self.used + size > self.max_bytes:
            table.clear()
            self.used = 0
        self.used += size
        return True


def _bounded(message: str) -> str:
    """``message`` cut to MAX_MESSAGE_CHARS, saying so."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return f"{message[: MAX_MESSAGE_CHARS - 40]}... ({len(message)} characters)"


#: What an entry costs besides its text: the dict slot, the key tuple, the objects.
ENTRY_OVERHEAD = 200


_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
_json = _ENCODER.encode


def _number(value: float | None) -> str:
    """A budget as JSON: ``null`` or a finite float's repr (cheaper than the encoder)."""
    if value is None:
        return "null"
    if not math.isfinite(value):
        raise ValueError(f"{value} cannot travel as JSON")
    return repr(float(value))


#: Tensor specs -> their JSON list: the hot messages repeat the same specs.
_SPECS_JSON: dict[tuple[TensorSpec, ...], str] = {}
_SPECS_JSON_BUDGET = CacheBudget()
_SPECS_JSON_BY_ID_BUDGET = CacheBudget()


#: The same, by the spec tuple's id (kept with the tuple, so a reused id is told
#: apart): decoding and Tensors.of hand out one tuple per distinct spec list, and an
#: int hashes in C where a tuple of specs calls each dataclass's __hash__ in Python.
_SPECS_JSON_BY_ID: dict[int, tuple[tuple[TensorSpec, ...], str]] = {}


def _specs_json(tensors: Tensors) -> str:
    specs = tensors.specs
    found = _SPECS_JSON_BY_ID.get(id(specs))
    if found is not None and found[0] is specs:
        return found[1]
    text = _SPECS_JSON.get(specs)
    size = 2 * len(text) + ENTRY_OVERHEAD if text is not None else 0
    if text is None:
        text = _json(tensors.header())
        size = 2 * len(text) + ENTRY_OVERHEAD  # the text, and about as much in specs
        if _SPECS_JSON_BUDGET.admit(_SPECS_JSON, size):
            _SPECS_JSON[specs] = text
    if _SPECS_JSON_BY_ID_BUDGET.admit(_SPECS_JSON_BY_ID, size):
        _SPECS_JSON_BY_ID[id(specs)] = (specs, text)
    return text


def _frames(
    command: Command, ident: bytes, header: dict[str, Any] | str, tensors: Sequence[Frame] = ()
) -> list[Frame]:
    """The frames of one message; the hot messages pass their header as JSON text."""
    body = (header if isinstance(header, str) else _json(header)).encode("ascii")
    return [_ENVELOPES[command] + ident, body, *tensors]
