"""The messages between a client and the broker: a request and its reply or error, the
models listing, PING and PONG; each with its declared :class:`Header`, its encoder
(``encode``) and its decoder (``from_wire``, given the header msgspec validated)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import msgspec

from ipuserve.protocol.envelope import Carries, Command, Limits, Wire, bounded, frames
from ipuserve.protocol.failures import Coded
from ipuserve.protocol.fields import (
    Code,
    Count,
    Duration,
    Header,
    Name,
    Positive,
    Timing,
    Version,
    finite,
    finite_timing,
)
from ipuserve.protocol.schema import ModelSpec
from ipuserve.protocol.tensors import Frame, Specs, Tensors, checked_specs, received

_encode = msgspec.json.encode


class RequestHeader(Header, frozen=True):
    model: Name
    tensors: Specs
    timeout_ms: Duration | None = None
    version: Version | None = None


@dataclass(frozen=True, slots=True)
class Request(Wire, command=Command.REQUEST, header=RequestHeader, carries=Carries.ONE):
    request_id: bytes
    model: str
    tensors: Tensors
    timeout_ms: float | None = None
    #: a group (REQUESTS only): its requests' ids, ``request_id`` the first; ``tensors``
    #: holds one member per id. Empty for a single request.
    group: tuple[bytes, ...] = ()
    #: the model version asked for; None: the model's default version
    version: str | None = None

    @property
    def request_ids(self) -> tuple[bytes, ...]:
        """The ids of the requests this row stands for: a group's, or its one."""
        return self.group or (self.request_id,)

    def members(self) -> list[Request]:
        """The group as single requests, their tensors views of its frames."""
        split = zip(self.request_ids, self.tensors.split(), strict=True)
        model, timeout, version = self.model, self.timeout_ms, self.version
        return [Request(ident, model, one, timeout, (), version) for ident, one in split]

    def encode(self) -> list[Frame]:
        timeout = finite(self.timeout_ms, "timeout_ms")
        header = RequestHeader(self.model, self.tensors.specs, timeout, self.version)
        return _with_tensors(self, header)

    @classmethod
    def from_wire(cls, i: bytes, h: RequestHeader, t: Sequence[Frame], lim: Limits) -> Request:
        tensors = _tensors(cls.COMMAND, h.tensors, t, lim)
        return cls(i, h.model, tensors, h.timeout_ms, (), h.version)


class ReplyHeader(Header, frozen=True):
    tensors: Specs
    timing: Timing
    version: Version | None = None


@dataclass(frozen=True, slots=True)
class Reply(Wire, command=Command.REPLY, header=ReplyHeader, carries=Carries.ONE):
    request_id: bytes
    tensors: Tensors
    timing: Mapping[str, float]
    #: a group (REPLIES only): the ids of the requests it answers, one member each
    group: tuple[bytes, ...] = ()
    #: the model version that answered (None: a peer that does not say)
    version: str | None = None

    def members(self) -> list[Reply]:
        """The group as single replies (a single reply: itself)."""
        if not self.group:
            return [self]
        parts = zip(self.group, self.tensors.split(), strict=True)
        return [Reply(ident, part, self.timing, (), self.version) for ident, part in parts]

    def encode(self) -> list[Frame]:
        timing = finite_timing(self.timing)
        return _with_tensors(self, ReplyHeader(self.tensors.specs, timing, self.version))

    @classmethod
    def from_wire(cls, i: bytes, h: ReplyHeader, t: Sequence[Frame], lim: Limits) -> Reply:
        return cls(i, _tensors(cls.COMMAND, h.tensors, t, lim), h.timing, (), h.version)


def _with_tensors(message: Request | Reply, header: Header) -> list[Frame]:
    """A REQUEST's or REPLY's frames: its envelope, ``header``, its tensors."""
    return frames(message.COMMAND, message.request_id, _encode(header), message.tensors.frames)


def _tensors(command: Command, specs: Specs, tensors: Sequence[Frame], lim: Limits) -> Tensors:
    """A REQUEST's or REPLY's tensors, checked against the receiver's limits."""
    checked_specs(specs, lim, command, "$.tensors")
    return received(specs, tensors, _WHERE[command], lim)


_WHERE = {Command.REQUEST: "REQUEST header", Command.REPLY: "REPLY header"}


class ErrorHeader(Header, frozen=True):
    code: Code
    message: str


@dataclass(frozen=True, slots=True)
class ErrorReply(Coded, Wire, command=Command.ERROR, header=ErrorHeader):
    """An error for one request."""

    request_id: bytes
    code: str
    message: str

    def encode(self) -> list[Frame]:
        header = ErrorHeader(self.code, bounded(self.message))
        return frames(self.COMMAND, self.request_id, _encode(header))

    @classmethod
    def from_wire(cls, ident: bytes, header: ErrorHeader, _t: Any, _l: Limits) -> ErrorReply:
        return cls(ident, header.code, header.message)


class Empty(Header, frozen=True):
    """The header of a message that says everything with its command: ``{}``."""


@dataclass(frozen=True, slots=True)
class _Asking(Wire):
    """A question that its command says all of: ``{}`` and the id to answer."""

    request_id: bytes = b""

    def encode(self) -> list[Frame]:
        return frames(self.COMMAND, self.request_id, b"{}")

    @classmethod
    def from_wire(cls, ident: bytes, _h: Empty, _t: Any, _l: Limits) -> Any:
        return cls(ident)


@dataclass(frozen=True, slots=True)
class ListModels(_Asking, command=Command.MODELS, header=Empty):
    pass


@dataclass(frozen=True, slots=True)
class Ping(_Asking, command=Command.PING, header=Empty):
    pass


class WorkerLoad(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One worker of a model: ``credit`` and ``in_flight`` count jobs (a group is one),
    ``requests`` the clients' requests those jobs hold."""

    worker_id: Name
    credit: Count
    in_flight: Count
    requests: Count  # required since version 4: a missing count would read as 0

    def to_json(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)  # type: ignore[no-any-return]


class ModelInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A model as the broker lists it; ``queued`` counts requests. ``group_samples``:
    the most samples the broker wants one group job to hold now (0: it takes no
    groups), for clients to form their groups by (``ipuserve.grouping``)."""

    spec: ModelSpec
    queued: Count
    workers: tuple[WorkerLoad, ...]
    group_samples: Count = 0

    def to_json(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)  # type: ignore[no-any-return]


class ModelsHeader(Header, frozen=True):
    models: tuple[ModelInfo, ...]


@dataclass(frozen=True, slots=True)
class ModelsReply(Wire, command=Command.MODELS_REPLY, header=ModelsHeader):
    request_id: bytes
    models: tuple[ModelInfo, ...]

    def encode(self) -> list[Frame]:
        return frames(self.COMMAND, self.request_id, _encode(ModelsHeader(self.models)))

    @classmethod
    def from_wire(cls, ident: bytes, header: ModelsHeader, _t: Any, limits: Limits) -> ModelsReply:
        return cls(ident, tuple(m for m in header.models if m.spec.checked(limits, cls.COMMAND)))


class PongHeader(Header, frozen=True):
    epoch: Name
    max_payload_bytes: Positive


@dataclass(frozen=True, slots=True)
class Pong(Wire, command=Command.PONG, header=PongHeader):
    """Carries the broker's epoch (a random id chosen at start, so peers notice restarts)
    and its payload limit: a client refuses a bigger request itself, since ZeroMQ drops
    the connection of a peer that sends one frame far beyond it, and nobody could answer."""

    request_id: bytes
    epoch: str
    max_payload_bytes: int = Limits().max_payload_bytes

    def encode(self) -> list[Frame]:
        header = PongHeader(self.epoch, self.max_payload_bytes)
        return frames(self.COMMAND, self.request_id, _encode(header))

    @classmethod
    def from_wire(cls, ident: bytes, header: PongHeader, _t: Any, _l: Limits) -> Pong:
        return cls(ident, header.epoch, header.max_payload_bytes)


#: This module's messages, for ipuserve.protocol.codec.
MESSAGES = (Request, Reply, ErrorReply, ListModels, ModelsReply, Ping, Pong)
ClientMessage: TypeAlias = Request | Reply | ErrorReply | ListModels | ModelsReply | Ping | Pong
