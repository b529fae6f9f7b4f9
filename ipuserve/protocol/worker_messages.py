"""The messages between a worker and the broker besides the batches: HELLO, WELCOME,
HEARTBEAT, RECONNECT, BYE. They carry no id and no tensors, so each is its own declared
header: msgspec decodes and validates it straight into the class."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, TypeAlias

import msgspec

from ipuserve.protocol.envelope import DEFAULT_LIMITS, Carries, Command, Limits, frames
from ipuserve.protocol.fields import Count, Header, HexId, Interval, Name, Positive, hex_id
from ipuserve.protocol.schema import ModelSpec
from ipuserve.protocol.tensors import Frame

#: Models a broker will not route to a worker that announced them: (name, why).
Refusals = tuple[tuple[str, str], ...]


class PlainMessage(Header, frozen=True):
    """A message that is its header: the class decodes itself."""

    COMMAND: ClassVar[Command]
    CARRIES: ClassVar[Carries] = Carries.NOTHING

    def encode(self) -> list[Frame]:
        return frames(self.COMMAND, b"", msgspec.json.encode(self))

    @classmethod
    def from_wire(cls, _i: bytes, header: Any, _t: Sequence[Frame], limits: Limits) -> Any:
        return header.checked(limits)

    def checked(self, _limits: Limits) -> Any:
        """This message within a receiver's limits (beyond what its fields declare)."""
        return self


class Hello(PlainMessage, frozen=True):
    COMMAND: ClassVar[Command] = Command.HELLO
    worker_id: Name
    models: tuple[ModelSpec, ...]
    credit: Count

    def checked(self, limits: Limits) -> Hello:
        for model in self.models:
            model.checked(limits, self.COMMAND)
        return self


class Welcome(PlainMessage, frozen=True):
    """The broker's answer to HELLO; its payload limit bounds the results a worker sends.
    ``refused`` lists the announced models the broker will not route to this worker,
    each with why (another schema than the workers already serving that name)."""

    COMMAND: ClassVar[Command] = Command.WELCOME
    epoch: Name
    heartbeat_ms: Interval
    liveness_ms: Interval
    max_payload_bytes: Positive = DEFAULT_LIMITS.max_payload_bytes
    refused: tuple[tuple[Name, str], ...] = ()


class Heartbeat(PlainMessage, frozen=True):
    """Both ways. A worker reports ``in_flight`` and may change its ``credit`` (0 = draining)."""

    COMMAND: ClassVar[Command] = Command.HEARTBEAT
    in_flight: Count | None = None
    credit: Count | None = None


class Reconnect(PlainMessage, frozen=True):
    COMMAND: ClassVar[Command] = Command.RECONNECT


class ByeHeader(Header, frozen=True):
    handed_back: tuple[HexId, ...]


class Bye(PlainMessage, frozen=True):
    """A worker leaves; the jobs it still held and will not answer are handed back."""

    COMMAND: ClassVar[Command] = Command.BYE
    HEADER: ClassVar[type[Header]] = ByeHeader
    handed_back: tuple[bytes, ...] = ()

    def encode(self) -> list[Frame]:
        body = msgspec.json.encode(ByeHeader(tuple(j.hex() for j in self.handed_back)))
        return frames(self.COMMAND, b"", body)

    @classmethod
    def from_wire(cls, _i: bytes, header: Any, _t: Sequence[Frame], _l: Limits) -> Bye:
        where = "BYE header field 'handed_back'"
        return cls(tuple(hex_id(j, f"{where}: [{n}]") for n, j in enumerate(header.handed_back)))


#: This module's messages, for ipuserve.protocol.codec.
MESSAGES = (Hello, Welcome, Heartbeat, Reconnect, Bye)
WorkerMessage: TypeAlias = Hello | Welcome | Heartbeat | Reconnect | Bye
