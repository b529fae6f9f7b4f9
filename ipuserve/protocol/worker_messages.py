"""The messages between a worker and the broker besides the batches: joining (HELLO,
WELCOME), liveness (HEARTBEAT), RECONNECT and leaving (BYE). Each message's decoder
sits right below it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ipuserve.errors import ProtocolError
from ipuserve.protocol.checks import (
    _count,
    _Decoder,
    _Field,
    _interval,
    _job_ids,
    _model_specs,
    _name,
    _positive,
    _rows,
    _show,
    _text,
)
from ipuserve.protocol.envelope import DEFAULT_LIMITS, Command, Limits, _frames
from ipuserve.protocol.schema import ModelSpec
from ipuserve.protocol.tensors import Frame


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


_HELLO = _Decoder(
    Command.HELLO,
    {"worker_id": _Field(_name), "credit": _Field(_count), "models": _Field(_model_specs)},
    lambda i, f, t, lim: Hello(f["worker_id"], f["models"], f["credit"]),
)


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


def _refusal(value: Any, limits: Limits) -> tuple[str, str]:
    """``[model name, why]``: a model the broker refused."""
    if not (isinstance(value, list) and len(value) == 2):
        raise ProtocolError(f"must be [model, reason]; got {_show(value)}")
    return _name(value[0], limits), _text(value[1], limits)


_WELCOME = _Decoder(
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
)


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


_HEARTBEAT = _Decoder(
    Command.HEARTBEAT,
    {"in_flight": _Field(_count, required=False), "credit": _Field(_count, required=False)},
    lambda i, f, t, lim: Heartbeat(f.get("in_flight"), f.get("credit")),
)


@dataclass(frozen=True, slots=True)
class Reconnect:
    COMMAND: ClassVar[Command] = Command.RECONNECT

    def encode(self) -> list[Frame]:
        return _frames(self.COMMAND, b"", {})


_RECONNECT = _Decoder(Command.RECONNECT, {}, lambda i, f, t, lim: Reconnect())


@dataclass(frozen=True, slots=True)
class Bye:
    """A worker leaves; the jobs it still held and will not answer are handed back."""

    COMMAND: ClassVar[Command] = Command.BYE
    handed_back: tuple[bytes, ...] = ()

    def encode(self) -> list[Frame]:
        return _frames(self.COMMAND, b"", {"handed_back": [j.hex() for j in self.handed_back]})


_BYE = _Decoder(
    Command.BYE, {"handed_back": _Field(_job_ids)}, lambda i, f, t, lim: Bye(f["handed_back"])
)

#: This module's decoders, for ipuserve.protocol.codec.
_DECODERS = (_HELLO, _WELCOME, _HEARTBEAT, _RECONNECT, _BYE)
