"""Decoding: from a message's frames to a message, validated (:func:`decode`), and
what a receiver can learn from frames it cannot decode (:func:`peek_id`,
:func:`peek_ids`) to answer their sender."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

import msgspec

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
    try:
        header = header_decoder.decode(as_bytes(raw))
    except (msgspec.MsgspecError, UnicodeDecodeError) as exc:  # msgspec's, and bad UTF-8
        where = f"{kind.COMMAND.name} header"
        raise refused(exc, where, batches.ROW_FIELDS, as_bytes(raw)) from None
    message: Message = kind.from_wire(head[ENVELOPE_BYTES:], header, frames[2:], limits)
    return message


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
    try:
        header = msgspec.json.decode(as_bytes(frames[1]))
    except (msgspec.MsgspecError, UnicodeDecodeError):
        return []
    if not isinstance(header, dict):
        return []
    rows = [row for key in _ROW_KEYS if isinstance(v := header.get(key), list) for row in v]
    firsts = [row[0] for row in rows if isinstance(row, list) and row]
    ids = [i for first in firsts for i in (first if isinstance(first, list) else [first])]
    found = (job_id for value in ids if (job_id := peek_hex(value)) is not None)
    return list(dict.fromkeys(found))  # each id once, in order
