"""The ipuserve wire protocol: every message, and the only code that packs or parses frames.

Every message is one ZeroMQ multipart message (a ROUTER adds the peer's routing
identity in front; strip it before :func:`decode`)::

    frame 0   envelope   b"IPUS", one version byte (PROTOCOL_VERSION), one command
                         byte (a :class:`Command`), then the id: 0..64 bytes, the
                         client's request id, or empty
    frame 1   header     a UTF-8 JSON object, at most Limits.max_header_bytes;
                         its exact fields depend on the command (docs/protocol.md)
    frame 2.. tensors    one raw frame per tensor the header lists, in order,
                         C-ordered little-endian, exactly prod(shape) * itemsize bytes

The broker and a worker exchange batches: one JOBS message carries every job the
broker hands a worker in one turn of its loop, one RESULTS message every outcome
the worker has ready. Their headers list each job (id, tensor specs, budget or
timing) and their tensor frames follow job by job; a single job is a batch of one.
A client may batch too: REQUESTS carries the requests it has ready at once (laid
out as JOBS), and the broker then answers those requests' results in REPLIES
(laid out as RESULTS); a client that sends single REQUESTs gets single REPLYs.
A row of REQUESTS may be a *group*: several requests of one model and tensor layout
whose tensors share one frame each (members one after another); the broker and
worker carry it as one job (a JOBS/RESULTS row with a member count) and the broker
answers it in one REPLIES row (docs/protocol.md §2.3).

:func:`decode` validates all of it before anything uses it and raises
:class:`ProtocolError` (or :class:`UnsupportedVersionError`), :class:`InvalidInputError`
or :class:`PayloadTooLargeError` with a message that says what is wrong. Tensors are
kept as the received frames (forwarded by reference) and read as read-only
``np.frombuffer`` views; ``encode`` returns arrays as frames without copying them
(non-contiguous or big-endian arrays are made contiguous once). Send with
:func:`send` (or ``send_multipart(frames, copy=False)``): pyzmq copies only frames
below its copy threshold.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
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
PROTOCOL_VERSION = 3
#: The envelope's first bytes: the protocol tag and version.
TAG = PROTOCOL_TAG + bytes([PROTOCOL_VERSION])
#: Tag, version and command: the envelope's fixed part; the id follows.
ENVELOPE_BYTES = len(TAG) + 1
MAX_ID_BYTES = 64
MAX_NAME_CHARS = 256
#: Timeouts, budgets and timings are below this many milliseconds (~31 years).
MAX_DURATION_MS = 1e12
#: The largest integer a header field may hold (JSON's are unbounded; 2**53: exact as a float).
MAX_COUNT = 2**53
#: Timing values are finite and below this (a Unix time in microseconds is ~1.8e15).
MAX_TIMING_VALUE = 1e18
MAX_TIMING_KEYS = 32
#: Envelope and header; tensor frames follow.
HEADER_FRAMES = 2

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

#: ZeroMQ drops the connection of a peer sending a frame beyond a socket's
#: ``ZMQ_MAXMSGSIZE``: nobody can be answered then. Sockets set it this far above the
#: payload limit, so a frame of at most this size never trips it, whatever the limit;
#: bigger ones are refused by the sender, which learns the receiver's limit first.
FRAME_SLACK_BYTES = 1 << 20


def max_frame_bytes(max_payload_bytes: int) -> int:
    """``ZMQ_MAXMSGSIZE`` for a socket that accepts payloads of ``max_payload_bytes``."""
    return max_payload_bytes + FRAME_SLACK_BYTES


# ---------------------------------------------------------------- tensors and models


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A tensor's name, dtype name (from :data:`DTYPES`) and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    #: prod(shape) * itemsize, computed once: every message checks every frame against it.
    nbytes: int = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        wire = DTYPES.get(self.dtype)
        itemsize = wire.itemsize if wire is not None else np.dtype(self.dtype).itemsize
        object.__setattr__(self, "nbytes", math.prod(self.shape) * itemsize)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    def __str__(self) -> str:
        """``x:float32[4, 8]``, as listings and messages show a tensor."""
        return f"{self.name}:{self.dtype}{list(self.shape)}"


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

    def signature(self) -> str:
        """Everything a request must match, in a line: ``x:float32[4, 8] -> y:float32[4, 8];
        batch 4 along dimension 0`` (telling two schemas of one name apart)."""
        inputs = ", ".join(map(str, self.inputs))
        outputs = ", ".join(map(str, self.outputs))
        dim = self.batching_dim
        batching = ", no dynamic batching" if dim is None else f" along dimension {dim}"
        return f"{inputs} -> {outputs}; batch {self.batch_size}{batching}"

    def samples(self, shapes: Iterable[Sequence[int]]) -> int:
        """Samples a request whose tensors have ``shapes`` carries: the size along the
        batching dimension of the first that has it, else the compiled batch."""
        dim = self.batching_dim
        if dim is not None:
            for shape in shapes:
                if len(shape) > dim:
                    return int(shape[dim])
        return self.batch_size

    @property
    def groupable(self) -> bool:
        """Whether requests may travel as a group (one job, joined along the batching
        dimension): every input and output must have that dimension."""
        dim = self.batching_dim
        return dim is not None and all(len(t.shape) > dim for t in (*self.inputs, *self.outputs))


@dataclass(frozen=True, slots=True)
class Tensors:
    """Named tensors on the wire: specs plus one frame each (arrays, or received frames).

    A group's tensors (``members`` > 1: several requests of one layout travelling as
    one job) still have one frame per spec, holding every member's tensor, member
    after member: ``members x spec.nbytes`` bytes, as if stacked on a new first axis.
    Nobody between the client and the backend touches a member on its own.
    ``specs`` and ``nbytes`` describe one member.
    """

    specs: tuple[TensorSpec, ...] = ()
    frames: tuple[Frame, ...] = ()
    members: int = 1

    @classmethod
    def of(cls, arrays: Mapping[str, Any]) -> Tensors:
        """Wrap arrays without copying (a non-contiguous or big-endian one is copied once)."""
        specs, frames = [], []
        for name, value in arrays.items():
            array, dtype = _wire_array(name, value)
            specs.append(_spec_of(name, dtype, array.shape))
            frames.append(array)
        return cls(tuple(specs), tuple(frames))

    @classmethod
    def group(cls, members: Sequence[Tensors]) -> Tensors:
        """One group of single ``members`` with the same specs (their bytes copied once)."""
        specs = members[0].specs
        if any(m.specs != specs or m.members != 1 for m in members):
            raise ValueError("a group's members must be single and share their specs")
        if len(members) == 1:
            return members[0]
        # every frame kind (bytes, arrays, zmq.Frame, memoryview) has the buffer protocol
        frames = tuple(
            b"".join([m.frames[i] for m in members])  # type: ignore[misc]
            for i in range(len(specs))
        )
        return cls(specs, frames, len(members))

    @classmethod
    def unstacked(cls, arrays: Mapping[str, Any], members: int, dim: int) -> Tensors:
        """A group of ``members`` from a group's outputs, each array cut along ``dim``
        into equal parts (the inverse of :meth:`stacked`; no copy when ``dim`` is 0)."""
        if members == 1:
            return cls.of(arrays)
        specs, frames = [], []
        for name, value in arrays.items():
            array, dtype = _wire_array(name, value)
            shape = array.shape
            if array.ndim <= dim or shape[dim] % members:
                raise InvalidInputError(
                    f"tensor {name!r} of shape {shape} does not split into {members} "
                    f"equal parts along dimension {dim}, one per member of the group"
                )
            member = (*shape[:dim], shape[dim] // members, *shape[dim + 1 :])
            if dim:  # members side by side inside each row: bring them to the front
                split = array.reshape(*shape[:dim], members, *member[dim:])
                array = np.ascontiguousarray(np.moveaxis(split, dim, 0))
            specs.append(_spec_of(name, dtype, member))
            frames.append(array)
        return cls(tuple(specs), tuple(frames), members)

    def arrays(self) -> dict[str, np.ndarray[Any, Any]]:
        """Read-only views of the frames, keyed by name (of a single member)."""
        if self.members != 1:
            raise ValueError("a group's arrays: use split() or stacked()")
        return {
            spec.name: _view(spec, frame)
            for spec, frame in zip(self.specs, self.frames, strict=True)
        }

    def slice(self, start: int, stop: int) -> Tensors:
        """Members ``start`` to ``stop`` of a group, as views (one member: a single one)."""
        stacks = self._stacks()
        if stop - start == 1:
            return Tensors(self.specs, tuple(stack[start] for stack in stacks))
        return Tensors(self.specs, tuple(stack[start:stop] for stack in stacks), stop - start)

    def split(self) -> list[Tensors]:
        """Each member's tensors, in order, as views of the group's frames (read-only ones,
        for received frames)."""
        if self.members == 1:
            return [self]
        stacks = self._stacks()
        return [
            Tensors(self.specs, tuple(stack[i] for stack in stacks)) for i in range(self.members)
        ]

    def _stacks(self) -> list[np.ndarray[Any, Any]]:
        """Each frame as an array of shape ``(members, *spec.shape)``."""
        return [
            _view(spec, frame, self.members)
            for spec, frame in zip(self.specs, self.frames, strict=True)
        ]

    def stacked(self, dim: int) -> dict[str, np.ndarray[Any, Any]]:
        """The members' arrays joined along ``dim``, keyed by name: a group as one request
        (views of the frames when ``dim`` is 0, else one copy)."""
        if self.members == 1:
            return self.arrays()
        joined = {}
        for spec, frame in zip(self.specs, self.frames, strict=True):
            array = _view(spec, frame, self.members)  # (members, *spec.shape)
            if dim:
                array = np.concatenate(tuple(array), axis=dim)
            else:
                array = array.reshape(self.members * spec.shape[0], *spec.shape[1:])
            joined[spec.name] = array
        return joined

    @property
    def nbytes(self) -> int:
        return sum(spec.nbytes for spec in self.specs)

    def header(self) -> list[dict[str, Any]]:
        return [spec.to_json() for spec in self.specs]


#: dtype -> its wire name, for the dtypes sent as they are (allowed, little-endian):
#: a dict lookup, where ``dtype.name`` would run Python code on every call.
_WIRE_NAMES: dict[np.dtype[Any], str] = {
    dtype.newbyteorder("="): name for name, dtype in DTYPES.items() if dtype.isnative
}


def _wire_array(name: str, value: Any) -> tuple[np.ndarray[Any, Any], str]:
    """The array to send for ``value`` (itself when it can be) and its dtype's wire name."""
    array = value if type(value) is np.ndarray else np.asarray(value)
    dtype = _WIRE_NAMES.get(array.dtype)
    if dtype is not None and array.flags.c_contiguous:
        return array, dtype
    wire = DTYPES.get(array.dtype.name)
    if wire is None:
        raise InvalidInputError(
            f"tensor {name!r} has dtype {array.dtype}; allowed: {', '.join(DTYPES)}"
        )
    return np.ascontiguousarray(array, dtype=wire), array.dtype.name


#: (name, dtype, shape) -> the one TensorSpec for it: a sender (a worker's outputs, a
#: client's inputs) repeats the same specs, so equal specs are the same objects and
#: their JSON is found in _SPECS_JSON without building anything.
_SPECS: dict[tuple[str, str, tuple[int, ...]], TensorSpec] = {}
_SPECS_SIZE = 4096


def _intern(spec: TensorSpec) -> TensorSpec:
    if len(_SPECS) >= _SPECS_SIZE:
        _SPECS.clear()
    return _SPECS.setdefault((spec.name, spec.dtype, spec.shape), spec)


def _spec_of(name: str, dtype: str, shape: tuple[int, ...]) -> TensorSpec:
    spec = _SPECS.get((name, dtype, shape))
    return spec if spec is not None else _intern(TensorSpec(name, dtype, tuple(shape)))


def _view(spec: TensorSpec, frame: Frame, members: int = 1) -> np.ndarray[Any, Any]:
    """A frame as a read-only array of the spec's shape (a group's: ``(members, *shape)``)."""
    shape = spec.shape if members == 1 else (members, *spec.shape)
    if isinstance(frame, np.ndarray):
        return frame if frame.shape == shape else frame.reshape(shape)
    buffer = frame.buffer if isinstance(frame, zmq.Frame) else frame
    array = np.frombuffer(buffer, dtype=DTYPES[spec.dtype]).reshape(shape)
    array.flags.writeable = False
    return array


class _Passed:
    """(model, spec list) pairs a check passed, by identity: decoding hands out one
    tuple per distinct spec list (see _memo), so requests and results repeat it, and
    the broker and worker check each pair once, not per message. Holding the objects
    rules out a reused id."""

    _SIZE = 1024

    def __init__(self) -> None:
        self._pairs: dict[tuple[int, int], tuple[ModelSpec, Sequence[TensorSpec]]] = {}

    def __contains__(self, pair: tuple[ModelSpec, Sequence[TensorSpec]]) -> bool:
        seen = self._pairs.get((id(pair[0]), id(pair[1])))
        return seen is not None and seen[0] is pair[0] and seen[1] is pair[1]

    def add(self, model: ModelSpec, given: Sequence[TensorSpec]) -> None:
        if len(self._pairs) >= self._SIZE:
            self._pairs.clear()
        self._pairs[(id(model), id(given))] = (model, given)


_INPUTS_PASSED = _Passed()
_OUTPUTS_PASSED = _Passed()


def check_inputs(model: ModelSpec, given: Sequence[TensorSpec]) -> None:
    """Raise InvalidInputError unless ``given`` matches the model's input specs."""
    if (model, given) in _INPUTS_PASSED:
        return
    _check_inputs(model, given)
    _INPUTS_PASSED.add(model, given)


def outputs_problem(model: ModelSpec, given: Sequence[TensorSpec]) -> str | None:
    """Why a worker's outputs do not fit ``model``'s schema (names, dtypes, and shapes
    but for the batching dimension), else None: the broker checks before forwarding."""
    if (model, given) in _OUTPUTS_PASSED:
        return None
    want = {spec.name: spec for spec in model.outputs}
    got = {spec.name: spec for spec in given}
    if want.keys() != got.keys() or len(given) != len(got):
        return f"outputs {', '.join(map(str, given)) or 'none'}; the model's are " + ", ".join(
            map(str, model.outputs)
        )
    dim = model.batching_dim
    for name, spec in want.items():
        other = got[name]
        fixed = [i for i in range(len(spec.shape)) if i != dim]
        if (
            other.dtype != spec.dtype
            or len(other.shape) != len(spec.shape)
            or any(other.shape[i] != spec.shape[i] for i in fixed)
        ):
            return f"output {other}; the model's is {spec}"
    _OUTPUTS_PASSED.add(model, given)
    return None


def _check_inputs(model: ModelSpec, given: Sequence[TensorSpec]) -> None:
    expected = {spec.name: spec for spec in model.inputs}
    names = [spec.name for spec in given]
    missing = [name for name in expected if name not in names]
    if missing:
        unknown = [name for name in names if name not in expected]
        if unknown:  # most likely a misspelt name: name it first
            raise InvalidInputError(
                f"model {model.name!r} has no input {', '.join(map(repr, unknown))}; its "
                f"inputs are {', '.join(expected)} (missing: {', '.join(missing)})"
            )
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
        raise InvalidInputError(
            f"{where} must be {want.dtype}, got {got.dtype} (convert it: x.astype(np.{want.dtype}))"
        )
    dim = model.batching_dim
    free = dim is not None and len(got.shape) == len(want.shape) and got.shape[dim] >= 1
    fixed = [i for i in range(len(want.shape)) if not (free and i == dim)]
    if len(got.shape) != len(want.shape) or any(got.shape[i] != want.shape[i] for i in fixed):
        rule = "" if dim is None else f" (dimension {dim} may be any size >= 1)"
        unbatched = dim is not None and got.shape == want.shape[:dim] + want.shape[dim + 1 :]
        hint = f"; one sample still needs the batch dimension: np.expand_dims(x, {dim})"
        raise InvalidInputError(
            f"{where} must have shape {want.shape}{rule}, got {got.shape}"
            + (hint if unbatched else "")
        )


# ---------------------------------------------------------------- messages


@dataclass(frozen=True, slots=True)
class Request:
    COMMAND: ClassVar[Command] = Command.REQUEST
    request_id: bytes
    model: str
    tensors: Tensors
    timeout_ms: float | None = None
    #: a group (REQUESTS only): its requests' ids, ``request_id`` the first; ``tensors``
    #: holds one member per id. Empty for a single request.
    group: tuple[bytes, ...] = ()

    @property
    def request_ids(self) -> tuple[bytes, ...]:
        """The ids of the requests this row stands for: a group's, or its one."""
        return self.group or (self.request_id,)

    def members(self) -> list[Request]:
        """The group as single requests (a single request: itself)."""
        return self.parts(1)

    def parts(self, size: int) -> list[Request]:
        """The group as groups of at most ``size`` requests (a part of one: a single
        request), their tensors views of this group's frames."""
        if not self.group or len(self.group) <= size:
            return [self]
        parts = []
        for start in range(0, len(self.group), size):
            ids = self.group[start : start + size]
            tensors = self.tensors.slice(start, start + len(ids))
            group = ids if len(ids) > 1 else ()
            parts.append(Request(ids[0], self.model, tensors, self.timeout_ms, group))
        return parts

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
    #: a group (REPLIES only): the ids of the requests it answers, one member each
    group: tuple[bytes, ...] = ()

    def members(self) -> list[Reply]:
        """The group as single replies (a single reply: itself)."""
        if not self.group:
            return [self]
        parts = self.tensors.split()
        return [
            Reply(ident, part, self.timing) for ident, part in zip(self.group, parts, strict=True)
        ]

    def encode(self) -> list[Frame]:
        body = f'{{"tensors":{_specs_json(self.tensors)},"timing":{_json(dict(self.timing))}}}'
        return _frames(self.COMMAND, self.request_id, body, self.tensors.frames)


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """An error for one request: a wire code from ipuserve.errors and a message."""

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
    """One worker of a model: ``credit`` and ``in_flight`` count jobs (a group is one),
    ``requests`` the clients' requests those jobs hold."""

    worker_id: str
    credit: int
    in_flight: int
    requests: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            "credit": self.credit,
            "in_flight": self.in_flight,
            "requests": self.requests,
        }


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """A model as the broker lists it; ``queued`` counts requests."""

    spec: ModelSpec
    queued: int
    workers: tuple[WorkerLoad, ...]

    def to_json(self) -> dict[str, Any]:
        workers = [w.to_json() for w in self.workers]
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
    """Carries the broker's epoch (a random id chosen at start, so peers notice restarts)
    and its payload limit: a client refuses a bigger request itself, since ZeroMQ drops
    the connection of a peer that sends one frame far beyond it, and nobody could answer."""

    COMMAND: ClassVar[Command] = Command.PONG
    request_id: bytes
    epoch: str
    max_payload_bytes: int = DEFAULT_LIMITS.max_payload_bytes

    def encode(self) -> list[Frame]:
        header = {"epoch": self.epoch, "max_payload_bytes": self.max_payload_bytes}
        return _frames(self.COMMAND, self.request_id, header)


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


#: Models a broker will not route to a worker that announced them: (name, why).
Refusals = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Welcome:
    """The broker's answer to HELLO; its payload limit bounds the results a worker sends.
    ``refused`` lists the announced models the broker will not route to this worker,
    each with why (another schema than the workers already serving that name)."""

    COMMAND: ClassVar[Command] = Command.WELCOME
    epoch: str
    heartbeat_ms: int
    liveness_ms: int
    max_payload_bytes: int = DEFAULT_LIMITS.max_payload_bytes
    refused: Refusals = ()

    def encode(self) -> list[Frame]:
        header: dict[str, Any] = {
            "epoch": self.epoch,
            "heartbeat_ms": self.heartbeat_ms,
            "liveness_ms": self.liveness_ms,
            "max_payload_bytes": self.max_payload_bytes,
        }
        if self.refused:
            header["refused"] = [list(pair) for pair in self.refused]
        return _frames(self.COMMAND, b"", header)


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


# ---------------------------------------------------------------- batches (broker <-> worker)


@dataclass(frozen=True, slots=True)
class Job:
    """A request forwarded to a worker; ``budget_ms`` is the time left before its deadline."""

    job_id: bytes
    model: str
    tensors: Tensors
    budget_ms: float | None = None


@dataclass(frozen=True, slots=True)
class Result:
    job_id: bytes
    tensors: Tensors
    timing: Mapping[str, float]


@dataclass(frozen=True, slots=True)
class Fail:
    """A job that failed: a wire code from ipuserve.errors and a message."""

    job_id: bytes
    code: str
    message: str

    @classmethod
    def of(cls, job_id: bytes, error: IpuserveError) -> Fail:
        return cls(job_id, error.code, str(error))

    def exception(self) -> IpuserveError:
        return error_for_code(self.code, self.message)


@dataclass(frozen=True, slots=True)
class Jobs:
    """Jobs for one worker, sent together.

    Header ``{"specs": [{"model", "tensors"}...], "jobs": [[id hex, spec index,
    budget_ms or null]...]}``: jobs with the same model and tensor specs share one
    entry of ``specs``, so the header stays small and the receiver checks each
    distinct spec once. ``rejected`` is filled by :func:`decode` only: jobs whose
    tensor frames do not match their specs, as the FAIL their sender should get.
    """

    COMMAND: ClassVar[Command] = Command.JOBS
    jobs: tuple[Job, ...]
    rejected: tuple[Fail, ...] = ()

    @property
    def rows(self) -> int:
        return len(self.jobs)

    def halves(self) -> tuple[Jobs, Jobs]:
        middle = len(self.jobs) // 2
        return Jobs(self.jobs[:middle]), Jobs(self.jobs[middle:])

    def encode(self) -> list[Frame]:
        rows = ((j.job_id, j.model, j.tensors, j.budget_ms, ()) for j in self.jobs)
        return _encode_inputs(self.COMMAND, "jobs", rows)


@dataclass(frozen=True, slots=True)
class Requests:
    """Requests of one client, sent together: what its I/O thread had ready at once.

    Laid out as JOBS, rows ``[request id hex, spec index, timeout_ms or null]``
    under ``"requests"``. ``rejected`` is filled by :func:`decode` only: requests
    whose tensor frames do not match their specs, as the error to answer them with.
    """

    COMMAND: ClassVar[Command] = Command.REQUESTS
    requests: tuple[Request, ...]
    rejected: tuple[Fail, ...] = ()

    @property
    def rows(self) -> int:
        return len(self.requests)

    def halves(self) -> tuple[Requests, Requests]:
        middle = len(self.requests) // 2
        return Requests(self.requests[:middle]), Requests(self.requests[middle:])

    def encode(self) -> list[Frame]:
        rows = ((r.request_id, r.model, r.tensors, r.timeout_ms, r.group) for r in self.requests)
        return _encode_inputs(self.COMMAND, "requests", rows)


@dataclass(frozen=True, slots=True)
class Results:
    """Outcomes of jobs, sent together: results, and failures (a code and message each).

    Header ``{"specs": [[tensor spec...]...], "results": [[id hex, spec index,
    timing]...], "failures": [[id hex, code, message]...]}`` (``failures`` may be
    left out). :func:`decode` turns a result whose tensor frames do not match its
    specs into a failure with the error found.
    """

    COMMAND: ClassVar[Command] = Command.RESULTS
    results: tuple[Result, ...] = ()
    failures: tuple[Fail, ...] = ()

    @property
    def rows(self) -> int:
        return len(self.results) + len(self.failures)

    def halves(self) -> tuple[Results, Results]:
        first, second = _halve(self.results, self.failures)
        return Results(*first), Results(*second)

    def encode(self) -> list[Frame]:
        rows = ((r.job_id, r.tensors, r.timing, ()) for r in self.results)
        return _encode_outputs(self.COMMAND, ("results", "failures"), rows, self.failures)


@dataclass(frozen=True, slots=True)
class Replies:
    """Replies to REQUESTS rows of one client, sent together: results, and errors.

    Laid out as RESULTS, rows ``[request id hex, spec index, timing]`` under
    ``"replies"`` and ``[request id hex, code, message]`` under ``"errors"``
    (which may be left out). :func:`decode` turns a reply whose tensor frames do
    not match its specs into an error.
    """

    COMMAND: ClassVar[Command] = Command.REPLIES
    replies: tuple[Reply, ...] = ()
    errors: tuple[Fail, ...] = ()

    @property
    def rows(self) -> int:
        return len(self.replies) + len(self.errors)

    def halves(self) -> tuple[Replies, Replies]:
        first, second = _halve(self.replies, self.errors)
        return Replies(*first), Replies(*second)

    def encode(self) -> list[Frame]:
        rows = ((r.request_id, r.tensors, r.timing, r.group) for r in self.replies)
        return _encode_outputs(self.COMMAND, ("replies", "errors"), rows, self.errors)


B = TypeVar("B", "Jobs", "Requests", "Results", "Replies")


def encode_batch(message: B, limits: Limits = DEFAULT_LIMITS) -> list[list[Frame]]:
    """A batch's frames, as several messages where one would break the receiver's limits
    (``max_batch`` rows, ``max_header_bytes``): halved until each part fits."""
    return [frames for _part, frames in split_batch(message, limits)]


def split_batch(message: B, limits: Limits = DEFAULT_LIMITS) -> list[tuple[B, list[Frame]]]:
    """:func:`encode_batch`, with the part of the batch each message carries."""
    rows = message.rows
    if rows <= limits.max_batch:
        frames = message.encode()
        if rows <= 1 or _nbytes(frames[1]) <= limits.max_header_bytes:
            return [(message, frames)]
    first, second = message.halves()
    return split_batch(first, limits) + split_batch(second, limits)


def _halve(
    outputs: tuple[T, ...], failures: tuple[Fail, ...]
) -> tuple[tuple[tuple[T, ...], tuple[Fail, ...]], tuple[tuple[T, ...], tuple[Fail, ...]]]:
    """Split the rows of a RESULTS or REPLIES in two halves, outputs first."""
    middle = (len(outputs) + len(failures)) // 2
    if middle <= len(outputs):
        return (outputs[:middle], ()), (outputs[middle:], failures)
    cut = middle - len(outputs)
    return (outputs, failures[:cut]), ((), failures[cut:])


def _encode_inputs(
    command: Command,
    key: str,
    rows: Iterable[tuple[bytes, str, Tensors, float | None, tuple[bytes, ...]]],
) -> list[Frame]:
    """JOBS or REQUESTS: a spec table (model and tensors), one row per item, its frames."""
    specs = _SpecTable()
    lines: list[str] = []
    frames: list[Frame] = []
    for ident, model, tensors, milliseconds, group in rows:
        index = specs.index(tensors, model)
        ident_text, members = _row_id(ident, group), _members(tensors, group)
        lines.append(f"[{ident_text},{index},{_number(milliseconds)}{members}]")
        frames.extend(tensors.frames)
    body = f'{{"specs":[{specs.json()}],"{key}":[{",".join(lines)}]}}'
    return _frames(command, b"", body, frames)


def _encode_outputs(
    command: Command,
    keys: tuple[str, str],
    rows: Iterable[tuple[bytes, Tensors, Mapping[str, float], tuple[bytes, ...]]],
    failures: tuple[Fail, ...],
) -> list[Frame]:
    """RESULTS or REPLIES: a spec table (tensors), one row per output, its frames, failures."""
    specs = _SpecTable()
    lines: list[str] = []
    frames: list[Frame] = []
    for ident, tensors, timing, group in rows:
        index = specs.index(tensors)
        ident_text, members = _row_id(ident, group), _members(tensors, group)
        lines.append(f"[{ident_text},{index},{_json(dict(timing))}{members}]")
        frames.extend(tensors.frames)
    failed = ",".join(_json([f.job_id.hex(), f.code, f.message]) for f in failures)
    tail = f',"{keys[1]}":[{failed}]' if failures else ""
    body = f'{{"specs":[{specs.json()}],"{keys[0]}":[{",".join(lines)}]{tail}}}'
    return _frames(command, b"", body, frames)


def _row_id(ident: bytes, group: tuple[bytes, ...]) -> str:
    """A row's id: one hex id, or a group's list of them (REQUESTS, REPLIES)."""
    if not group:
        return f'"{ident.hex()}"'
    return "[" + ",".join(f'"{member.hex()}"' for member in group) + "]"


def _members(tensors: Tensors, group: tuple[bytes, ...]) -> str:
    """A JOBS or RESULTS row's fourth entry, the members of a group job (none for one)."""
    if group:  # a REQUESTS or REPLIES group: its ids count its members
        if tensors.members != len(group):
            raise ValueError(f"a group of {len(group)} ids carries {tensors.members} members")
        return ""
    return "" if tensors.members == 1 else f",{tensors.members}"


class _SpecTable:
    """The distinct tensor specs of a batch (with the model, for JOBS), as JSON entries."""

    __slots__ = ("_entries", "_index")

    def __init__(self) -> None:
        self._index: dict[tuple[str, str], int] = {}
        self._entries: list[str] = []

    def index(self, tensors: Tensors, model: str | None = None) -> int:
        specs = _specs_json(tensors)  # cached text: equal specs give the same (hashed) str
        key = (specs, model or "")
        found = self._index.get(key)
        if found is None:
            found = self._index[key] = len(self._entries)
            entry = specs if model is None else f'{{"model":{_json(model)},"tensors":{specs}}}'
            self._entries.append(entry)
        return found

    def json(self) -> str:
        return ",".join(self._entries)


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
_SPECS_JSON_SIZE = 1024


def _specs_json(tensors: Tensors) -> str:
    text = _SPECS_JSON.get(tensors.specs)
    if text is None:
        if len(_SPECS_JSON) >= _SPECS_JSON_SIZE:
            _SPECS_JSON.clear()
        text = _SPECS_JSON[tensors.specs] = _json(tensors.header())
    return text


def _frames(
    command: Command, ident: bytes, header: dict[str, Any] | str, tensors: Sequence[Frame] = ()
) -> list[Frame]:
    """The frames of one message; the hot messages pass their header as JSON text."""
    body = (header if isinstance(header, str) else _json(header)).encode("ascii")
    return [_ENVELOPES[command] + ident, body, *tensors]


# ---------------------------------------------------------------- sending and receiving
#
# pyzmq's Socket.send/recv_multipart wrap the Cython methods in Python (flag enums,
# group checks, a loop per frame): several microseconds per frame, which is most of
# a broker's time per message. These call the Cython methods of zmq.Socket's base
# class directly. Sending, the envelope and header (small bytes) are copied and
# tensor frames passed by reference (pyzmq still copies those below its copy
# threshold). Receiving, every frame comes as a zmq.Frame: measured on the Cython
# methods, that is cheaper than receiving the small frames as bytes, which needs a
# getsockopt(RCVMORE) per frame where a Frame carries ``more`` already.

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
    more = flags | _MORE
    if identity is not None:
        _SEND(sock, identity, more, True, False)
    last = len(frames) - 1
    _SEND(sock, frames[0], more, True, False)
    _SEND(sock, frames[1], flags if last == 1 else more, True, False)
    for index in range(2, last + 1):
        _SEND(sock, frames[index], flags if index == last else more, False, False)


def recv(sock: zmq.Socket[Any]) -> list[zmq.Frame]:
    """Receive one whole message as zmq.Frame objects (no copy of any frame); blocks."""
    frame = _RECV(sock, 0, False, False)
    frames = [frame]
    while frame.more:
        frame = _RECV(sock, 0, False, False)
        frames.append(frame)
    return frames


def readable(sock: zmq.Socket[Any]) -> bool:
    """A whole message waits (asked of ZMQ_EVENTS: cheaper than the zmq.Again a
    non-blocking recv raises)."""
    return bool(_GET(sock, _EVENTS) & _POLLIN)


def try_recv(sock: zmq.Socket[Any]) -> list[zmq.Frame] | None:
    """One whole message if one waits, else None."""
    return recv(sock) if readable(sock) else None


# ---------------------------------------------------------------- decoding


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


def decode(frames: Sequence[Frame], limits: Limits = DEFAULT_LIMITS) -> Message:
    """Validate and parse one message (without any routing identity)."""
    command, kind, ident = _check_envelope(frames, limits)
    fields = _header_fields(command, kind, frames[1], limits)
    return kind.build(ident, fields, frames[HEADER_FRAMES:], limits)


#: (command, header bytes) -> (limits, validated fields), for the command whose headers
#: repeat (a client sends the same model, names, dtypes and shapes again and again).
#: The cached values are immutable (str, float, tuples of frozen specs). The limits
#: are compared, not hashed: a frozen dataclass hashes in Python, on every lookup.
_FIELDS_CACHE: dict[tuple[Command, bytes], tuple[Limits, dict[str, Any]]] = {}
_FIELDS_CACHE_SIZE = 1024


def _header_fields(command: Command, kind: _Kind, frame: Frame, limits: Limits) -> dict[str, Any]:
    size = _nbytes(frame)
    if size > limits.max_header_bytes:
        raise ProtocolError(f"the header is {size} bytes; the limit is {limits.max_header_bytes}")
    raw = _small(frame)
    if not kind.cacheable:
        return kind.check(_parse_header(raw), limits)
    key = (command, raw)
    cached = _FIELDS_CACHE.get(key)
    if cached is not None and (cached[0] is limits or cached[0] == limits):
        return cached[1]
    fields = kind.check(_parse_header(raw), limits)
    if len(_FIELDS_CACHE) >= _FIELDS_CACHE_SIZE:
        _FIELDS_CACHE.clear()
    _FIELDS_CACHE[key] = (limits, fields)
    return fields


def _small(frame: Frame) -> bytes:
    if isinstance(frame, zmq.Frame):  # what sockets give: tested first
        return frame.bytes
    return frame if isinstance(frame, bytes) else bytes(frame)


def _nbytes(frame: Frame) -> int:
    kind = type(frame)
    if kind is zmq.Frame or kind is bytes:
        return len(frame)
    return frame.nbytes if isinstance(frame, np.ndarray | memoryview) else len(frame)


def _check_envelope(frames: Sequence[Frame], limits: Limits) -> tuple[Command, _Kind, bytes]:
    """The command, its kind and the id; checks the frame count against the command."""
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
    command, kind = found
    extra = len(frames) - HEADER_FRAMES
    if extra > kind.max_frames(limits):
        raise ProtocolError(
            f"{command.name} carries at most {kind.max_frames(limits)} tensor frames; got {extra}"
        )
    return command, kind, head[ENVELOPE_BYTES:]


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


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def _parse_header(raw: bytes) -> dict[str, Any]:
    try:
        header = _DECODER.decode(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
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
    for key, spec in schema.items():
        value = header.get(key, _MISSING)
        if value is _MISSING:
            if spec.required:
                raise ProtocolError(f"{where} is missing field {key!r}")
            continue
        try:
            fields[key] = spec.check(value, limits)
        except IpuserveError as exc:
            raise _at(f"{where} field {key!r}", exc) from None
    return fields


_MISSING = object()


def _tensors(
    specs: tuple[TensorSpec, ...],
    frames: Sequence[Frame],
    where: str,
    limits: Limits,
    members: int = 1,
) -> Tensors:
    """The tensors of one request or job (a group's: each frame holds every member's):
    as many frames as specs, each of the right size; the payload limit holds per member."""
    if len(frames) != len(specs):
        raise ProtocolError(
            f"{where} lists {len(specs)} tensor(s) but {len(frames)} tensor frame(s) follow"
        )
    declared = sum(spec.nbytes for spec in specs)
    if declared > limits.max_payload_bytes:
        raise PayloadTooLargeError(
            f"the tensors take {declared} bytes; the limit is {limits.max_payload_bytes}"
        )
    for spec, frame in zip(specs, frames, strict=True):
        if _nbytes(frame) != spec.nbytes * members:
            each = f" for each of {members} members" if members > 1 else ""
            raise InvalidInputError(
                f"tensor {spec.name!r} ({spec.dtype}{list(spec.shape)}) needs {spec.nbytes} "
                f"bytes{each}; its frame has {_nbytes(frame)}"
            )
    return Tensors(specs, tuple(frames), members)


def _batch_tensors(
    specs: list[tuple[tuple[TensorSpec, ...], int]],
    frames: Sequence[Frame],
    command: Command,
    limits: Limits,
) -> list[Tensors | IpuserveError]:
    """Each job's tensors (specs and members), its frames taken in order: a job whose
    frames do not match its specs gets the error instead, so one bad job does not fail
    the others (a group is one job: it fails whole)."""
    expected = sum(len(s) for s, _members in specs)
    if expected != len(frames):
        raise ProtocolError(
            f"{command.name} header lists {expected} tensor(s) but "
            f"{len(frames)} tensor frame(s) follow"
        )
    found: list[Tensors | IpuserveError] = []
    start = 0
    for job_specs, members in specs:
        end = start + len(job_specs)
        try:
            found.append(_tensors(job_specs, frames[start:end], "", limits, members))
        except (InvalidInputError, PayloadTooLargeError) as exc:
            found.append(exc)
        start = end
    return found


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
    _kind(value, str, _NAME_RULE)  # a JSON value: shown as JSON if it is no string
    problem = name_problem(value)
    if problem is not None:
        raise ProtocolError(problem)
    return str(value)


def name_problem(value: Any) -> str | None:
    """Why ``value`` cannot be a model or tensor name on the wire, else None: for
    senders, which refuse such a name before encoding it."""
    if type(value) is not str:
        return f"must be {_NAME_RULE}, not a {type(value).__name__}"
    if not 0 < len(value) <= MAX_NAME_CHARS:
        return f"must have 1..{MAX_NAME_CHARS} characters; got {len(value)}"
    if not value.isascii():
        try:  # JSON may carry a lone surrogate, which no UTF-8 log or metrics page can
            value.encode()
        except UnicodeEncodeError:
            return f"must be UTF-8 text; {value!r} holds a lone surrogate"
    return None


def _text(value: Any, _limits: Limits) -> str:
    _kind(value, str, "a string")
    return str(value)


def _count(value: Any, _limits: Limits) -> int:
    _kind(value, int, "an integer >= 0")
    if not 0 <= value <= MAX_COUNT:  # JSON integers are unbounded; floats of them are not
        raise ProtocolError(f"must be >= 0 and <= {MAX_COUNT}; got {_shown(value)}")
    return int(value)


def _positive(value: Any, limits: Limits) -> int:
    if _count(value, limits) < 1:
        raise ProtocolError(f"must be >= 1; got {value}")
    return int(value)


def _shown(number: Any) -> str:
    """A number for an error message: a 400-digit one as its start and its length."""
    text = str(number)
    return text if len(text) <= 40 else f"{text[:12]}... ({len(text)} digits)"


def _interval(value: Any, limits: Limits) -> int:
    """Whole milliseconds a peer asks us to wait: > 0 and within MAX_DURATION_MS."""
    if _positive(value, limits) >= MAX_DURATION_MS:
        raise ProtocolError(f"must be < {MAX_DURATION_MS:g} milliseconds; got {value}")
    return int(value)


def _duration(value: Any, _limits: Limits) -> float:
    _kind(value, (int, float), "a number of milliseconds > 0")
    if not 0 < value < MAX_DURATION_MS:
        raise ProtocolError(f"must be > 0 and < {MAX_DURATION_MS:g} milliseconds; got {value}")
    return float(value)


def _optional(check: Check) -> Check:
    def checked(value: Any, limits: Limits) -> Any:
        return None if value is None else check(value, limits)

    return checked


def _budget(value: Any, _limits: Limits) -> float | None:
    if value is None:
        return None
    _kind(value, (int, float), "a number of milliseconds or null")
    if not -MAX_DURATION_MS < value < MAX_DURATION_MS:
        raise ProtocolError(f"is out of range: {value}")
    return float(value)


def _code(value: Any, _limits: Limits) -> str:
    _kind(value, str, "an error code")
    if not (0 < len(value) <= 64 and value.replace("_", "").isalnum() and value.isupper()):
        raise ProtocolError(f"must be an UPPER_CASE error code; got {value[:80]!r}")
    return str(value)


def _timing(value: Any, limits: Limits) -> dict[str, float]:
    if _plain_timing(value):
        return value  # type: ignore[no-any-return]
    _kind(value, dict, "an object of numbers")
    if len(value) > MAX_TIMING_KEYS:
        raise ProtocolError(f"has {len(value)} entries; the limit is {MAX_TIMING_KEYS}")
    floats = True
    for key, number in value.items():
        _name(key, limits)
        if type(number) is not float:
            if type(number) is not int:
                raise ProtocolError(f"must be an object of numbers; {key!r} is {number!r}"[:120])
            floats = False
        if not -MAX_TIMING_VALUE < number < MAX_TIMING_VALUE:  # also inf and NaN
            raise ProtocolError(f"{key!r} is out of range: {_shown(number)}")
    return value if floats else {key: float(number) for key, number in value.items()}


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
        if dim > limits.max_elements:  # even beside a 0: numpy cannot make such a view
            raise InvalidInputError(
                f"tensor {name!r} shape {json.dumps(value)[:80]} has a dimension above "
                f"{limits.max_elements}"
            )
        elements *= dim
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
    in_flight = fields["in_flight"]
    return WorkerLoad(
        fields["worker_id"], fields["credit"], in_flight, fields.get("requests", in_flight)
    )


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


# ---------------------------------------------------------------- batches


#: A checked batch row: (id, spec index, third entry, members, the group's ids or ()).
Row: TypeAlias = tuple[bytes, int, T, int, tuple[bytes, ...]]


def _job_row(item: Any, limits: Limits) -> Row[float | None]:
    if type(item) is not list or len(item) not in (3, 4):
        raise ProtocolError(
            f"must be [job id, spec index, budget_ms(, members)]; got {_show(item)}"
        )
    members = _group_size(item[3], limits) if len(item) == 4 else 1
    return _job_id(item[0], limits), _count(item[1], limits), _budget(item[2], limits), members, ()


def _result_row(item: Any, limits: Limits) -> Row[dict[str, float]]:
    if type(item) is not list or len(item) not in (3, 4):
        raise ProtocolError(f"must be [job id, spec index, timing(, members)]; got {_show(item)}")
    members = _group_size(item[3], limits) if len(item) == 4 else 1
    return _job_id(item[0], limits), _count(item[1], limits), _timing(item[2], limits), members, ()


def _request_row(item: Any, limits: Limits) -> Row[float | None]:
    if type(item) is not list or len(item) != 3:
        raise ProtocolError(
            f"must be [request id or [request ids], spec index, timeout_ms]; got {_show(item)}"
        )
    ident, group = _row_ids(item[0], limits)
    timeout = _optional(_duration)(item[2], limits)
    return ident, _count(item[1], limits), timeout, len(group) or 1, group


def _reply_row(item: Any, limits: Limits) -> Row[dict[str, float]]:
    if type(item) is not list or len(item) != 3:
        raise ProtocolError(
            f"must be [request id or [request ids], spec index, timing]; got {_show(item)}"
        )
    ident, group = _row_ids(item[0], limits)
    return ident, _count(item[1], limits), _timing(item[2], limits), len(group) or 1, group


def _row_ids(value: Any, limits: Limits) -> tuple[bytes, tuple[bytes, ...]]:
    """A REQUESTS or REPLIES row's id, or a group's ids (then the first is the row's id)."""
    if type(value) is not list:
        return _job_id(value, limits), ()
    group = _items(value, limits.max_batch, _job_id, limits)
    if not group:
        raise ProtocolError("a group lists no ids")
    if len(set(group)) != len(group):
        raise ProtocolError("a group lists an id twice")
    return group[0], group


def _group_size(value: Any, limits: Limits) -> int:
    if type(value) is not int or not 1 <= value <= limits.max_batch:
        raise ProtocolError(
            f"members must be an integer in 1..{limits.max_batch}; got {_show(value)}"
        )
    return value


def _failure_row(item: Any, limits: Limits) -> Fail:
    if type(item) is not list or len(item) != 3:
        raise ProtocolError(f"must be [job id, code, message]; got {_show(item)}")
    return Fail(_job_id(item[0], limits), _code(item[1], limits), _text(item[2], limits))


def _job_rows(value: Any, limits: Limits) -> tuple[Row[float | None], ...]:
    return _batch_rows(value, limits, _plain_budget, _job_row)


def _request_rows(value: Any, limits: Limits) -> tuple[Row[float | None], ...]:
    return _batch_rows(value, limits, _plain_timeout, _request_row)


def _result_rows(value: Any, limits: Limits) -> tuple[Row[dict[str, float]], ...]:
    return _batch_rows(value, limits, _plain_timing, _result_row)


def _reply_rows(value: Any, limits: Limits) -> tuple[Row[dict[str, float]], ...]:
    return _batch_rows(value, limits, _plain_timing, _reply_row)


def _batch_rows(
    value: Any,
    limits: Limits,
    plain_third: Callable[[Any], bool],
    full_check: Callable[[Any, Limits], Row[T]],
) -> tuple[Row[T], ...]:
    """Rows of a batch, ``[id hex, spec index, third]``. The usual row passes
    one inline test (``plain_third`` for its third entry); any other row (a group,
    too) gets ``full_check``, which accepts it or says what is wrong and where."""
    checked: list[Row[T]] = []
    single: tuple[bytes, ...] = ()
    for index, row in enumerate(_list(value, limits.max_batch)):
        if type(row) is list and len(row) == 3:
            job_id, spec, third = row
            if (
                type(spec) is int
                and spec >= 0
                and plain_third(third)
                and (raw := _hex_id(job_id)) is not None
            ):
                checked.append((raw, spec, third, 1, single))
                continue
        checked.append(_item_at(index, row, full_check, limits))
    return tuple(checked)


def _plain_budget(value: Any) -> bool:
    """A budget as senders write it (null, or a float well inside the JSON range)."""
    return value is None or (type(value) is float and -MAX_DURATION_MS < value < MAX_DURATION_MS)


def _plain_timeout(value: Any) -> bool:
    """A request's timeout as senders write it (null, or a float > 0 in range)."""
    return value is None or (type(value) is float and 0 < value < MAX_DURATION_MS)


def _hex_id(value: Any) -> bytes | None:
    """A job id in hex, or None for anything the full check must look at."""
    if type(value) is not str or len(value) > 2 * MAX_ID_BYTES:
        return None
    try:
        return bytes.fromhex(value)
    except ValueError:
        return None


def _plain_timing(value: Any) -> bool:
    """A timing object as senders write it (float values, short names): used as it is."""
    if type(value) is not dict or len(value) > MAX_TIMING_KEYS:
        return False
    return all(
        type(number) is float
        and 0 < len(key) <= MAX_NAME_CHARS
        and -MAX_TIMING_VALUE < number < MAX_TIMING_VALUE  # JSON's 1e400 is inf
        for key, number in value.items()
    )


def _item_at(index: int, item: Any, check: Callable[[Any, Limits], T], limits: Limits) -> T:
    try:
        return check(item, limits)
    except IpuserveError as exc:
        raise _at(f"[{index}]", exc) from None


def _memo(check: Check) -> Check:
    """``check``, remembered by the checked value's repr.

    For parsed JSON the repr is exact (it tells 1 from 1.0 and from True), so each
    distinct spec list or spec table is checked once; the results are immutable.
    A batch's or a reply's specs repeat from message to message.
    """
    memo: dict[str, tuple[Limits, Any]] = {}

    def checked(value: Any, limits: Limits) -> Any:
        try:
            key = repr(value)
        except RecursionError:  # nested deeper than any valid value: the check refuses it
            return check(value, limits)
        found = memo.get(key)
        if found is not None and (found[0] is limits or found[0] == limits):
            return found[1]
        result = check(value, limits)
        if len(memo) >= _MEMO_SIZE:
            memo.clear()
        memo[key] = (limits, result)
        return result

    return checked


_MEMO_SIZE = 1024


def _show(value: Any) -> str:
    return json.dumps(value)[:80]


def _job_spec(value: Any, limits: Limits) -> tuple[str, tuple[TensorSpec, ...]]:
    fields = _check_fields(_as_object(value), _JOB_SPEC_SCHEMA, "spec", limits)
    return fields["model"], fields["tensors"]


def _refusal(value: Any, limits: Limits) -> tuple[str, str]:
    """``[model name, why]``: a model the broker refused."""
    if not (isinstance(value, list) and len(value) == 2):
        raise ProtocolError(f"must be [model, reason]; got {_show(value)}")
    return _name(value[0], limits), _text(value[1], limits)


def _rows(check: Callable[[Any, Limits], T]) -> Check:
    def rows(value: Any, limits: Limits) -> tuple[T, ...]:
        return _items(value, limits.max_batch, check, limits)

    return rows


def _pick(table: tuple[T, ...], indices: list[int], rows: str) -> list[T]:
    """The spec table entries rows refer to; an index past the table is a bad message."""
    if indices and max(indices) >= len(table):
        row = next(n for n, index in enumerate(indices) if index >= len(table))
        raise ProtocolError(
            f"{rows}[{row}] names spec {indices[row]}; the header lists {len(table)} spec(s)"
        )
    return [table[index] for index in indices]


InputRow: TypeAlias = tuple[bytes, str, Tensors, "float | None", tuple[bytes, ...]]
OutputRow: TypeAlias = tuple[bytes, Tensors, dict[str, float], tuple[bytes, ...]]


def _inputs(
    fields: dict[str, Any], frames: Sequence[Frame], key: str, command: Command, limits: Limits
) -> tuple[list[InputRow], tuple[Fail, ...]]:
    """The rows of a JOBS or REQUESTS as (id, model, tensors, milliseconds, group), and
    the rows whose frames do not match their specs as failures (one per group member)."""
    rows: tuple[Row[float | None], ...] = fields[key]
    picked = _pick(fields["specs"], [row[1] for row in rows], key)
    layouts = [(specs, row[3]) for row, (_model, specs) in zip(rows, picked, strict=True)]
    found = _batch_tensors(layouts, frames, command, limits)
    good: list[InputRow] = []
    rejected = []
    for (ident, _index, ms, _n, group), (model, _specs), tensors in zip(
        rows, picked, found, strict=True
    ):
        if isinstance(tensors, Tensors):
            good.append((ident, model, tensors, ms, group))
        else:
            rejected += [Fail.of(member, tensors) for member in group or (ident,)]
    return good, tuple(rejected)


def _outputs(
    fields: dict[str, Any],
    frames: Sequence[Frame],
    keys: tuple[str, str],
    command: Command,
    limits: Limits,
) -> tuple[list[OutputRow], tuple[Fail, ...]]:
    """The rows of a RESULTS or REPLIES as (id, tensors, timing, group), and its failures
    (those listed, then the rows whose frames do not match their specs, one per group
    member)."""
    rows: tuple[Row[dict[str, float]], ...] = fields[keys[0]]
    picked = _pick(fields["specs"], [row[1] for row in rows], keys[0])
    found = _batch_tensors(
        [(specs, row[3]) for row, specs in zip(rows, picked, strict=True)], frames, command, limits
    )
    good: list[OutputRow] = []
    failures = list(fields.get(keys[1], ()))
    for (ident, _index, timing, _n, group), tensors in zip(rows, found, strict=True):
        if isinstance(tensors, Tensors):
            good.append((ident, tensors, timing, group))
        else:
            failures += [Fail.of(member, tensors) for member in group or (ident,)]
    return good, tuple(failures)


def _build_jobs(_i: bytes, fields: dict[str, Any], frames: Sequence[Frame], lim: Limits) -> Jobs:
    good, rejected = _inputs(fields, frames, "jobs", Command.JOBS, lim)
    return Jobs(tuple(Job(*row[:4]) for row in good), rejected)


def _build_requests(
    _i: bytes, fields: dict[str, Any], frames: Sequence[Frame], lim: Limits
) -> Requests:
    good, rejected = _inputs(fields, frames, "requests", Command.REQUESTS, lim)
    return Requests(tuple(Request(*row) for row in good), rejected)


def _build_results(
    _i: bytes, fields: dict[str, Any], frames: Sequence[Frame], lim: Limits
) -> Results:
    good, failures = _outputs(fields, frames, ("results", "failures"), Command.RESULTS, lim)
    return Results(tuple(Result(*row[:3]) for row in good), failures)


def _build_replies(
    _i: bytes, fields: dict[str, Any], frames: Sequence[Frame], lim: Limits
) -> Replies:
    good, errors = _outputs(fields, frames, ("replies", "errors"), Command.REPLIES, lim)
    return Replies(tuple(Reply(*row) for row in good), errors)


_TENSORS = _Field(_memo(_tensor_specs))
_MODEL_SCHEMA = {
    "name": _Field(_name),
    "inputs": _TENSORS,
    "outputs": _TENSORS,
    "batch_size": _Field(_positive),
    "batching_dim": _Field(_optional(_count)),
}
_LOAD_SCHEMA = {
    "worker_id": _Field(_name),
    "credit": _Field(_count),
    "in_flight": _Field(_count),
    "requests": _Field(_count, required=False),  # older brokers of v3 leave it out
}
_INFO_SCHEMA = {
    "spec": _Field(_model_spec),
    "queued": _Field(_count),
    "workers": _Field(_worker_loads),
}
_JOB_SPEC_SCHEMA = {"model": _Field(_name), "tensors": _TENSORS}

# Which tensor frames a command carries: none, one request's, or a batch's (job by job).
_NONE, _ONE, _BATCH = 0, 1, 2


@dataclass(frozen=True, slots=True)
class _Kind:
    command: Command
    schema: Mapping[str, _Field]
    build: Callable[[bytes, dict[str, Any], Sequence[Frame], Limits], Message]
    tensors: int = _NONE
    cacheable: bool = False
    #: how error messages name the header (kept: an enum's name is a property)
    where: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "where", f"{self.command.name} header")

    def check(self, header: dict[str, Any], limits: Limits) -> dict[str, Any]:
        return _check_fields(header, self.schema, self.where, limits)

    def max_frames(self, limits: Limits) -> int:
        """Tensor frames a message of this kind may carry, checked before its header is read."""
        return (0, limits.max_tensors, limits.max_batch * limits.max_tensors)[self.tensors]


def _request(i: bytes, f: dict[str, Any], t: Sequence[Frame], lim: Limits) -> Request:
    return Request(
        i, f["model"], _tensors(f["tensors"], t, "REQUEST header", lim), f.get("timeout_ms")
    )


def _reply(i: bytes, f: dict[str, Any], t: Sequence[Frame], lim: Limits) -> Reply:
    return Reply(i, _tensors(f["tensors"], t, "REPLY header", lim), f["timing"])


_KINDS: dict[Command, _Kind] = {
    Command.REQUEST: _Kind(
        Command.REQUEST,
        {
            "model": _Field(_name),
            "tensors": _TENSORS,
            "timeout_ms": _Field(_duration, required=False),
        },
        _request,
        tensors=_ONE,
        cacheable=True,
    ),
    Command.REPLY: _Kind(
        Command.REPLY, {"tensors": _TENSORS, "timing": _Field(_timing)}, _reply, tensors=_ONE
    ),
    Command.ERROR: _Kind(
        Command.ERROR,
        {"code": _Field(_code), "message": _Field(_text)},
        lambda i, f, t, lim: ErrorReply(i, f["code"], f["message"]),
    ),
    Command.MODELS: _Kind(Command.MODELS, {}, lambda i, f, t, lim: ListModels(i)),
    Command.MODELS_REPLY: _Kind(
        Command.MODELS_REPLY,
        {"models": _Field(_model_infos)},
        lambda i, f, t, lim: ModelsReply(i, f["models"]),
    ),
    Command.PING: _Kind(Command.PING, {}, lambda i, f, t, lim: Ping(i)),
    Command.PONG: _Kind(
        Command.PONG,
        {"epoch": _Field(_name), "max_payload_bytes": _Field(_positive)},
        lambda i, f, t, lim: Pong(i, f["epoch"], f["max_payload_bytes"]),
    ),
    Command.HELLO: _Kind(
        Command.HELLO,
        {"worker_id": _Field(_name), "credit": _Field(_count), "models": _Field(_model_specs)},
        lambda i, f, t, lim: Hello(f["worker_id"], f["models"], f["credit"]),
    ),
    Command.WELCOME: _Kind(
        Command.WELCOME,
        {
            "epoch": _Field(_name),
            "heartbeat_ms": _Field(_interval),
            "liveness_ms": _Field(_interval),
            "max_payload_bytes": _Field(_positive),
            "refused": _Field(_rows(_refusal), required=False),
        },
        lambda i, f, t, lim: Welcome(
            f["epoch"],
            f["heartbeat_ms"],
            f["liveness_ms"],
            f["max_payload_bytes"],
            f.get("refused", ()),
        ),
    ),
    Command.JOBS: _Kind(
        Command.JOBS,
        {"specs": _Field(_memo(_rows(_job_spec))), "jobs": _Field(_job_rows)},
        _build_jobs,
        tensors=_BATCH,
    ),
    Command.RESULTS: _Kind(
        Command.RESULTS,
        {
            "specs": _Field(_memo(_rows(_tensor_specs))),
            "results": _Field(_result_rows),
            "failures": _Field(_rows(_failure_row), required=False),
        },
        _build_results,
        tensors=_BATCH,
    ),
    Command.REQUESTS: _Kind(
        Command.REQUESTS,
        {"specs": _Field(_memo(_rows(_job_spec))), "requests": _Field(_request_rows)},
        _build_requests,
        tensors=_BATCH,
    ),
    Command.REPLIES: _Kind(
        Command.REPLIES,
        {
            "specs": _Field(_memo(_rows(_tensor_specs))),
            "replies": _Field(_reply_rows),
            "errors": _Field(_rows(_failure_row), required=False),
        },
        _build_replies,
        tensors=_BATCH,
    ),
    Command.HEARTBEAT: _Kind(
        Command.HEARTBEAT,
        {"in_flight": _Field(_count, required=False), "credit": _Field(_count, required=False)},
        lambda i, f, t, lim: Heartbeat(f.get("in_flight"), f.get("credit")),
    ),
    Command.RECONNECT: _Kind(Command.RECONNECT, {}, lambda i, f, t, lim: Reconnect()),
    Command.BYE: _Kind(
        Command.BYE, {"handed_back": _Field(_job_ids)}, lambda i, f, t, lim: Bye(f["handed_back"])
    ),
}

#: envelope prefix (tag, version, command) -> (command, kind): one lookup checks all three.
_BY_PREFIX: dict[bytes, tuple[Command, _Kind]] = {
    _ENVELOPES[command]: (command, kind) for command, kind in _KINDS.items()
}
