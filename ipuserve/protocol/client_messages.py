"""The messages between a client and the broker: a request and its reply or error,
the models listing, and PING/PONG. Each message's header is declared beside it (a
:class:`Header`), with its one encoder (``encode``) and one decoder (``from_wire``,
given the header msgspec decoded and validated).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec

from ipuserve.errors import IpuserveError, error_for_code
from ipuserve.protocol.envelope import DEFAULT_LIMITS, Carries, Command, Limits, bounded, frames
from ipuserve.protocol.fields import Code, Count, Duration, Header, Name, Positive, Timing
from ipuserve.protocol.schema import ModelSpec
from ipuserve.protocol.tensors import Frame, Tensors, TensorSpec, checked_specs, received

_encode = msgspec.json.encode


class RequestHeader(Header, frozen=True):
    model: Name
    tensors: tuple[TensorSpec, ...]
    timeout_ms: Duration | None = None


@dataclass(frozen=True, slots=True)
class Request:
    COMMAND: ClassVar[Command] = Command.REQUEST
    HEADER: ClassVar[type[Header]] = RequestHeader
    CARRIES: ClassVar[Carries] = Carries.ONE
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
        header = RequestHeader(self.model, self.tensors.specs, self.timeout_ms)
        return frames(self.COMMAND, self.request_id, _encode(header), self.tensors.frames)

    @classmethod
    def from_wire(
        cls, ident: bytes, header: RequestHeader, tensors: Sequence[Frame], limits: Limits
    ) -> Request:
        specs = checked_specs(header.tensors, limits, "REQUEST header field 'tensors'")
        found = received(specs, tensors, "REQUEST header", limits)
        return cls(ident, header.model, found, header.timeout_ms)


class ReplyHeader(Header, frozen=True):
    tensors: tuple[TensorSpec, ...]
    timing: Timing


@dataclass(frozen=True, slots=True)
class Reply:
    COMMAND: ClassVar[Command] = Command.REPLY
    HEADER: ClassVar[type[Header]] = ReplyHeader
    CARRIES: ClassVar[Carries] = Carries.ONE
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
        header = ReplyHeader(self.tensors.specs, dict(self.timing))
        return frames(self.COMMAND, self.request_id, _encode(header), self.tensors.frames)

    @classmethod
    def from_wire(
        cls, ident: bytes, header: ReplyHeader, tensors: Sequence[Frame], limits: Limits
    ) -> Reply:
        specs = checked_specs(header.tensors, limits, "REPLY header field 'tensors'")
        return cls(ident, received(specs, tensors, "REPLY header", limits), header.timing)


class ErrorHeader(Header, frozen=True):
    code: Code
    message: str


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """An error for one request: a wire code from ipuserve.errors and a message."""

    COMMAND: ClassVar[Command] = Command.ERROR
    HEADER: ClassVar[type[Header]] = ErrorHeader
    CARRIES: ClassVar[Carries] = Carries.NOTHING
    request_id: bytes
    code: str
    message: str

    @classmethod
    def of(cls, request_id: bytes, error: IpuserveError) -> ErrorReply:
        return cls(request_id, error.code, bounded(str(error)))

    def exception(self) -> IpuserveError:
        return error_for_code(self.code, self.message)

    def encode(self) -> list[Frame]:
        header = ErrorHeader(self.code, bounded(self.message))
        return frames(self.COMMAND, self.request_id, _encode(header))

    @classmethod
    def from_wire(cls, ident: bytes, header: ErrorHeader, _t: Any, _l: Limits) -> ErrorReply:
        return cls(ident, header.code, header.message)


class Empty(Header, frozen=True):
    """The header of a message that says everything with its command: ``{}``."""


@dataclass(frozen=True, slots=True)
class ListModels:
    COMMAND: ClassVar[Command] = Command.MODELS
    HEADER: ClassVar[type[Header]] = Empty
    CARRIES: ClassVar[Carries] = Carries.NOTHING
    request_id: bytes = b""

    def encode(self) -> list[Frame]:
        return frames(self.COMMAND, self.request_id, b"{}")

    @classmethod
    def from_wire(cls, ident: bytes, _h: Empty, _t: Any, _l: Limits) -> ListModels:
        return cls(ident)


class WorkerLoad(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One worker of a model: ``credit`` and ``in_flight`` count jobs (a group is one),
    ``requests`` the clients' requests those jobs hold."""

    worker_id: Name
    credit: Count
    in_flight: Count
    requests: Count = 0

    def to_json(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)  # type: ignore[no-any-return]


class ModelInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A model as the broker lists it; ``queued`` counts requests."""

    spec: ModelSpec
    queued: Count
    workers: tuple[WorkerLoad, ...]

    def to_json(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)  # type: ignore[no-any-return]


class ModelsHeader(Header, frozen=True):
    models: tuple[ModelInfo, ...]


@dataclass(frozen=True, slots=True)
class ModelsReply:
    COMMAND: ClassVar[Command] = Command.MODELS_REPLY
    HEADER: ClassVar[type[Header]] = ModelsHeader
    CARRIES: ClassVar[Carries] = Carries.NOTHING
    request_id: bytes
    models: tuple[ModelInfo, ...]

    def encode(self) -> list[Frame]:
        return frames(self.COMMAND, self.request_id, _encode(ModelsHeader(self.models)))

    @classmethod
    def from_wire(cls, ident: bytes, header: ModelsHeader, _t: Any, limits: Limits) -> ModelsReply:
        return cls(ident, tuple(m for m in header.models if m.spec.checked(limits)))


@dataclass(frozen=True, slots=True)
class Ping:
    COMMAND: ClassVar[Command] = Command.PING
    HEADER: ClassVar[type[Header]] = Empty
    CARRIES: ClassVar[Carries] = Carries.NOTHING
    request_id: bytes = b""

    def encode(self) -> list[Frame]:
        return frames(self.COMMAND, self.request_id, b"{}")

    @classmethod
    def from_wire(cls, ident: bytes, _h: Empty, _t: Any, _l: Limits) -> Ping:
        return cls(ident)


class PongHeader(Header, frozen=True):
    epoch: Name
    max_payload_bytes: Positive


@dataclass(frozen=True, slots=True)
class Pong:
    """Carries the broker's epoch (a random id chosen at start, so peers notice restarts)
    and its payload limit: a client refuses a bigger request itself, since ZeroMQ drops
    the connection of a peer that sends one frame far beyond it, and nobody could answer."""

    COMMAND: ClassVar[Command] = Command.PONG
    HEADER: ClassVar[type[Header]] = PongHeader
    CARRIES: ClassVar[Carries] = Carries.NOTHING
    request_id: bytes
    epoch: str
    max_payload_bytes: int = DEFAULT_LIMITS.max_payload_bytes

    def encode(self) -> list[Frame]:
        header = PongHeader(self.epoch, self.max_payload_bytes)
        return frames(self.COMMAND, self.request_id, _encode(header))

    @classmethod
    def from_wire(cls, ident: bytes, header: PongHeader, _t: Any, _l: Limits) -> Pong:
        return cls(ident, header.epoch, header.max_payload_bytes)


#: This module's messages, for ipuserve.protocol.codec.
MESSAGES = (Request, Reply, ErrorReply, ListModels, ModelsReply, Ping, Pong)
