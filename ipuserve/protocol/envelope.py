"""Frame 0 and the frame list: the protocol's constants, commands and limits, the
base of every message class (:class:`Wire`), and the step every encoder shares that
turns a header into a message's frames. No zmq: a ``zmq.Frame`` is read as a buffer."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from ipuserve.protocol.tensors import Frame

PROTOCOL_TAG = b"IPUS"
#: 4: headers declared as typed structs; JOBS rows carry the job's sample count.
#: 5: model versions (a request may name one, every reply says which answered) and the
#: model repository's control messages (REPOSITORY, HOST, LOAD, UNLOAD).
PROTOCOL_VERSION = 5
#: The envelope's first bytes: the protocol tag and version.
TAG = PROTOCOL_TAG + bytes([PROTOCOL_VERSION])
#: Tag, version and command: the envelope's fixed part; the id follows.
ENVELOPE_BYTES = len(TAG) + 1
MAX_ID_BYTES = 64
# MAX_NAME_CHARS, MAX_DURATION_MS: ipuserve.limits (the runtime's CLI needs them too)
#: The largest integer a header field may hold (JSON's are unbounded; 2**53: exact as a float).
MAX_COUNT = 2**53
#: Timing values are finite and below this (a Unix time in microseconds is ~1.8e15).
MAX_TIMING_VALUE = 1e18
MAX_TIMING_KEYS = 32
#: The longest error message sent (ERROR, failures): one quoting a 250 KiB field name
#: made an ERROR whose header the receiver refused, so the peer learnt nothing.
MAX_MESSAGE_CHARS = 2000
#: Envelope and header; tensor frames follow.
HEADER_FRAMES = 2
#: The deepest a header may nest arrays and objects (``{"a": [1]}`` is 2 deep). Every
#: declared header nests at most 6 deep; JSON parsers recurse per level, and msgspec
#: raises RecursionError near 1,000 (less on a deeper stack), so a header is measured
#: before anything parses it, as its bytes are counted (docs/protocol.md §3).
MAX_HEADER_DEPTH = 32


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
    REPOSITORY = 0x0A  # client (admin) -> broker: index, load, unload
    REPOSITORY_REPLY = 0x0B  # broker -> client
    HELLO = 0x10  # worker -> broker
    WELCOME = 0x11  # broker -> worker
    JOBS = 0x12  # broker -> worker
    RESULTS = 0x13  # worker -> broker  (0x14 was version 1's FAIL)
    HEARTBEAT = 0x15  # both ways
    RECONNECT = 0x16  # broker -> worker
    BYE = 0x17  # worker -> broker
    HOST = 0x18  # worker -> broker: a repository worker's IPUs, repository and versions
    LOAD = 0x19  # broker -> worker: load a version from its repository
    UNLOAD = 0x1A  # broker -> worker: drain a version and free its IPUs


#: command -> the fixed part of its envelope
ENVELOPES = {c: TAG + bytes([c]) for c in Command}


def envelope(command: Command, ident: bytes = b"") -> bytes:
    """Frame 0 of a message: for tests and tools that build frames by hand."""
    return ENVELOPES[command] + ident


@dataclass(frozen=True, slots=True)
class Limits:
    """What :func:`decode` accepts beyond what the headers declare (the payload limit is
    configurable): payload and tensors per request (per job of a batch); ``max_batch``
    bounds the rows of one batch."""

    max_payload_bytes: int = 64 << 20
    max_header_bytes: int = 256 << 10
    max_tensors: int = 64
    max_rank: int = 8
    max_elements: int = 1 << 36
    max_batch: int = 1024


DEFAULT_LIMITS = Limits()


def bounded(message: str) -> str:
    """``message`` cut to MAX_MESSAGE_CHARS, saying so."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return f"{message[: MAX_MESSAGE_CHARS - 40]}... ({len(message)} characters)"


def nbytes(frame: Frame) -> int:
    """A frame's size in bytes, whatever its kind (the type is asked: hasattr on a zmq.Frame
    runs pyzmq's Python __getattr__, 1.5-2.8 µs against 0.16, a dozen times a request)."""
    kind = type(frame)
    if kind is bytes or (kind is not memoryview and not hasattr(kind, "nbytes")):
        return len(frame)  # bytes, a zmq.Frame
    return int(frame.nbytes)  # type: ignore[union-attr]  # arrays and memoryviews


def as_bytes(frame: Frame) -> bytes:
    """A small frame (an envelope, a header) as bytes."""
    if type(frame) is bytes:
        return frame
    data = getattr(frame, "bytes", None)  # a received zmq.Frame
    return data if type(data) is bytes else bytes(frame)  # type: ignore[arg-type]


def frames(
    command: Command, ident: bytes, header: bytes, tensors: Sequence[Frame] = ()
) -> list[Frame]:
    """The frames of one message: envelope, header, tensors."""
    return [ENVELOPES[command] + ident, header, *tensors]


class Carries(enum.IntEnum):
    """Which tensor frames a command carries: none, one request's, or a batch's."""

    NOTHING = 0
    ONE = 1
    BATCH = 2

    def max_frames(self, limits: Limits) -> int:
        """Tensor frames a message of this kind may carry, checked before its header."""
        return (0, limits.max_tensors, limits.max_batch * limits.max_tensors)[self]


class Wire:
    """A message class: its command, its declared header type and the tensor frames it
    carries, given as class arguments (``class Reply(Wire, command=..., header=...,
    carries=...)``); ``decode`` finds the class by command."""

    __slots__ = ()
    COMMAND: ClassVar[Command]
    HEADER: ClassVar[type[Any]]
    CARRIES: ClassVar[Carries]

    def __init_subclass__(
        cls, command: Command | None = None, header: Any = None, carries: Carries = Carries.NOTHING
    ) -> None:
        super().__init_subclass__()
        if command is not None:  # not again when @dataclass(slots=True) remakes the class
            cls.COMMAND, cls.HEADER, cls.CARRIES = command, header, carries
