"""The model repository's control messages (docs/repository.md).

An admin asks a broker (REPOSITORY: ``index``, ``load``, ``unload``) and gets the
versions it knows with their states (REPOSITORY_REPLY), or an ERROR saying why not.
A repository worker tells every broker what it has (HOST: its IPUs, the entries of its
repository, the versions it hosts and their states) whenever that changes; a broker
asks it to LOAD or UNLOAD a version. The workers hold the truth: each broker derives
its index from their HOST reports, so several brokers agree without talking.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal, TypeAlias

import msgspec

from ipuserve.errors import ProtocolError
from ipuserve.protocol.envelope import Command, Limits, Wire, bounded, frames
from ipuserve.protocol.fields import Count, Header, Name, Positive, Version
from ipuserve.protocol.tensors import Frame
from ipuserve.protocol.worker_messages import PlainMessage

_encode = msgspec.json.encode

#: A version's state, as Triton's repository index names them. READY: a worker serves
#: it; LOADING, UNLOADING: on its way; UNAVAILABLE: in a repository but not served
#: (never loaded, unloaded, or failed: the reason says which).
State = Literal["READY", "LOADING", "UNLOADING", "UNAVAILABLE"]
Action = Literal["index", "load", "unload"]
#: Why a version is in its state, or an entry broken: text for people.
Reason = str


class RepositoryHeader(Header, frozen=True):
    action: Action
    model: Name | None = None
    version: Version | None = None
    replicas: Positive | None = None
    workers: Positive | None = None


@dataclass(frozen=True, slots=True)
class RepositoryCommand(Wire, command=Command.REPOSITORY, header=RepositoryHeader):
    """An admin's command: ``index`` (every version the workers' repositories hold),
    ``load`` ``model`` (``version``: default the latest in the repository) on
    ``workers`` workers with ``replicas`` IPUs each (defaults: the model's config), or
    ``unload`` it (``version``: default every loaded version). The broker answers at once
    with the index; the caller waits for the state it wants by asking ``index`` again."""

    request_id: bytes
    action: Action
    model: str | None = None
    version: str | None = None
    replicas: int | None = None
    workers: int | None = None

    def encode(self) -> list[Frame]:
        header = RepositoryHeader(
            self.action, self.model, self.version, self.replicas, self.workers
        )
        return frames(self.COMMAND, self.request_id, _encode(header))

    @classmethod
    def from_wire(
        cls, ident: bytes, h: RepositoryHeader, _t: Sequence[Frame], _l: Limits
    ) -> RepositoryCommand:
        if h.action != "index" and h.model is None:
            raise ProtocolError(f"REPOSITORY header: {h.action} needs a model")
        return cls(ident, h.action, h.model, h.version, h.replicas, h.workers)


class VersionState(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """One version as a broker's index lists it: its state and why, the workers that
    hold it, and whether requests that name no version go to it."""

    name: Name
    version: Version
    state: State
    reason: Reason = ""
    workers: tuple[Name, ...] = ()
    default: bool = False


class RepositoryReplyHeader(Header, frozen=True):
    models: tuple[VersionState, ...]
    message: Reason = ""


@dataclass(frozen=True, slots=True)
class RepositoryReply(Wire, command=Command.REPOSITORY_REPLY, header=RepositoryReplyHeader):
    """The index after a command, and what the command did (``message``: e.g. "loading
    mlp version 2 on w1, w2")."""

    request_id: bytes
    models: tuple[VersionState, ...]
    message: str = ""

    def encode(self) -> list[Frame]:
        header = RepositoryReplyHeader(self.models, bounded(self.message))
        return frames(self.COMMAND, self.request_id, _encode(header))

    @classmethod
    def from_wire(
        cls, ident: bytes, h: RepositoryReplyHeader, _t: Sequence[Frame], _l: Limits
    ) -> RepositoryReply:
        return cls(ident, h.models, h.message)


class Entry(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """A version in a worker's repository: what a load takes by default (its config's
    ``replicas``, each on ``ipus_per_replica`` IPUs, on ``workers`` workers), or why it
    cannot be loaded (a broken entry: ``problem``)."""

    name: Name
    version: Version
    replicas: Positive = 1
    problem: Reason = ""
    ipus_per_replica: Positive = 1
    workers: Positive = 1


class Hosted(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """A version a repository worker hosts: its state (UNAVAILABLE: its load failed,
    ``reason`` says why), the IPUs it holds, the worker id it serves under (a worker
    node of its own, with its own HELLO and credit), and how many workers the load
    that placed it asked for (so a broker can place it again if a holder dies)."""

    name: Name
    version: Version
    state: State
    worker_id: Name
    replicas: Positive = 1
    wanted_workers: Positive = 1
    reason: Reason = ""


class Host(PlainMessage, frozen=True):
    """A repository worker's report (worker -> every broker), sent when it joins and
    whenever anything in it changes: what a broker places loads by."""

    COMMAND: ClassVar[Command] = Command.HOST
    ipus: Count
    free_ipus: Count
    repository: tuple[Entry, ...] = ()
    hosted: tuple[Hosted, ...] = ()


class Load(PlainMessage, frozen=True):
    """Broker -> repository worker: load ``name`` ``version`` on ``replicas`` IPUs (a
    worker that hosts it already does nothing: several brokers may ask)."""

    COMMAND: ClassVar[Command] = Command.LOAD
    name: Name
    version: Version
    replicas: Positive = 1
    wanted_workers: Positive = 1


class Unload(PlainMessage, frozen=True):
    """Broker -> repository worker: drain ``name`` ``version`` (finish what it holds,
    hand back what it has not started) and free its IPUs."""

    COMMAND: ClassVar[Command] = Command.UNLOAD
    name: Name
    version: Version


#: This module's messages, for ipuserve.protocol.codec.
MESSAGES = (RepositoryCommand, RepositoryReply, Host, Load, Unload)
ControlMessage: TypeAlias = RepositoryCommand | RepositoryReply | Host | Load | Unload
