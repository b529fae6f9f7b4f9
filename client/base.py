"""What the two faces of the client (:class:`~ipuserve.client.Client`, with its I/O
thread, and :class:`~ipuserve.client.AsyncClient`, on an event loop) share: the
constructor's arguments, checked alike (:class:`ClientSetup`), a request's keyword
options, declared once (:class:`RequestOptions`), the request built from them after
the caller's mistakes are refused (:func:`build_request`), and the members that only
hand over to the driver of the core (:class:`ClientBase`). Each face adds its own way
of waiting for a request; both start their driver from the same setup.
"""

from __future__ import annotations

import itertools
import math
import numbers
import secrets
import uuid
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Generic, TypeAlias, TypedDict, TypeVar

import numpy as np
import zmq

from ipuserve import protocol as wire
from ipuserve.client.config import ClientConfig, ClientStats
from ipuserve.client.core import LinkInfo
from ipuserve.client.driver import Driver
from ipuserve.client.pending import Pending, Settleable, parse_repository
from ipuserve.client.repository import (
    LOAD_TIMEOUT_S,
    Ask,
    OnProgress,
    Steps,
    check_version,
    index_steps,
    load_steps,
    unload_steps,
)
from ipuserve.client.sockets import LinkSocket, open_socket
from ipuserve.discovery import EndpointSet, expand
from ipuserve.endpoints import endpoint_problem
from ipuserve.errors import ConfigError, InvalidInputError
from ipuserve.security import KeySource, client_keys


class _Default:
    """The default of a call's ``timeout``: the client's own."""

    def __repr__(self) -> str:
        return "<the client's timeout>"


#: the default of every call's ``timeout`` (both faces): "the client's own"
CLIENT_TIMEOUT: Any = _Default()
_KEY_NAMES = ("curve_secret_key", "broker_public_key")  # named so in a ConfigError

#: A request's inputs: input name -> ``numpy.ndarray``. Typed ``Any`` because anything
#: else is refused at once with an :class:`InvalidInputError` that says how to convert it.
Inputs: TypeAlias = Mapping[str, Any]


class RequestOptions(TypedDict, total=False):
    """The keyword options of a request, declared once for every call that sends one
    and returns before its answer is needed (:meth:`Client.infer_async`,
    :meth:`AsyncClient.infer`, :meth:`AsyncClient.infer_timed`), as
    ``**options: Unpack[RequestOptions]``: type checkers and IDEs show them as those
    methods' keyword parameters, and an unknown one raises ``TypeError`` as a misspelled
    keyword does."""

    #: seconds > 0 that the request may take, or None to wait for ever; left out: the
    #: client's own ``timeout``
    timeout: float | None
    #: copy the inputs before the call returns (left out: True), so that the caller may
    #: change its arrays at once; False sends them as they are: then they must not change
    #: until the request is answered, or it carries (and a re-send after a broker restart
    #: re-sends) whatever they hold by then
    copy: bool
    #: the model version asked for, a whole number (as an int or a string); left out or
    #: None: the model's default version (docs/repository.md)
    version: str | int | None


_OPTION_NAMES = RequestOptions.__optional_keys__


def check_timeout(timeout: Any) -> float | None:
    """Seconds > 0 that the wire can carry, or None (no timeout)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise ConfigError(f"timeout must be seconds > 0 or None, not {type_name(timeout)}")
    seconds = float(timeout)
    limit_s = wire.MAX_DURATION_MS / 1e3
    if not (math.isfinite(seconds) and 0 < seconds < limit_s):
        raise ConfigError(
            f"timeout must be seconds > 0 and below {limit_s:g}, or None to wait for ever; "
            f"got {timeout!r}"
        )
    return seconds


def type_name(value: Any) -> str:
    """How an error names what it got instead: ``a list``, ``a numpy.float64``."""
    kind = type(value)
    return f"a {kind.__module__}.{kind.__qualname__}".replace("a builtins.", "a ")


def build_request(
    number: int,
    model: str,
    inputs: Inputs,
    timeout: float | None,
    *,
    copy: bool,
    version: str | int | None = None,
) -> wire.Request:
    """Request ``number`` after the caller's mistakes are refused (both faces alike);
    ``copy``: of the inputs first, so that the caller may reuse its arrays at once;
    ``version``: the model version asked for (None: the default)."""
    checked_name(model)
    _check_inputs(inputs)
    checked_version = check_version(version)
    if copy:
        inputs = {name: np.array(value, order="C") for name, value in inputs.items()}
    tensors = wire.Tensors.of(inputs)
    timeout_ms = None if timeout is None else max(timeout * 1e3, 0.001)
    ident = number.to_bytes(8, "little")
    return wire.Request(ident, model, tensors, timeout_ms, version=checked_version)


def _check_inputs(inputs: Any) -> None:
    """A clear error for inputs the wire would misread (a bare array, a list of floats)."""
    if not isinstance(inputs, Mapping):
        raise InvalidInputError(
            f"inputs must be a dict of input name -> numpy array, not {type_name(inputs)}"
        )
    for name, value in inputs.items():
        problem = wire.name_problem(name)
        if problem is not None:
            raise InvalidInputError(f"input name {name!r}: the name {problem}")
        if not isinstance(value, np.ndarray):
            raise InvalidInputError(
                f"input {name!r} is {type_name(value)}, not a numpy array; convert it with "
                "numpy.asarray(value, dtype=...) in the model's dtype (`ipuserve models` "
                "lists it)"
            )


def _check_endpoints(endpoints: list[Any], address: Any) -> None:
    """Each a ZeroMQ endpoint to connect to, and at least one."""
    if not endpoints:
        raise ConfigError(f"a Client needs at least one broker endpoint, got {address!r}")
    for endpoint in endpoints:
        if not isinstance(endpoint, str):
            raise ConfigError(f"an endpoint must be a string, not {type_name(endpoint)}")
        problem = endpoint_problem(endpoint)
        if problem is not None:
            raise ConfigError(problem)


class ClientSetup:
    """What both faces (:class:`Client`, :class:`~ipuserve.client.AsyncClient`) make
    of their constructor's arguments, checked alike: the endpoints and whether they are
    followed, the config, the timeout, the routing id, the request ids, and how to open
    a link's socket."""

    def __init__(
        self,
        address: str | Sequence[str],
        timeout: float | None,
        config: ClientConfig | None,
        context: zmq.Context[Any] | None,
        curve_secret_key: KeySource | None,
        broker_public_key: KeySource | None,
    ) -> None:
        if isinstance(address, str) and _stands_for_several(address):
            address = [address]  # Swarm's tasks.broker: one link per broker, followed
        endpoints = [address] if isinstance(address, str) else list(address)
        _check_endpoints(endpoints, address)
        keys = client_keys(curve_secret_key, broker_public_key, names=_KEY_NAMES)
        self.address: str | tuple[str, ...] = (
            address if isinstance(address, str) else tuple(endpoints)
        )
        self.config = config or ClientConfig()
        self.timeout = check_timeout(timeout)
        self.routing_id = self.config.routing_id or b"c" + uuid.uuid4().bytes
        # From a random start: the broker takes (routing id, request id) for a re-send of
        # a job it still holds, so a new Client reusing a fixed routing_id must not
        # reuse the ids of one that died (it got that one's results).
        self.ids = itertools.count(secrets.randbits(62))
        self.endpoints = EndpointSet(endpoints)
        # one endpoint given as a string, or one that is no name: the one link, not
        # followed (ZeroMQ resolves its host); else a link per address, followed
        self.follow = not (
            isinstance(address, str) or (len(endpoints) == 1 and not self.endpoints.follows_names)
        )
        self._context = context or zmq.Context.instance()
        self._keys = keys

    def connect(self, endpoint: str) -> LinkSocket:
        return open_socket(self._context, endpoint, self.routing_id, self.config, self._keys)


def checked_name(name: Any) -> str:
    """A model name the wire carries, else :class:`InvalidInputError` saying why."""
    problem = wire.name_problem(name)
    if problem is not None:
        raise InvalidInputError(f"the model name {problem}")
    return str(name)


def _stands_for_several(endpoint: str) -> bool:
    """Whether ``endpoint``'s host resolves to several addresses now (not resolvable
    yet: no, ZeroMQ resolves it when it can)."""
    try:
        return len(expand(endpoint)) > 1
    except OSError:
        return False


DriverT = TypeVar("DriverT", bound=Driver)
#: what a face's repository calls return: the index (Client), an awaitable of it
#: (AsyncClient)
IndexT = TypeVar("IndexT")


class ClientBase(Generic[DriverT, IndexT]):
    """A face of the client: its checked arguments and its driver (``_io``), which
    :meth:`_start` makes from them; see :class:`~ipuserve.client.Client` for the
    arguments.

    The model repository's calls (:meth:`repository_index`, :meth:`load_model`,
    :meth:`unload_model`) are written once, here, as steps
    (:mod:`ipuserve.client.repository`) that each face walks its own way
    (:meth:`_walk`): :class:`~ipuserve.client.Client` blocks, ``AsyncClient``'s
    calls are awaited."""

    def __init__(
        self,
        address: str | Sequence[str],
        timeout: float | None = 30.0,
        *,
        config: ClientConfig | None = None,
        context: zmq.Context[Any] | None = None,
        curve_secret_key: KeySource | None = None,
        broker_public_key: KeySource | None = None,
    ) -> None:
        setup = ClientSetup(address, timeout, config, context, curve_secret_key, broker_public_key)
        self.address = setup.address
        self.config = setup.config
        self.timeout = setup.timeout
        self.routing_id = setup.routing_id
        self._ids = setup.ids
        self._io: DriverT = self._start(setup)
        # A client dropped without close() lets its driver (thread, sockets) go when
        # collected.
        self._closer = weakref.finalize(self, self._io.close)

    def _start(self, setup: ClientSetup) -> DriverT:
        """The face's driver of the core, for the links ``setup`` names."""
        raise NotImplementedError

    def _walk(self, steps: Steps) -> IndexT:
        """Walk ``steps``: send each :class:`Ask`, wait each :class:`Pause`."""
        raise NotImplementedError

    # ------------------------------------------------------------ the model repository

    def repository_index(self) -> IndexT:
        """Every model version in the repositories of the workers the broker knows,
        with its state (READY, LOADING, UNLOADING, UNAVAILABLE), why, the workers that
        serve it and whether it is the model's default (a
        :class:`~ipuserve.client.RepositoryIndex`). Admin role only: anyone else gets
        :class:`PermissionDeniedError` (docs/repository.md)."""
        return self._walk(index_steps())

    def load_model(
        self,
        name: str,
        version: str | int | None = None,
        *,
        replicas: int | None = None,
        workers: int | None = None,
        wait: bool = True,
        timeout: float | None = LOAD_TIMEOUT_S,
        on_progress: OnProgress | None = None,
    ) -> IndexT:
        """Load ``name`` ``version`` (default: the latest any repository holds) on
        ``workers`` repository workers (default 1) with ``replicas`` IPUs each (default:
        the model's config), and, with ``wait``, wait until it is READY on them:
        ``timeout`` seconds at most (:class:`DeadlineExceeded`; None waits for ever).
        Returns the index then, with what the broker said it did (``message``; without
        ``wait``: the index as the broker answered the load).

        Raises what the broker refused with: :class:`PermissionDeniedError` (not an
        admin), :class:`UnknownModelError` (no repository holds it), :class:`NoRoomError`
        (too few workers with the free IPUs); and :class:`UnavailableError` when the
        version goes UNAVAILABLE while waiting, with the reason. ``on_progress`` is
        called with each index seen while waiting and the seconds waited."""
        ask = Ask("load", checked_name(name), check_version(version), replicas, workers)
        return self._walk(
            load_steps(ask, wait=wait, timeout_s=check_timeout(timeout), on_progress=on_progress)
        )

    def unload_model(
        self,
        name: str,
        version: str | int | None = None,
        *,
        wait: bool = True,
        timeout: float | None = LOAD_TIMEOUT_S,
        on_progress: OnProgress | None = None,
    ) -> IndexT:
        """Unload ``name`` ``version`` (default: every version of it that is loaded):
        its workers drain (finish what they hold, hand back what they have not
        started: no request is lost) and free their IPUs. With ``wait``, wait until
        each is gone from the index or UNAVAILABLE (``timeout``, ``on_progress``: as
        :meth:`load_model`). :class:`UnknownModelError` when nothing of it is loaded."""
        ask = Ask("unload", checked_name(name), check_version(version))
        return self._walk(
            unload_steps(ask, wait=wait, timeout_s=check_timeout(timeout), on_progress=on_progress)
        )

    def _repository_pending(self, step: Ask, future: Settleable) -> Pending:
        """The REPOSITORY command ``step`` asks for, settling ``future``, with the
        client's timeout."""
        command = step.command(next(self._ids).to_bytes(8, "little"))
        return Pending(command, future, self.timeout, parse_repository)

    def _call_timeout(self, timeout: Any) -> float | None:
        """A call's ``timeout``: the client's own (:data:`CLIENT_TIMEOUT`), or checked."""
        return self.timeout if timeout is CLIENT_TIMEOUT else check_timeout(timeout)

    def _new_request(
        self, model: str, inputs: Inputs, options: RequestOptions
    ) -> tuple[wire.Request, float | None]:
        """The next request with ``options`` (:class:`RequestOptions`), and its timeout,
        after what is known locally is refused: an unknown option (``TypeError``), a
        timeout (:class:`ConfigError`), a model or inputs (:class:`InvalidInputError`)."""
        if not options.keys() <= _OPTION_NAMES:  # a subset test: no set built per request
            unknown = ", ".join(sorted(options.keys() - _OPTION_NAMES))
            raise TypeError(f"unexpected keyword argument(s): {unknown}")
        timeout = self._call_timeout(options.get("timeout", CLIENT_TIMEOUT))
        copy, version = options.get("copy", True), options.get("version")
        message = build_request(next(self._ids), model, inputs, timeout, copy=copy, version=version)
        return message, timeout

    def links(self) -> list[LinkInfo]:
        """The client's brokers: endpoint, usable now, pending and assigned requests,
        epoch. A client of one broker has one (usable: connected)."""
        return self._io.links()

    @property
    def stats(self) -> ClientStats:
        """Counters: sent, re-sent, replies, dropped (duplicate or late) replies, epoch, ..."""
        return self._io.stats

    def close(self) -> None:
        """Fail pending requests with :class:`ClosedError` and let the brokers go (the
        :class:`~ipuserve.client.Client`'s I/O thread stops)."""
        self._closer()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.address!r}, timeout={self.timeout})"
