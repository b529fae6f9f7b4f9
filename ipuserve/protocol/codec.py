"""Decoding: from a message's frames to a message, validated (:func:`decode`), and
what a receiver can learn from frames it cannot decode (:func:`peek_id`,
:func:`peek_ids`) to answer their sender.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, TypeAlias

from ipuserve.errors import IpuserveError, ProtocolError, UnsupportedVersionError
from ipuserve.protocol import batches, client_messages, worker_messages
from ipuserve.protocol.batches import Jobs, Replies, Requests, Results
from ipuserve.protocol.checks import _Decoder, _nbytes, _small
from ipuserve.protocol.client_messages import (
    ErrorReply,
    ListModels,
    ModelsReply,
    Ping,
    Pong,
    Reply,
    Request,
)
from ipuserve.protocol.envelope import (
    _ENVELOPES,
    DEFAULT_LIMITS,
    ENTRY_OVERHEAD,
    ENVELOPE_BYTES,
    HEADER_FRAMES,
    MAX_ID_BYTES,
    PROTOCOL_TAG,
    PROTOCOL_VERSION,
    TAG,
    Command,
    Limits,
)
from ipuserve.protocol.fastpath import FIELDS_BUDGET, FIELDS_CACHE, fast_decode
from ipuserve.protocol.rows import _hex_id
from ipuserve.protocol.tensors import Frame
from ipuserve.protocol.worker_messages import Bye, Heartbeat, Hello, Reconnect, Welcome

Message: TypeAlias = (
    Request
    | Reply
    | ErrorReply
    | ListModels
    | ModelsReply
    | Ping
    | Pong
    | Hello
    | Welcome
    | Jobs
    | Requests
    | Results
    | Replies
    | Heartbeat
    | Reconnect
    | Bye
)

_DECODERS: dict[Command, _Decoder[Message]] = {
    decoder.command: decoder
    for decoder in (*client_messages._DECODERS, *worker_messages._DECODERS, *batches._DECODERS)
}
#: envelope prefix (tag, version, command) -> (command, decoder): one lookup checks all three.
_BY_PREFIX: dict[bytes, tuple[Command, _Decoder[Message]]] = {
    _ENVELOPES[command]: (command, decoder) for command, decoder in _DECODERS.items()
}


def decode(frames: Sequence[Frame], limits: Limits = DEFAULT_LIMITS) -> Message:
    """Validate and parse one message (without any routing identity).

    The hot messages take a fast path first (:mod:`ipuserve.protocol.fastpath`),
    which answers only where it is sure to agree with the checks below."""
    message: Message | None = fast_decode(frames, limits)
    if message is not None:
        return message
    return _full_decode(frames, limits)


def _full_decode(frames: Sequence[Frame], limits: Limits) -> Message:
    """:func:`decode` without the fast paths: every check, every error message."""
    command, decoder, ident = _check_envelope(frames, limits)
    fields = _header_fields(command, decoder, frames[1], limits)
    return decoder.build(ident, fields, frames[HEADER_FRAMES:], limits)


#: validated fields by (command, header), for the cacheable commands: see fastpath
_FIELDS_CACHE = FIELDS_CACHE


def _header_fields(
    command: Command, decoder: _Decoder[Message], frame: Frame, limits: Limits
) -> dict[str, Any]:
    size = _nbytes(frame)
    if size > limits.max_header_bytes:
        raise ProtocolError(f"the header is {size} bytes; the limit is {limits.max_header_bytes}")
    raw = _small(frame)
    if not decoder.cacheable:
        return decoder.check(_parse_header(raw), limits)
    key = (command, raw)
    cached = _FIELDS_CACHE.get(key)
    if cached is not None and (cached[0] is limits or cached[0] == limits):
        return cached[1]
    fields = decoder.check(_parse_header(raw), limits)
    if FIELDS_BUDGET.admit(_FIELDS_CACHE, 2 * len(raw) + ENTRY_OVERHEAD):
        _FIELDS_CACHE[key] = (limits, fields)
    return fields


def _check_envelope(
    frames: Sequence[Frame], limits: Limits
) -> tuple[Command, _Decoder[Message], bytes]:
    """The command, its decoder and the id; checks the frame count against the command."""
    if len(frames) < HEADER_FRAMES:
        raise ProtocolError(
            f"a message needs at least {HEADER_FRAMES} frames (envelope, header); got {len(frames)}"
        )
    size = _nbytes(frames[0])
    head = _small(frames[0]) if size <= ENVELOPE_BYTES + MAX_ID_BYTES else _prefix(frames[0])
    found = _BY_PREFIX.get(head[:ENVELOPE_BYTES])
    if found is None:
        raise _envelope_error(head)
    if size > ENVELOPE_BYTES + MAX_ID_BYTES:
        raise ProtocolError(f"the id is {size - ENVELOPE_BYTES} bytes; the limit is {MAX_ID_BYTES}")
    command, decoder = found
    extra = len(frames) - HEADER_FRAMES
    most = decoder.max_frames(limits)
    if extra > most:
        raise ProtocolError(f"{command.name} carries at most {most} tensor frames; got {extra}")
    return command, decoder, head[ENVELOPE_BYTES:]


def _prefix(frame: Frame) -> bytes:
    """The fixed part of an oversized envelope, without copying all of it."""
    return bytes(memoryview(frame)[:ENVELOPE_BYTES])  # type: ignore[arg-type]


def _envelope_error(head: bytes) -> ProtocolError:
    """Why an envelope is not one of ours: the first rule it breaks (docs/protocol.md §3)."""
    version = head[len(PROTOCOL_TAG)] if len(head) > len(PROTOCOL_TAG) else None
    if version is not None and version != PROTOCOL_VERSION and head.startswith(PROTOCOL_TAG):
        return UnsupportedVersionError(  # checked first: version 1 had a 5-byte tag frame
            f"protocol version {version} is not supported; this peer speaks {PROTOCOL_VERSION}"
        )
    if len(head) < ENVELOPE_BYTES or not head.startswith(PROTOCOL_TAG):
        return ProtocolError(
            f"frame 0 must be an envelope: {PROTOCOL_TAG!r}, a version byte, a command byte, "
            f"then the id; got {head[:16]!r}"
        )
    return ProtocolError(f"unknown command 0x{head[len(TAG)]:02x}")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


_JSON_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def _parse_header(raw: bytes) -> dict[str, Any]:
    try:
        header = _JSON_DECODER.decode(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"the header is not valid UTF-8 JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise ProtocolError(f"the header must be a JSON object; got {type(header).__name__}")
    return header


def error_frames(ident: bytes, error: IpuserveError) -> list[Frame]:
    """The ERROR message answering ``ident`` with ``error``."""
    return ErrorReply.of(ident, error).encode()


def peek_id(frames: Sequence[Frame]) -> bytes:
    """The id of a message that may be malformed, to address an error reply (or b"").

    Any message whose envelope starts with the tag has one, whatever its version or
    command, so a peer speaking another version learns why it is refused.
    """
    if not frames or not ENVELOPE_BYTES <= _nbytes(frames[0]) <= ENVELOPE_BYTES + MAX_ID_BYTES:
        return b""
    head = _small(frames[0])
    return head[ENVELOPE_BYTES:] if head.startswith(PROTOCOL_TAG) else b""


def peek_ids(frames: Sequence[Frame]) -> list[bytes]:
    """The ids a batch (JOBS, RESULTS, REQUESTS, REPLIES) that may be malformed names,
    best effort.

    A receiver that cannot decode a batch answers each job or request it can
    identify (the worker FAILs them, the broker and the client fail them), so none
    waits for its deadline.
    """
    if len(frames) < HEADER_FRAMES or _nbytes(frames[1]) > DEFAULT_LIMITS.max_header_bytes:
        return []
    if _peek_command(frames[0]) not in _BATCHES:
        return []
    try:
        header = json.loads(_small(frames[1]))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return []
    if not isinstance(header, dict):
        return []
    rows = [row for key in _ROW_KEYS for row in _as_list(header.get(key))]
    firsts = [row[0] for row in rows if isinstance(row, list) and row]
    ids = [i for first in firsts for i in (first if isinstance(first, list) else [first])]
    found = (job_id for value in ids if (job_id := _hex_id(value)) is not None)
    return list(dict.fromkeys(found))  # each id once, in order


_BATCHES = (Command.JOBS, Command.RESULTS, Command.REQUESTS, Command.REPLIES)
_ROW_KEYS = ("jobs", "results", "failures", "requests", "replies", "errors")


def _peek_command(frame: Frame) -> Command | None:
    if _nbytes(frame) > ENVELOPE_BYTES + MAX_ID_BYTES:
        return None
    found = _BY_PREFIX.get(_small(frame)[:ENVELOPE_BYTES])
    return None if found is None else found[0]


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []
