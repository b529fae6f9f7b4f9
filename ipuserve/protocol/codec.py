"""Decoding: from a message's frames to a message, validated (:func:`decode`), and
what a receiver can learn from frames it cannot decode (:func:`peek_id`,
:func:`peek_ids`) to answer their sender.

A header is measured before anything parses it: its bytes (``max_header_bytes``) and
how deep it nests (:data:`MAX_HEADER_DEPTH`, :func:`too_deep`). JSON parsers recurse
once per level, msgspec's raises RecursionError near 1,000 levels, and the error path
reads a refused header again (the value to quote, the ids to answer): a header 1,000
deep once killed the broker from both places."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

import msgspec
import numpy as np

from ipuserve.errors import IpuserveError, ProtocolError, UnsupportedVersionError
from ipuserve.protocol import batches, client_messages, control, worker_messages
from ipuserve.protocol.batches import Batch
from ipuserve.protocol.client_messages import ClientMessage, ErrorReply
from ipuserve.protocol.control import ControlMessage
from ipuserve.protocol.envelope import (
    DEFAULT_LIMITS,
    ENVELOPE_BYTES,
    ENVELOPES,
    HEADER_FRAMES,
    MAX_HEADER_DEPTH,
    MAX_ID_BYTES,
    PROTOCOL_TAG,
    PROTOCOL_VERSION,
    TAG,
    Command,
    Limits,
    as_bytes,
    nbytes,
)
from ipuserve.protocol.fields import peek_hex, refused
from ipuserve.protocol.tensors import Frame
from ipuserve.protocol.worker_messages import WorkerMessage

Message: TypeAlias = ClientMessage | WorkerMessage | Batch | ControlMessage


#: envelope prefix (tag, version, command) -> the message class and a decoder of its
#: declared header: one lookup checks all three.
_KINDS: dict[bytes, tuple[Any, msgspec.json.Decoder[Any]]] = {
    ENVELOPES[m.COMMAND]: (m, msgspec.json.Decoder(getattr(m, "HEADER", m)))
    for m in (
        *client_messages.MESSAGES,
        *worker_messages.MESSAGES,
        *batches.MESSAGES,
        *control.MESSAGES,
    )
}


def decode(frames: Sequence[Frame], limits: Limits = DEFAULT_LIMITS) -> Message:
    """Validate and parse one message (without any routing identity): the envelope and
    frame count here, the header by msgspec against its declaration, then what depends
    on ``limits`` and the tensor frames by the message's ``from_wire``."""
    if len(frames) < HEADER_FRAMES:
        raise ProtocolError(
            f"a message needs at least {HEADER_FRAMES} frames (envelope, header); got {len(frames)}"
        )
    size = nbytes(frames[0])
    head = as_bytes(frames[0]) if size <= ENVELOPE_BYTES + MAX_ID_BYTES else _prefix(frames[0])
    found = _KINDS.get(head[:ENVELOPE_BYTES])
    if found is None:
        raise _envelope_error(head)
    kind, header_decoder = found
    if size > ENVELOPE_BYTES + MAX_ID_BYTES:
        raise ProtocolError(f"the id is {size - ENVELOPE_BYTES} bytes; the limit is {MAX_ID_BYTES}")
    extra = len(frames) - HEADER_FRAMES
    most = kind.CARRIES.max_frames(limits)
    if extra > most:
        raise ProtocolError(
            f"{kind.COMMAND.name} carries at most {most} tensor frames; got {extra}"
        )
    raw = frames[1]
    size = nbytes(raw)
    if size > limits.max_header_bytes:
        raise ProtocolError(f"the header is {size} bytes; the limit is {limits.max_header_bytes}")
    data = as_bytes(raw)
    if (depth := too_deep(data)) is not None:
        raise ProtocolError(
            f"{kind.COMMAND.name} header nests {depth} deep; the limit is {MAX_HEADER_DEPTH}"
        )
    try:
        header = header_decoder.decode(data)
    except (msgspec.MsgspecError, UnicodeDecodeError) as exc:  # msgspec's, and bad UTF-8
        where = f"{kind.COMMAND.name} header"
        raise refused(exc, where, batches.ROW_FIELDS, data) from None
    message: Message = kind.from_wire(head[ENVELOPE_BYTES:], header, frames[2:], limits)
    return message


def too_deep(header: bytes) -> int | None:
    """How deep ``header`` nests when that is deeper than MAX_HEADER_DEPTH, else None.
    First a count of its brackets (~0.2 µs for a REQUEST's header): only a header with
    more than MAX_HEADER_DEPTH of them, a batch of a few rows, is measured."""
    if header.count(b"[") + header.count(b"{") <= MAX_HEADER_DEPTH:
        return None
    depth = nesting(header)
    return depth if depth > MAX_HEADER_DEPTH else None


#: what :func:`nesting` keeps of a header: brackets, and the quotes around strings
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'[]{}"')
_STEPS = bytes.maketrans(b"[]{}", b"\x01\xff\x01\xff")  # int8: +1, -1


def nesting(header: bytes) -> int:
    """How deep ``header`` nests arrays and objects outside its strings, without
    parsing it: linear, in C (bytes methods, one numpy sum; ~17 µs for a 256-row
    batch, whose whole decode takes ~490 µs). Exact for JSON; for bytes that are not, never
    below the depth a parser reaches before it finds out (up to the first error both
    read the same strings; an unterminated string hides only what no parser reads)."""
    if b"\\" in header:  # of the escapes, only \\ and \" can move a string's end
        header = header.replace(b"\\\\", b"").replace(b'\\"', b"")
    outside = b"".join(header.translate(None, _NOT_STRUCTURE).split(b'"')[::2])
    if not outside:
        return 0
    steps = np.frombuffer(outside.translate(_STEPS), np.int8)
    return int(np.cumsum(steps, dtype=np.int64).max())


def _prefix(frame: Frame) -> bytes:
    """The fixed part of an oversized envelope, without copying all of it."""
    return bytes(memoryview(frame)[:ENVELOPE_BYTES])  # type: ignore[arg-type]


def _envelope_error(head: bytes) -> ProtocolError:
    """Why an envelope is not one of ours: the first rule it breaks (docs/protocol.md §3)."""
    version = head[len(PROTOCOL_TAG)] if len(head) > len(PROTOCOL_TAG) else None
    if version is not None and version != PROTOCOL_VERSION and head.startswith(PROTOCOL_TAG):
        return UnsupportedVersionError(  # checked first: version 1 had a 5-byte tag frame
            f"protocol version {version} is not supported; this peer speaks "
            f"{PROTOCOL_VERSION}: upgrade ipuserve on the side that speaks "
            f"{min(version, PROTOCOL_VERSION)}"
        )
    if len(head) < ENVELOPE_BYTES or not head.startswith(PROTOCOL_TAG):
        return ProtocolError(
            f"frame 0 must be an envelope: {PROTOCOL_TAG!r}, a version byte, a command byte, "
            f"then the id; got {head[:16]!r}"
        )
    return ProtocolError(f"unknown command 0x{head[len(TAG)]:02x}")


def error_frames(ident: bytes, error: IpuserveError) -> list[Frame]:
    """The ERROR message answering ``ident`` with ``error``."""
    return ErrorReply.of(ident, error).encode()


def peek_id(frames: Sequence[Frame]) -> bytes:
    """The id of a message that may be malformed, to address an error reply (or b""):
    any envelope that starts with the tag, so a peer of another version learns why."""
    if not frames or not ENVELOPE_BYTES <= nbytes(frames[0]) <= ENVELOPE_BYTES + MAX_ID_BYTES:
        return b""
    head = as_bytes(frames[0])
    return head[ENVELOPE_BYTES:] if head.startswith(PROTOCOL_TAG) else b""


#: an untyped decoder that reads no number as one: ids are strings, and a number no
#: float holds (1e99999, which msgspec refuses) must not hide the ids around it
_PEEK: msgspec.json.Decoder[Any] = msgspec.json.Decoder(float_hook=lambda _text: None)
_BATCHES = {
    ENVELOPES[c] for c in (Command.JOBS, Command.RESULTS, Command.REQUESTS, Command.REPLIES)
}
_ROW_KEYS = ("jobs", "results", "failures", "requests", "replies", "errors")


def peek_ids(frames: Sequence[Frame]) -> list[bytes]:
    """The ids a batch that may be malformed names, best effort: a receiver that cannot
    decode a batch fails each job or request it can identify, so none waits for its
    deadline."""
    if len(frames) < HEADER_FRAMES or nbytes(frames[1]) > DEFAULT_LIMITS.max_header_bytes:
        return []
    if nbytes(frames[0]) > ENVELOPE_BYTES + MAX_ID_BYTES:
        return []
    if as_bytes(frames[0])[:ENVELOPE_BYTES] not in _BATCHES:
        return []
    data = as_bytes(frames[1])
    if too_deep(data) is not None:  # never parsed: none of its ids is read
        return []
    try:
        header = _PEEK.decode(data)
    except (msgspec.MsgspecError, UnicodeDecodeError):
        return []
    if not isinstance(header, dict):
        return []
    rows = [row for key in _ROW_KEYS if isinstance(v := header.get(key), list) for row in v]
    firsts = [row[0] for row in rows if isinstance(row, list) and row]
    ids = [i for first in firsts for i in (first if isinstance(first, list) else [first])]
    found = (job_id for value in ids if (job_id := peek_hex(value)) is not None)
    return list(dict.fromkeys(found))  # each id once, in order
