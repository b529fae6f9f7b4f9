"""The ipuserve wire protocol: every message, and the only code that packs or parses frames.

Every message is one ZeroMQ multipart message (a ROUTER adds the peer's routing
identity in front; strip it before :func:`decode`)::

    frame 0   tag        b"IPUS" + one version byte (PROTOCOL_VERSION)
    frame 1   command    one byte, a :class:`Command`
    frame 2   id         0..64 bytes: the client's request id, or the broker's job id
    frame 3   header     a UTF-8 JSON object, at most Limits.max_header_bytes;
                         its exact fields depend on the command (docs/protocol.md)
    frame 4.. tensors    one raw frame per entry of header["tensors"], in order,
                         C-ordered little-endian, exactly prod(shape) * itemsize bytes

:func:`decode` validates all of it before anything uses it and raises
:class:`ProtocolError` (or :class:`UnsupportedVersionError`), :class:`InvalidInputError`
or :class:`PayloadTooLargeError` with a message that says what is wrong. Tensors are
kept as the received frames (forwarded by reference) and read as read-only
``np.frombuffer`` views; ``encode`` returns arrays as frames without copying them
(non-contiguous or big-endian arrays are made contiguous once). Send with
``send_multipart(frames, copy=False)``: pyzmq copies only frames below its copy
threshold.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeAlias, TypeVar

import numpy as np
import zmq

from ipuserve.errors import (
    InvalidInputError,
    IpuserveError,
    PayloadTooLargeError,
    ProtocolError,
    UnsupportedVersionError,
    error_for_code,
)

PROTOCOL_TAG = b"IPUS"
PROTOCOL_VERSION = 1
TAG_FRAME = PROTOCOL_TAG + bytes([PROTOCOL_VERSION])
MAX_ID_BYTES = 64
MAX_NAME_CHARS = 256
MAX_TIMING_KEYS = 32
HEADER_FRAMES = 4

#: dtype name -> wire dtype (little-endian); the allow-list.
DTYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(name).newbyteorder("<")
    for name in (
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
    )
}

#: Anything pyzmq can send: bytes, a received zmq.Frame, a numpy array, a memoryview.
Frame: TypeAlias = "bytes | zmq.Frame | np.ndarray[Any, Any] | memoryview"


class Command(enum.IntEnum):
    REQUEST = 0x01  # client -> broker
    REPLY = 0x02  # broker -> client
    ERROR = 0x03  # broker -> client
    MODELS = 0x04  # client -> broker
    MODELS_REPLY = 0x05  # broker -> client
    PING = 0x06  # client -> broker
    PONG = 0x07  # broker -> client
    HELLO = 0x10  # worker -> broker
    WELCOME = 0x11  # broker -> worker
    JOB = 0x12  # broker -> worker
    RESULT = 0x13  # worker -> broker
    FAIL = 0x14  # worker -> broker
    HEARTBEAT = 0x15  # both ways
    RECONNECT = 0x16  # broker -> worker
    BYE = 0x17  # worker -> broker


_CMD_FRAMES = {c: bytes([c]) for c in Command}


@dataclass(frozen=True, slots=True)
class Limits:
    """What :func:`decode` accepts; the broker and worker make the payload limit configurable."""

    max_payload_bytes: int = 64 << 20
    max_header_bytes: int = 256 << 10
    max_tensors: int = 64
    max_rank: int = 8
    max_elements: int = 1 << 36


DEFAULT_LIMITS = Limits()


# ---------------------------------------------------------------- tensors and models


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A tensor's name, dtype name (from :data:`DTYPES`) and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What a worker serves: input/output specs at the compiled batch, and how it batches.

    With ``batching_dim`` set, a request may have any size >= 1 along that dimension
    (the same for every input); every other dimension must match. Without it, a
    request's shapes must match exactly.
    """

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    batch_size: int = 1
    batching_dim: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "inputs": [t.to_json() for t in self.inputs],
            "outputs": [t.to_json() for t in self.outputs],
            "batch_size": self.batch_size,
            "batching_dim": self.batching_dim,
        }


@dataclass(frozen=True, slots=True)
class Tensors:
    """Named tensors on the wire: specs plus one frame each (arrays, or received frames)."""

    specs: tuple[TensorSpec, ...] = ()
    frames: tuple[Frame, ...] = ()

    @classmethod
    def of(cls, arrays: Mapping[str, Any]) -> Tensors:
        """Wrap arrays without copying (a non-contiguous or big-endian one is copied once)."""
        specs, frames = [], []
        for name, value in arrays.items():
            array = _wire_array(name, value)
            specs.append(TensorSpec(name, array.dtype.name, tuple(array.shape)))
            frames.append(array)
        return cls(tuple(specs), tuple(frames))

    def arrays(self) -> dict[str, np.ndarray[Any, Any]]:
        """Read-only views of the frames, keyed by name."""
        return {
            spec.name: _view(spec, frame)
            for spec, frame in zip(self.specs, self.frames, strict=True)
        }

    @property
    def nbytes(self) -> int:
        return sum(spec.nbytes for spec in self.specs)

    def header(self) -> list[dict[str, Any]]:
        return [spec.to_json() for spec in self.specs]


def _wire_array(name: str, value: Any) -> np.ndarray[Any, Any]:
    array = np.asarray(value)
    wire = DTYPES.get(array.dtype.name)
    if wire is None:
        raise InvalidInputError(
            f"tensor {name!r} has dtype {array.dtype}; allowed: {', '.join(DTYPES)}"
        )
    if array.flags.c_contiguous and array.dtype.byteorder != ">":
        return array
    return np.ascontiguousarray(array, dtype=wire)


def _view(spec: TensorSpec, frame: Frame) -> np.ndarray[Any, Any]:
    if isinstance(frame, np.ndarray):
        return frame
    buffer = frame.buffer if isinstance(frame, zmq.Frame) else frame
    array = np.frombuffer(buffer, dtype=DTYPES[spec.dtype]).reshape(spec.shape)
    array.flags.writeable = False
    return array


def check_inputs(model: ModelSpec, given: Sequence[TensorSpec]) -> None:
    """Raise InvalidInputError unless ``given`` matches the model's input specs."""
    expected = {spec.name: spec for spec in model.inputs}
    names = [spec.name for spec in given]
    missing = [name for name in expected if name not in names]
    if missing:
        raise InvalidInputError(
            f"model {model.name!r} needs inputs {', '.join(expected)}; "
            f"missing: {', '.join(missing)}"
        )
    batches: dict[str, int] = {}
    for spec in given:
        want = expected.get(spec.name)
        if want is None:
            raise InvalidInputError(
                f"model {model.name!r} has no input {spec.name!r} (inputs: {', '.join(expected)})"
            )
        _check_input(model, want, spec)
        if model.batching_dim is not None:
            batches[spec.name] = spec.shape[model.batching_dim]
    if len(set(batches.values())) > 1:
        raise InvalidInputError(
            f"inputs of model {model.name!r} disagree on the batch size "
            f"along dimension {model.batching_dim}: {batches}"
        )


def _check_input(model: ModelSpec, want: TensorSpec, got: TensorSpec) -> None:
    where = f"input {got.name!r} of model {model.name!r}"
    if got.dtype != want.dtype:
        raise InvalidInputError(f"{where} must be {want.dtype}, got {got.dtype}")
    dim = model.batching_dim
    free = dim is not None and len(got.shape) == len(want.shape) and got.shape[dim] >= 1
    fixed = [i for i in range(len(want.shape)) if not (free and i == dim)]
    if len(got.shape) != len(want.shape) or any(got.shape[i] != want.shape[i] for i in fixed):
        rule = "" if dim is None else f" (dimension {dim} may be any size >= 1)"
        raise InvalidInputError(f"{where} must have shape {want.shape}{rule}, got {got.shape}")


# ---------------------------------------------------------------- messages


@dataclass(frozen=True, slots=True)
class Request:
    COMMAND: ClassVar[Command] = Command.REQUEST
    request_id: bytes
    model: str
    tensors: Tensors
    timeout_ms: float | None = None

    def encode(self) -> list[Frame]:
        timeout = "" if self.timeout_ms is None else f',"timeout_ms":{_json(self.timeout_ms)}'
        body = f'{{"model":{_json(self.model)},"tensors":{_specs_json(self.tensors)}{timeout}}}'
        return _frames(self.COMMAND, self.request_id, body, self.tensors.frames)


@dataclass(frozen=True, slots=True)
class Reply:
    COMMAND: ClassVar[Command] = Command.REPLY
    request_id: bytes
    tensors: Tensors
    timing: Mapping[str, float]

    def encode(self) -> list[Frame]:
        body = f'{{"tensors":{_specs_json(self.tensors)},"timing":{_json(dict(self.timing))}}}'
        return _frames(self.COMMAND, self.request_id, body, self.tensors.frames)


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """An error for one request (or one job): a wire code from ipuserve.errors and a message."""

    COMMAND: ClassVar[Command] = Command.ERROR
    request_id: bytes
    code: str
    message: str

    @classmethod
    def of(cls, request_id: bytes, error: IpuserveError) -> ErrorReply:
        return cls(request_id, error.code, str(error))

    def exception(self) -> IpuserveError:
        return error_for_code(self.code, self.message)

    def encode(self) -> list[Frame]:
        header = {"code": self.code, "message": self.message}
        return _frames(self.COMMAND, self.request_id, header)


@dataclass(frozen=True, slots=True)
class ListModels:
    COMMAND: ClassVar[Command] = Command.MODELS
    request_id: bytes = b""

    def encode(self) -> list[Frame]:
        return _frames(self.COMMAND, self.request_id, {})


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    worker_id: str
    credit: int
    in_flight: int


@dataclass(frozen=True, slots=True)
class ModelInfo:
    spec: ModelSpec
    queued: int
    workers: tuple[WorkerLoad, ...]

    def to_json(self) -> dict[str, Any]:
        workers = [
            {"worker_id": w.worker_id, "credit": w.credit, "in_flight": w.in_flight}
            for w in self.workers
        ]
        return {"spec": self.spec.to_json(), "queued": self.queued, "workers": workers}


@dataclass(frozen=True, slots=True)
class ModelsReply:
    COMMAND: ClassVar[Command] = Command.MODELS_REPLY
    request_id: bytes
    models: tuple[ModelInfo, ...]

    def encode(self) -> list[Frame]:
        header = {"models": [m.to_json() for m in self.models]}
        return _frames(self.COMMAND, self.request_id, header)


@dataclass(frozen=True, slots=True)
class Ping:
    COMMAND: ClassVar[Command] = Command.PING
    request_id: bytes = b""

    def encode(self) -> list[Frame]:
        return _frames(self.COMMAND, self.request_id, {})


@dataclass(frozen=True, slots=True)
class Pong:
    """Carries the broker's epoch: a random id chosen at start, so peers notice restarts."""

    COMMAND: ClassVar[Command] = Command.PONG
    request_id: bytes
    epoch: str

    def encode(self) -> list[Frame]:
        return _frames(self.COMMAND, self.request_id, {"epoch": self.epoch})


@dataclass(frozen=True, slots=True)
class Hello:
    COMMAND: ClassVar[Command] = Command.HELLO
    worker_id: str
    models: tuple[ModelSpec, ...]
    credit: int

    def encode(self) -> list[Frame]:
        header = {
            "worker_id": self.worker_id,
            "credit": self.credit,
            "models": [m.to_json() for m in self.models],
        }
        return _frames(self.COMMAND, b"", header)


@dataclass(frozen=True, slots=True)
class Welcome:
    COMMAND: ClassVar[Command] = Command.WELCOME
    epoch: str
    heartbeat_ms: int
    liveness_ms: int

    def encode(self) -> list[Frame]:
        header = {
            "epoch": self.epoch,
            "heartbeat_ms": self.heartbeat_ms,
            "liveness_ms": self.liveness_ms,
        }
        return _frames(self.COMMAND, b"", header)


@dataclass(frozen=True, slots=True)
class Job:
    """A request forwarded to a worker; ``budget_ms`` is the time left before its deadline."""

    COMMAND: ClassVar[Command] = Command.JOB
    job_id: bytes
    model: str
    tensors: Tensors
    budget_ms: float | None = None

    def encode(self) -> list[Frame]:
        budget = "null" if self.budget_ms is None else _json(self.budget_ms)
        specs = _specs_json(self.tensors)
        body = f'{{"model":{_json(self.model)},"tensors":{specs},"budget_ms":{budget}}}'
        return _frames(self.COMMAND, self.job_id, body, self.tensors.frames)


@dataclass(frozen=True, slots=True)
class Result:
    COMMAND: ClassVar[Command] = Command.RESULT
    job_id: bytes
    tensors: Tensors
    timing: Mapping[str, float]

    def encode(self) -> list[Frame]:
        body = f'{{"tensors":{_specs_json(self.tensors)},"timing":{_json(dict(self.timing))}}}'
        return _frames(self.COMMAND, self.job_id, body, self.tensors.frames)


@dataclass(frozen=True, slots=True)
class Fail:
    COMMAND: ClassVar[Command] = Command.FAIL
    job_id: bytes
    code: str
    message: str

    @classmethod
    def of(cls, job_id: bytes, error: IpuserveError) -> Fail:
        return cls(job_id, error.code, str(error))

    def encode(self) -> list[Frame]:
        return _frames(self.COMMAND, self.job_id, {"code": self.code, "message": self.message})


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Both ways. A worker reports ``in_flight`` and may change its ``credit`` (0 = draining)."""

    COMMAND: ClassVar[Command] = Command.HEARTBEAT
    in_flight: int | None = None
    credit: int | None = None

    def encode(self) -> list[Frame]:
        header = {
            k: v
            for k, v in (("in_flight", self.in_flight), ("credit", self.credit))
            if v is not None
        }
        return _frames(self.COMMAND, b"", header)


@dataclass(frozen=True, slots=True)
class Reconnect:
    COMMAND: ClassVar[Command] = Command.RECONNECT

    def encode(self) -> list[Frame]:
        return _frames(self.COMMAND, b"", {})


@dataclass(frozen=True, slots=True)
class Bye:
    """A worker leaves; the jobs it still held and will not answer are handed back."""

    COMMAND: ClassVar[Command] = Command.BYE
    handed_back: tuple[bytes, ...] = ()

    def encode(self) -> list[Frame]:
        return _frames(self.COMMAND, b"", {"handed_back": [j.hex() for j in self.handed_back]})


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
    | Job
    | Result
    | Fail
    | Heartbeat
    | Reconnect
    | Bye
)

_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)


_json = _ENCODER.encode

#: Tensor specs -> their JSON list: the hot messages repeat the same specs.
_SPECS_JSON: dict[tuple[TensorSpec, ...], str] = {}


def _specs_json(tensors: Tensors) -> str:
    text = _SPECS_JSON.get(tensors.specs)
    if text is None:
        if len(_SPECS_JSON) >= _FIELDS_CACHE_SIZE:
            _SPECS_JSON.clear()
        text = _SPECS_JSON[tensors.specs] = _json(tensors.header())
    return text


def _frames(
    command: Command, ident: bytes, header: dict[str, Any] | str, tensors: tuple[Frame, ...] = ()
) -> list[Frame]:
    """The frames of one message; the hot messages pass their header as JSON text."""
    body = (header if isinstance(header, str) else _json(header)).encode("ascii")
    return [TAG_FRAME, _CMD_FRAMES[command], ident, body, *tensors]


# ---------------------------------------------------------------- sending and receiving
#
# pyzmq's Socket.send/recv_multipart wrap the Cython methods in Python (flag enums,
# group checks, a loop per frame): several microseconds per frame, which is most of
# a broker's time per message. These call the Cython methods of zmq.Socket's base
# class directly; the header frames (small bytes) are copied, tensor frames are
# passed by reference (pyzmq still copies those below its copy threshold).

_BASE = next(
    (c for c in zmq.Socket.__mro__[1:] if {"send", "recv", "get"} <= vars(c).keys()), zmq.Socket
)
_SEND: Callable[..., Any] = getattr(_BASE, "send")  # noqa: B009  (a Cython base class)
_RECV: Callable[..., Any] = getattr(_BASE, "recv")  # noqa: B009
_GET: Callable[..., Any] = getattr(_BASE, "get")  # noqa: B009
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_MORE = int(zmq.SNDMORE)
_NOBLOCK = int(zmq.NOBLOCK)


def send(
    sock: zmq.Socket[Any],
    frames: Sequence[Frame],
    *,
    identity: bytes | None = None,
    nonblock: bool = False,
) -> None:
    """Send one encoded message, behind ``identity`` on a ROUTER.

    With ``nonblock``, zmq.Again (peer's pipe full) or a ZMQError (EHOSTUNREACH under
    ROUTER_MANDATORY) is raised by the first frame, before anything was queued.
    """
    flags = _NOBLOCK if nonblock else 0
    if identity is not None:
        _SEND(sock, identity, flags | _MORE, True, False)
    last = len(frames) - 1
    for index, frame in enumerate(frames):
        _SEND(sock, frame, flags if index == last else flags | _MORE, index < HEADER_FRAMES, False)


def recv(sock: zmq.Socket[Any]) -> list[zmq.Frame]:
    """Receive one whole message as zmq.Frame objects (no copy of any frame); blocks."""
    frame = _RECV(sock, 0, False, False)
    frames = [frame]
    while frame.more:
        frame = _RECV(sock, 0, False, False)
        frames.append(frame)
    return frames


def try_recv(sock: zmq.Socket[Any]) -> list[zmq.Frame] | None:
    """One whole message if one waits, else None (asked of ZMQ_EVENTS, which is
    cheaper than the zmq.Again a non-blocking recv raises)."""
    if not _GET(sock, _EVENTS) & _POLLIN:
        return None
    return recv(sock)


# ---------------------------------------------------------------- decoding


def error_frames(ident: bytes, error: IpuserveError) -> list[Frame]:
    """The ERROR message answering ``ident`` with ``error``."""
    return ErrorReply.of(ident, error).encode()


def peek_id(frames: Sequence[Frame]) -> bytes:
    """The id frame of a message that may be malformed, to address an error reply (or b"")."""
    if len(frames) > 2 and _nbytes(frames[2]) <= MAX_ID_BYTES:
        return _small(frames[2])
    return b""


def decode(frames: Sequence[Frame], limits: Limits = DEFAULT_LIMITS) -> Message:
    """Validate and parse one message (without any routing identity)."""
    command = _check_envelope(frames, limits)
    kind = _KINDS[command]
    fields = _header_fields(command, kind, frames[3], limits)
    tensors = _tensors(fields, frames[HEADER_FRAMES:], command, limits)
    return kind.build(_small(frames[2]), fields, tensors)


#: (command, limits, header bytes) -> validated fields, for the hot commands whose
#: headers repeat (a client sends the same model, names, dtypes and shapes again and
#: again). The cached values are immutable (str, float, tuples of frozen specs).
_FIELDS_CACHE: dict[tuple[Command, Limits, bytes], dict[str, Any]] = {}
_FIELDS_CACHE_SIZE = 1024


def _header_fields(command: Command, kind: _Kind, frame: Frame, limits: Limits) -> dict[str, Any]:
    size = _nbytes(frame)
    if size > limits.max_header_bytes:
        raise ProtocolError(f"the header is {size} bytes; the limit is {limits.max_header_bytes}")
    raw = _small(frame)
    key = (command, limits, raw)
    fields = _FIELDS_CACHE.get(key) if kind.cacheable else None
    if fields is None:
        fields = _check_fields(_parse_header(raw), kind.schema, f"{command.name} header", limits)
        if kind.cacheable:
            if len(_FIELDS_CACHE) >= _FIELDS_CACHE_SIZE:
                _FIELDS_CACHE.clear()
            _FIELDS_CACHE[key] = fields
    return fields


def _small(frame: Frame) -> bytes:
    if isinstance(frame, bytes):
        return frame
    return frame.bytes if isinstance(frame, zmq.Frame) else bytes(frame)


def _nbytes(frame: Frame) -> int:
    return frame.nbytes if isinstance(frame, np.ndarray | memoryview) else len(frame)


def _check_envelope(frames: Sequence[Frame], limits: Limits) -> Command:
    if len(frames) < HEADER_FRAMES:
        raise ProtocolError(
            f"a message needs at least {HEADER_FRAMES} frames "
            f"(tag, command, id, header); got {len(frames)}"
        )
    tag = _small(frames[0])
    if tag[:4] != PROTOCOL_TAG or len(tag) != 5:
        raise ProtocolError(f"frame 0 must be the protocol tag {TAG_FRAME!r}; got {tag[:16]!r}")
    if tag[4] != PROTOCOL_VERSION:
        raise UnsupportedVersionError(
            f"protocol version {tag[4]} is not supported; this peer speaks {PROTOCOL_VERSION}"
        )
    command = _command(_small(frames[1]))
    if _nbytes(frames[2]) > MAX_ID_BYTES:
        raise ProtocolError(
            f"the id frame is {_nbytes(frames[2])} bytes; the limit is {MAX_ID_BYTES}"
        )
    extra = len(frames) - HEADER_FRAMES
    allowed = limits.max_tensors if _KINDS[command].has_tensors else 0
    if extra > allowed:
        raise ProtocolError(f"{command.name} carries at most {allowed} tensor frames; got {extra}")
    return command


def _command(frame: bytes) -> Command:
    if len(frame) != 1:
        raise ProtocolError(f"the command frame must be 1 byte; got {len(frame)}")
    try:
        return Command(frame[0])
    except ValueError:
        raise ProtocolError(f"unknown command 0x{frame[0]:02x}") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def _parse_header(raw: bytes) -> dict[str, Any]:
    try:
        header = _DECODER.decode(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"the header is not valid UTF-8 JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise ProtocolError(f"the header must be a JSON object; got {type(header).__name__}")
    return header


Check: TypeAlias = Callable[[Any, Limits], Any]
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class _Field:
    check: Check
    required: bool = True


def _check_fields(
    header: dict[str, Any], schema: Mapping[str, _Field], where: str, limits: Limits
) -> dict[str, Any]:
    if len(header) > len(schema) or any(key not in schema for key in header):
        unknown = ", ".join(key for key in header if key not in schema)
        raise ProtocolError(
            f"{where} has unknown field(s) {unknown}; expected {', '.join(schema) or 'none'}"
        )
    fields = {}
    for key, field in schema.items():
        value = header.get(key, _MISSING)
        if value is _MISSING:
            if field.required:
                raise ProtocolError(f"{where} is missing field {key!r}")
            continue
        try:
            fields[key] = field.check(value, limits)
        except IpuserveError as exc:
            raise _at(f"{where} field {key!r}", exc) from None
    return fields


_MISSING = object()


def _tensors(
    fields: dict[str, Any], frames: Sequence[Frame], command: Command, limits: Limits
) -> Tensors:
    specs: tuple[TensorSpec, ...] = fields.get("tensors", ())
    if len(frames) != len(specs):
        raise ProtocolError(
            f"{command.name} header lists {len(specs)} tensor(s) but "
            f"{len(frames)} tensor frame(s) follow"
        )
    declared = sum(spec.nbytes for spec in specs)
    if declared > limits.max_payload_bytes:
        raise PayloadTooLargeError(
            f"the tensors take {declared} bytes; the limit is {limits.max_payload_bytes}"
        )
    for spec, frame in zip(specs, frames, strict=True):
        if _nbytes(frame) != spec.nbytes:
            raise InvalidInputError(
                f"tensor {spec.name!r} ({spec.dtype}{list(spec.shape)}) needs {spec.nbytes} "
                f"bytes; its frame has {_nbytes(frame)}"
            )
    return Tensors(specs, tuple(frames))


# ---------------------------------------------------------------- field checks
#
# A check takes (value, limits) and raises without saying where; the caller that
# knows the location (a header field, a list index) adds it on the way out, so the
# valid path never formats a location string.


def _at(where: str, error: IpuserveError) -> IpuserveError:
    """The same error, its message prefixed with where it happened (ProtocolError only:
    InvalidInputError messages already name their tensor)."""
    if isinstance(error, ProtocolError):
        return type(error)(f"{where}: {error}")
    return error


def _kind(value: Any, types: type | tuple[type, ...], what: str) -> None:
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in _tuple(types)):
        raise ProtocolError(f"must be {what}; got {json.dumps(value)[:80]}")


def _tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


_NAME_RULE = f"a string of 1..{MAX_NAME_CHARS} characters"


def _name(value: Any, _limits: Limits) -> str:
    if type(value) is not str or not 0 < len(value) <= MAX_NAME_CHARS:
        _kind(value, str, _NAME_RULE)
        raise ProtocolError(f"must have 1..{MAX_NAME_CHARS} characters; got {len(value)}")
    return value


def _text(value: Any, _limits: Limits) -> str:
    _kind(value, str, "a string")
    return str(value)


def _count(value: Any, _limits: Limits) -> int:
    _kind(value, int, "an integer >= 0")
    if value < 0:
        raise ProtocolError(f"must be >= 0; got {value}")
    return int(value)


def _positive(value: Any, limits: Limits) -> int:
    if _count(value, limits) < 1:
        raise ProtocolError(f"must be >= 1; got {value}")
    return int(value)


def _duration(value: Any, _limits: Limits) -> float:
    _kind(value, (int, float), "a number of milliseconds > 0")
    if not 0 < value < 1e12:
        raise ProtocolError(f"must be > 0 and < 1e12 milliseconds; got {value}")
    return float(value)


def _optional(check: Check) -> Check:
    def checked(value: Any, limits: Limits) -> Any:
        return None if value is None else check(value, limits)

    return checked


def _budget(value: Any, _limits: Limits) -> float | None:
    if value is None:
        return None
    _kind(value, (int, float), "a number of milliseconds or null")
    if not -1e12 < value < 1e12:
        raise ProtocolError(f"is out of range: {value}")
    return float(value)


def _code(value: Any, _limits: Limits) -> str:
    _kind(value, str, "an error code")
    if not (0 < len(value) <= 64 and value.replace("_", "").isalnum() and value.isupper()):
        raise ProtocolError(f"must be an UPPER_CASE error code; got {value[:80]!r}")
    return str(value)


def _timing(value: Any, limits: Limits) -> dict[str, float]:
    _kind(value, dict, "an object of numbers")
    if len(value) > MAX_TIMING_KEYS:
        raise ProtocolError(f"has {len(value)} entries; the limit is {MAX_TIMING_KEYS}")
    for key, number in value.items():
        _name(key, limits)
        if type(number) is not float and type(number) is not int:
            raise ProtocolError(f"must be an object of numbers; {key!r} is {number!r}"[:120])
    return {key: float(number) for key, number in value.items()}


def _list(value: Any, limit: int) -> list[Any]:
    _kind(value, list, "a list")
    if len(value) > limit:
        raise ProtocolError(f"has {len(value)} entries; the limit is {limit}")
    return value  # type: ignore[no-any-return]


def _items(
    value: Any, limit: int, check: Callable[[Any, Limits], T], limits: Limits
) -> tuple[T, ...]:
    """Check each entry of a JSON list, naming the index of a bad one."""
    checked = []
    for index, item in enumerate(_list(value, limit)):
        try:
            checked.append(check(item, limits))
        except IpuserveError as exc:
            raise _at(f"[{index}]", exc) from None
    return tuple(checked)


def _tensor_specs(value: Any, limits: Limits) -> tuple[TensorSpec, ...]:
    specs = _items(value, limits.max_tensors, _tensor_spec, limits)
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise InvalidInputError(f"a tensor is named twice: {names}")
    return specs


_SPEC_KEYS = {"name", "dtype", "shape"}


def _tensor_spec(item: Any, limits: Limits) -> TensorSpec:
    if type(item) is not dict or item.keys() != _SPEC_KEYS:
        _kind(item, dict, "an object {name, dtype, shape}")
        raise ProtocolError(
            f"must have exactly the fields name, dtype, shape; got {', '.join(item)}"
        )
    name = _name(item["name"], limits)
    dtype = item["dtype"]
    if type(dtype) is not str or dtype not in DTYPES:
        raise InvalidInputError(
            f"tensor {name!r} has dtype {json.dumps(dtype)[:40]}; allowed: {', '.join(DTYPES)}"
        )
    return TensorSpec(name, dtype, _shape(item["shape"], name, limits))


def _shape(value: Any, name: str, limits: Limits) -> tuple[int, ...]:
    if type(value) is not list or len(value) > limits.max_rank:
        raise InvalidInputError(
            f"tensor {name!r} shape must be a list of at most "
            f"{limits.max_rank} integers; got {json.dumps(value)[:80]}"
        )
    elements = 1
    for dim in value:
        if type(dim) is not int or dim < 0:
            raise InvalidInputError(
                f"tensor {name!r} shape {json.dumps(value)[:80]} must hold integers >= 0"
            )
        elements *= min(dim, limits.max_elements + 1)  # bounded: never a huge product
        if elements > limits.max_elements:
            raise InvalidInputError(
                f"tensor {name!r} shape {value} has more than {limits.max_elements} elements"
            )
    return tuple(value)


def _model_spec(value: Any, limits: Limits) -> ModelSpec:
    fields = _check_fields(_as_object(value), _MODEL_SCHEMA, "model spec", limits)
    spec = ModelSpec(
        fields["name"],
        fields["inputs"],
        fields["outputs"],
        fields["batch_size"],
        fields["batching_dim"],
    )
    dim = spec.batching_dim
    if dim is not None and any(dim >= len(t.shape) for t in spec.inputs + spec.outputs):
        raise ProtocolError(f"batching_dim {dim} exceeds the rank of a tensor")
    return spec


def _as_object(value: Any) -> dict[str, Any]:
    _kind(value, dict, "an object")
    return value  # type: ignore[no-any-return]


def _model_specs(value: Any, limits: Limits) -> tuple[ModelSpec, ...]:
    return _items(value, 1024, _model_spec, limits)


def _worker_load(value: Any, limits: Limits) -> WorkerLoad:
    fields = _check_fields(_as_object(value), _LOAD_SCHEMA, "worker", limits)
    return WorkerLoad(fields["worker_id"], fields["credit"], fields["in_flight"])


def _model_info(value: Any, limits: Limits) -> ModelInfo:
    fields = _check_fields(_as_object(value), _INFO_SCHEMA, "model", limits)
    return ModelInfo(fields["spec"], fields["queued"], fields["workers"])


def _worker_loads(value: Any, limits: Limits) -> tuple[WorkerLoad, ...]:
    return _items(value, 100_000, _worker_load, limits)


def _model_infos(value: Any, limits: Limits) -> tuple[ModelInfo, ...]:
    return _items(value, 100_000, _model_info, limits)


def _job_id(item: Any, _limits: Limits) -> bytes:
    _kind(item, str, "a hex job id")
    try:
        job_id = bytes.fromhex(item)
    except ValueError:
        raise ProtocolError(f"{item[:80]!r} is not a hex job id") from None
    if len(job_id) > MAX_ID_BYTES:
        raise ProtocolError(f"a job id is longer than {MAX_ID_BYTES} bytes")
    return job_id


def _job_ids(value: Any, limits: Limits) -> tuple[bytes, ...]:
    return _items(value, 1_000_000, _job_id, limits)


_MODEL_SCHEMA = {
    "name": _Field(_name),
    "inputs": _Field(_tensor_specs),
    "outputs": _Field(_tensor_specs),
    "batch_size": _Field(_positive),
    "batching_dim": _Field(_optional(_count)),
}
_LOAD_SCHEMA = {"worker_id": _Field(_name), "credit": _Field(_count), "in_flight": _Field(_count)}
_INFO_SCHEMA = {
    "spec": _Field(_model_spec),
    "queued": _Field(_count),
    "workers": _Field(_worker_loads),
}


@dataclass(frozen=True, slots=True)
class _Kind:
    schema: Mapping[str, _Field]
    build: Callable[[bytes, dict[str, Any], Tensors], Message]
    has_tensors: bool = False
    cacheable: bool = False


_TENSORS = _Field(_tensor_specs)
_KINDS: dict[Command, _Kind] = {
    Command.REQUEST: _Kind(
        {
            "model": _Field(_name),
            "tensors": _TENSORS,
            "timeout_ms": _Field(_duration, required=False),
        },
        lambda i, f, t: Request(i, f["model"], t, f.get("timeout_ms")),
        has_tensors=True,
        cacheable=True,
    ),
    Command.REPLY: _Kind(
        {"tensors": _TENSORS, "timing": _Field(_timing)},
        lambda i, f, t: Reply(i, t, f["timing"]),
        has_tensors=True,
    ),
    Command.ERROR: _Kind(
        {"code": _Field(_code), "message": _Field(_text)},
        lambda i, f, t: ErrorReply(i, f["code"], f["message"]),
    ),
    Command.MODELS: _Kind({}, lambda i, f, t: ListModels(i)),
    Command.MODELS_REPLY: _Kind(
        {"models": _Field(_model_infos)}, lambda i, f, t: ModelsReply(i, f["models"])
    ),
    Command.PING: _Kind({}, lambda i, f, t: Ping(i)),
    Command.PONG: _Kind({"epoch": _Field(_name)}, lambda i, f, t: Pong(i, f["epoch"])),
    Command.HELLO: _Kind(
        {"worker_id": _Field(_name), "credit": _Field(_count), "models": _Field(_model_specs)},
        lambda i, f, t: Hello(f["worker_id"], f["models"], f["credit"]),
    ),
    Command.WELCOME: _Kind(
        {
            "epoch": _Field(_name),
            "heartbeat_ms": _Field(_positive),
            "liveness_ms": _Field(_positive),
        },
        lambda i, f, t: Welcome(f["epoch"], f["heartbeat_ms"], f["liveness_ms"]),
    ),
    Command.JOB: _Kind(
        {"model": _Field(_name), "tensors": _TENSORS, "budget_ms": _Field(_budget)},
        lambda i, f, t: Job(i, f["model"], t, f["budget_ms"]),
        has_tensors=True,
        cacheable=True,
    ),
    Command.RESULT: _Kind(
        {"tensors": _TENSORS, "timing": _Field(_timing)},
        lambda i, f, t: Result(i, t, f["timing"]),
        has_tensors=True,
    ),
    Command.FAIL: _Kind(
        {"code": _Field(_code), "message": _Field(_text)},
        lambda i, f, t: Fail(i, f["code"], f["message"]),
    ),
    Command.HEARTBEAT: _Kind(
        {"in_flight": _Field(_count, required=False), "credit": _Field(_count, required=False)},
        lambda i, f, t: Heartbeat(f.get("in_flight"), f.get("credit")),
    ),
    Command.RECONNECT: _Kind({}, lambda i, f, t: Reconnect()),
    Command.BYE: _Kind({"handed_back": _Field(_job_ids)}, lambda i, f, t: Bye(f["handed_back"])),
}
