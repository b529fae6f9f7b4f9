"""The messages between a client and the broker: a request and its reply or error,
the models listing, and PING/PONG. Each message's decoder (a :class:`_Decoder`:
its header's fields and how the message is built from them) sits right below it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ipuserve.errors import IpuserveError, error_for_code
from ipuserve.protocol.checks import (
    _ONE,
    _TENSORS,
    _as_object,
    _check_fields,
    _code,
    _count,
    _Decoder,
    _duration,
    _Field,
    _items,
    _model_spec,
    _name,
    _positive,
    _tensors,
    _text,
    _timing,
)
from ipuserve.protocol.envelope import (
    DEFAULT_LIMITS,
    Command,
    Limits,
    _bounded,
    _frames,
    _json,
    _specs_json,
)
from ipuserve.protocol.schema import ModelSpec
from ipuserve.protocol.tensors import Frame, Tensors


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


def _request(i: bytes, f: dict[str, Any], t: Sequence[Frame], lim: Limits) -> Request:
    return Request(
        i, f["model"], _tensors(f["tensors"], t, "REQUEST header", lim), f.get("timeout_ms")
    )


_REQUEST = _Decoder(
    Command.REQUEST,
    {
        "model": _Field(_name),
        "tensors": _TENSORS,
        "timeout_ms": _Field(_duration, required=False),
    },
    _request,
    tensors=_ONE,
    cacheable=True,
)


@dataclass(frozen=True, slots=True)
class Reply:
    COMMAND: ClassVar[Command] = Command.REPLY
    request_id: bytes
    tensors: Tensors
    timing: Mapping[str, float]
    #: a group (REPLIES only): the ids of the requests it answers, one member each
    group: tuple[bytes, ...] = ()
    #: ``timing`` as JSON text, when it is known already (Result.reply): sent as it is
    timing_json: str | None = field(default=None, compare=False, repr=False)

    def members(self) -> list[Reply]:
        """The group as single replies (a single reply: itself)."""
        if not self.group:
            return [self]
        parts = self.tensors.split()
        return [
            Reply(ident, part, self.timing) for ident, part in zip(self.group, parts, strict=True)
        ]

    def encode(self) -> list[Frame]:
        timing = self.timing_json
        if timing is None:
            timing = _json(dict(self.timing))
        body = f'{{"tensors":{_specs_json(self.tensors)},"timing":{timing}}}'
        return _frames(self.COMMAND, self.request_id, body, self.tensors.frames)


def _reply(i: bytes, f: dict[str, Any], t: Sequence[Frame], lim: Limits) -> Reply:
    return Reply(i, _tensors(f["tensors"], t, "REPLY header", lim), f["timing"])


_REPLY = _Decoder(
    Command.REPLY, {"tensors": _TENSORS, "timing": _Field(_timing)}, _reply, tensors=_ONE
)


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """An error for one request: a wire code from ipuserve.errors and a message."""

    COMMAND: ClassVar[Command] = Command.ERROR
    request_id: bytes
    code: str
    message: str

    @classmethod
    def of(cls, request_id: bytes, error: IpuserveError) -> ErrorReply:
        return cls(request_id, error.code, _bounded(str(error)))

    def exception(self) -> IpuserveError:
        return error_for_code(self.code, self.message)

    def encode(self) -> list[Frame]:
        header = {"code": self.code, "message": _bounded(self.message)}
        return _frames(self.COMMAND, self.request_id, header)


_ERROR = _Decoder(
    Command.ERROR,
    {"code": _Field(_code), "message": _Field(_text)},
    lambda i, f, t, lim: ErrorReply(i, f["code"], f["message"]),
)


@dataclass(frozen=True, slots=True)
class ListModels:
    COMMAND: ClassVar[Command] = Command.MODELS
    request_id: bytes = b""

    def encode(self) -> list[Frame]:
        return _frames(self.COMMAND, self.request_id, {})


_MODELS = _Decoder(Command.MODELS, {}, lambda i, f, t, lim: ListModels(i))


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


_LOAD_SCHEMA = {
    "worker_id": _Field(_name),
    "credit": _Field(_count),
    "in_flight": _Field(_count),
    "requests": _Field(_count, required=False),  # older brokers of v3 leave it out
}


def _worker_load(value: Any, limits: Limits) -> WorkerLoad:
    fields = _check_fields(_as_object(value), _LOAD_SCHEMA, "worker", limits)
    in_flight = fields["in_flight"]
    return WorkerLoad(
        fields["worker_id"], fields["credit"], in_flight, fields.get("requests", in_flight)
    )


def _worker_loads(value: Any, limits: Limits) -> tuple[WorkerLoad, ...]:
    return _items(value, 100_000, _worker_load, limits)


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """A model as the broker lists it; ``queued`` counts requests. ``group_samples``:
    the most samples the broker wants one group job to hold now (0: it takes no
    groups), for clients to form their groups by (``ipuserve.grouping``)."""

    spec: ModelSpec
    queued: int
    workers: tuple[WorkerLoad, ...]
    group_samples: int = 0

    def to_json(self) -> dict[str, Any]:
        workers = [w.to_json() for w in self.workers]
        return {
            "spec": self.spec.to_json(),
            "queued": self.queued,
            "workers": workers,
            "group_samples": self.group_samples,
        }


_INFO_SCHEMA = {
    "spec": _Field(_model_spec),
    "queued": _Field(_count),
    "workers": _Field(_worker_loads),
    "group_samples": _Field(_count, required=False),
}


def _model_info(value: Any, limits: Limits) -> ModelInfo:
    fields = _check_fields(_as_object(value), _INFO_SCHEMA, "model", limits)
    return ModelInfo(
        fields["spec"], fields["queued"], fields["workers"], fields.get("group_samples", 0)
    )


def _model_infos(value: Any, limits: Limits) -> tuple[ModelInfo, ...]:
    return _items(value, 100_000, _model_info, limits)


@dataclass(frozen=True, slots=True)
class ModelsReply:
    COMMAND: ClassVar[Command] = Command.MODELS_REPLY
    request_id: bytes
    models: tuple[ModelInfo, ...]

    def encode(self) -> list[Frame]:
        header = {"models": [m.to_json() for m in self.models]}
        return _frames(self.COMMAND, self.request_id, header)


_MODELS_REPLY = _Decoder(
    Command.MODELS_REPLY,
    {"models": _Field(_model_infos)},
    lambda i, f, t, lim: ModelsReply(i, f["models"]),
)


@dataclass(frozen=True, slots=True)
class Ping:
    COMMAND: ClassVar[Command] = Command.PING
    request_id: bytes = b""

    def encode(self) -> list[Frame]:
        return _frames(self.COMMAND, self.request_id, {})


_PING = _Decoder(Command.PING, {}, lambda i, f, t, lim: Ping(i))


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


_PONG = _Decoder(
    Command.PONG,
    {"epoch": _Field(_name), "max_payload_bytes": _Field(_positive)},
    lambda i, f, t, lim: Pong(i, f["epoch"], f["max_payload_bytes"]),
)

#: This module's decoders, for ipuserve.protocol.codec.
_DECODERS = (_REQUEST, _REPLY, _ERROR, _MODELS, _MODELS_REPLY, _PING, _PONG)
