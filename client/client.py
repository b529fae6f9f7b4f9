"""The Python client of an ipuserve broker.

::

    with Client("tcp://broker:5555", timeout=10) as client:
        outputs = client.infer("mlp", {"x": batch})          # blocks
        future = client.infer_async("mlp", {"x": batch})      # concurrent.futures.Future
        print(future.result()["y"], future.timing)

Several brokers: ``Client(["tcp://b1:5555", "tcp://b2:5555"])`` spreads the
requests over the brokers that answer and moves a silent or lost broker's pending
requests to another with the same ids (:mod:`ipuserve.client.core`; every
request is still answered once). ``links()`` shows the brokers, ``fleet()`` their
models merged.

One client is meant to be shared by every thread of a process. A caller sends its
request from its own thread when the socket is idle, else hands it to the
client's background I/O thread, which receives every reply, keeps the deadlines
and the broker's liveness, and re-sends (see :mod:`ipuserve.client.thread_loop`;
:class:`~ipuserve.client.AsyncClient` is the same core driven by asyncio).
Results are read-only ``np.frombuffer`` views of the received frames (no copies);
copy them to modify them. :meth:`Client.infer` sends its inputs without copies (it
returns only when they are no longer needed); :meth:`Client.infer_async` copies
them first, so the caller may reuse its arrays at once, unless given ``copy=False``.

Futures complete on the I/O thread, so done-callbacks must be quick; a callback
may call :meth:`Client.infer_async`, which then sends at once (this is how the
bench chains requests); a callback must not wait for another future (that raises
:class:`RuntimeUsageError`). Errors the broker or a worker report are raised as
the class they reported (:mod:`ipuserve.errors`); a request whose timeout passes
with no reply fails with :class:`DeadlineExceeded` (a ``TimeoutError``). The
timeout travels with the request: the broker and the worker drop it if it is
still waiting for a worker or a device when its time is up, but a request already
on the device runs to its end. Cancelling a future likewise only stops the wait.

Mistakes a caller can make are refused at once, before anything is sent: an
address that is not a ZeroMQ endpoint or a timeout that is not a number of
seconds > 0 (:class:`ConfigError`), a model or input name that is not a string of
1..256 characters, inputs that are not a mapping of input name -> ``numpy.ndarray``
(:class:`InvalidInputError`; convert lists with ``np.asarray(value, dtype=...)``
in the model's dtype, which ``ipuserve models`` shows).
"""

from __future__ import annotations

import itertools
import math
import numbers
import secrets
import threading
import uuid
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from types import TracebackType
from typing import Any, TypeVar

import numpy as np
import zmq

from ipuserve import protocol as wire
from ipuserve.client.config import ClientConfig, ClientStats
from ipuserve.client.core import LinkInfo
from ipuserve.client.fleet import FleetModel, merge_models
from ipuserve.client.pending import (
    Arrays,
    InferFuture,
    Pending,
    Waiter,
    parse_models,
    parse_reply,
)
from ipuserve.client.sockets import LinkSocket, open_socket
from ipuserve.client.thread_loop import ThreadLoop
from ipuserve.discovery import EndpointSet, expand
from ipuserve.endpoints import endpoint_problem
from ipuserve.errors import (
    ConfigError,
    DeadlineExceeded,
    InvalidInputError,
    IpuserveError,
    RuntimeUsageError,
)
from ipuserve.security import KeySource, client_keys


class _Default:
    """The default of a call's ``timeout``: the client's own."""

    def __repr__(self) -> str:
        return "<the client's timeout>"


#: the default of every call's ``timeout`` (both faces): "the client's own"
CLIENT_TIMEOUT: Any = _Default()
T = TypeVar("T")
_RESULT_GRACE_S = 5.0  # how long past its deadline a caller waits for the I/O thread
_KEY_NAMES = ("curve_secret_key", "broker_public_key")  # named so in a ConfigError


class Client:
    """A thread-safe connection to a broker's frontend (``tcp://HOST:5555``), or to
    several.

    ``address``: one endpoint as a string (one socket, ZeroMQ resolving its host), or
    a sequence of them: one link per endpoint, and per address of a host that
    resolves to several (Swarm's ``tasks.broker``), followed as they change; requests
    go to the live brokers and fail over between them (docs/protocol.md, "A client
    with several brokers"). A string whose host resolves to several addresses when
    the client starts is taken as that list of one; give a list of one to follow a
    name that may resolve to several later. A list of one IP or ``ipc://`` endpoint
    is the one-socket client.

    ``timeout`` (seconds, ``None`` = wait forever) is the default per-request
    timeout; each call may override it. ``routing_id`` (in ``config``) fixes the
    socket identity; by default it is random and unique per client, which lets
    the broker recognise re-sent requests after a reconnect. A fixed one must be
    unique among live clients: the broker hands the identity's connection to the
    newest, and the older client's replies go there (its requests time out). An
    ``address`` that is
    not a ZeroMQ endpoint to connect to (or an empty sequence) raises
    :class:`ConfigError`.

    ``curve_secret_key`` and ``broker_public_key`` (each a key file's path, or the key
    itself as bytes) make the connection CURVE, for a broker with keys
    (docs/security.md); give both or neither (a :class:`ConfigError` names the one
    missing). A broker that refuses the key never answers: requests time out.
    """

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
        self._io = ThreadLoop(setup.endpoints, setup.connect, self.config, follow=setup.follow)
        self._io.thread.start()
        # A client dropped without close() stops its thread and socket when collected.
        self._closer = weakref.finalize(self, self._io.close)

    # ------------------------------------------------------------------ requests

    def infer_async(
        self,
        model: str,
        inputs: Mapping[str, Any],
        *,
        timeout: float | None = CLIENT_TIMEOUT,
        copy: bool = True,
    ) -> InferFuture:
        """Send one request; the future holds ``{output name: read-only array}``.

        The inputs are copied first, so the caller may change its arrays as soon as
        this returns. ``copy=False`` sends them as they are, without a copy: then they
        must not change until the future is done, or the request carries (and a
        re-send after a broker restart re-sends) whatever they hold by then.

        Raises at once what is known locally: :class:`ClosedError` after
        :meth:`close`; :class:`ConfigError` for a timeout that is not seconds > 0 (or
        None); :class:`InvalidInputError` for a model or input name that is not a
        string of 1..256 characters, or ``inputs`` that are not a mapping of name ->
        ``numpy.ndarray`` or hold a dtype the wire does not carry.

        On the main thread the request is handed to the I/O thread rather than sent
        from here: Python raises Ctrl-C's KeyboardInterrupt there, and it must not
        land in a call meant to return at once after its request has left (a load
        generator would take it for a refusal and lose track of the request).
        """
        timeout = self.timeout if timeout is CLIENT_TIMEOUT else check_timeout(timeout)
        direct = threading.current_thread() is not threading.main_thread()
        return self._request(model, inputs, timeout, copy=copy, direct=direct)

    def _request(
        self,
        model: str,
        inputs: Mapping[str, Any],
        timeout: float | None,
        *,
        copy: bool,
        direct: bool,
    ) -> InferFuture:
        """Build and submit one request; ``direct``: it may leave from this thread."""
        message = build_request(next(self._ids), model, inputs, timeout, copy=copy)
        future = InferFuture(message.request_id, self._io.thread, owner=self)
        self._io.submit(Pending(message, future, timeout, parse_reply), direct=direct)
        return future

    def infer(
        self, model: str, inputs: Mapping[str, Any], *, timeout: float | None = CLIENT_TIMEOUT
    ) -> Arrays:
        """Send one request and wait for its outputs (raises the reported error class).

        ``timeout`` (seconds; ``None`` waits for ever) defaults to the client's. The
        inputs are sent without a copy: they must not change while this runs."""
        timeout = self.timeout if timeout is CLIENT_TIMEOUT else check_timeout(timeout)
        self._refuse_blocking_on_io_thread("infer")
        message = build_request(next(self._ids), model, inputs, timeout, copy=False)
        waiter: Waiter[Arrays] = Waiter()  # lighter than the InferFuture nobody sees
        self._io.submit(Pending(message, waiter, timeout, parse_reply), direct=True)
        return _wait(waiter, timeout, self._io)

    def models(self, *, timeout: float | None = CLIENT_TIMEOUT) -> list[wire.ModelInfo]:
        """The broker's models: their specs, queue depth, and each worker's credit/in-flight.

        With several brokers, the fleet's (:meth:`fleet`) as one broker would list it:
        each model once, each worker once, its numbers added up over its brokers; the
        brokers that do not answer in time are left out (:class:`DeadlineExceeded`
        when none does)."""
        if not self._io.follows:
            timeout = self._call_timeout(timeout)
            return _wait(self._ask_models(None, timeout), timeout, self._io)
        return [model.info() for model in self.fleet(timeout=timeout)]

    def fleet(self, *, timeout: float | None = CLIENT_TIMEOUT) -> list[FleetModel]:
        """Every broker's models merged (:func:`~ipuserve.client.fleet.merge_models`):
        each model once, its workers once each with the brokers they are registered
        with. The brokers that do not answer are left out; raises the first one's
        error when none answers."""
        answers = self.models_by_broker(timeout=timeout)
        found = {broker: a for broker, a in answers.items() if not isinstance(a, Exception)}
        if not found:
            raise next(a for a in answers.values() if isinstance(a, IpuserveError))
        return merge_models(found)

    def models_by_broker(
        self, *, timeout: float | None = CLIENT_TIMEOUT
    ) -> dict[str, list[wire.ModelInfo] | IpuserveError]:
        """Each broker's own list, or the error that came instead, by endpoint (as the
        client uses it: one per address of a name that resolves to several)."""
        timeout = self._call_timeout(timeout)
        if not self._io.follows:
            (endpoint,) = self._io.core.links
            return {endpoint: self.models(timeout=timeout)}
        asked = {info.endpoint: self._ask_models(info.endpoint, timeout) for info in self.links()}
        answers: dict[str, list[wire.ModelInfo] | IpuserveError] = {}
        for endpoint, future in asked.items():
            try:
                answers[endpoint] = _wait(future, timeout, self._io)
            except IpuserveError as exc:
                answers[endpoint] = exc
        return answers

    def links(self) -> list[LinkInfo]:
        """The client's brokers: endpoint, usable now, pending and assigned requests,
        epoch. A client of one broker has one (usable: connected)."""
        return self._io.links()

    def _call_timeout(self, timeout: Any) -> float | None:
        return self.timeout if timeout is CLIENT_TIMEOUT else check_timeout(timeout)

    def _ask_models(self, to: str | None, timeout: float | None) -> Future[list[wire.ModelInfo]]:
        """Send a LIST_MODELS (``to``: that broker only, never moved to another)."""
        self._refuse_blocking_on_io_thread("models")
        future: Future[list[wire.ModelInfo]] = Future()
        message = wire.ListModels(next(self._ids).to_bytes(8, "little"))
        pending = Pending(message, future, timeout, parse_models)
        self._io.submit(pending, to=to)
        return future

    def _refuse_blocking_on_io_thread(self, what: str) -> None:
        """A blocking call from a done-callback would wait for the thread it blocks."""
        if threading.current_thread() is self._io.thread:
            hint = "use infer_async() there" if what == "infer" else "call it from another thread"
            raise RuntimeUsageError(
                f"{what}() called from a future's callback would deadlock the client's "
                f"I/O thread; {hint}"
            )

    # ------------------------------------------------------------------ lifecycle

    @property
    def stats(self) -> ClientStats:
        """Counters: sent, re-sent, replies, dropped (duplicate or late) replies, epoch, ..."""
        return self._io.stats

    def close(self) -> None:
        """Fail pending requests with :class:`ClosedError` and stop the I/O thread."""
        self._closer()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client({self.address!r}, timeout={self.timeout})"


def build_request(
    number: int, model: str, inputs: Mapping[str, Any], timeout: float | None, *, copy: bool
) -> wire.Request:
    """Request ``number`` after the caller's mistakes are refused (both faces alike);
    ``copy``: of the inputs first, so that the caller may reuse its arrays at once."""
    _check_model(model)
    _check_inputs(inputs)
    if copy:
        inputs = {name: np.array(value, order="C") for name, value in inputs.items()}
    tensors = wire.Tensors.of(inputs)
    timeout_ms = None if timeout is None else max(timeout * 1e3, 0.001)
    return wire.Request(number.to_bytes(8, "little"), model, tensors, timeout_ms)


def check_timeout(timeout: Any) -> float | None:
    """Seconds > 0 that the wire can carry, or None (no timeout)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise ConfigError(f"timeout must be seconds > 0 or None, not {_type_name(timeout)}")
    seconds = float(timeout)
    limit_s = wire.MAX_DURATION_MS / 1e3
    if not (math.isfinite(seconds) and 0 < seconds < limit_s):
        raise ConfigError(
            f"timeout must be seconds > 0 and below {limit_s:g}, or None to wait for ever; "
            f"got {timeout!r}"
        )
    return seconds


def _check_model(model: Any) -> None:
    problem = wire.name_problem(model)
    if problem is not None:
        raise InvalidInputError(f"the model name {problem}")


def _check_inputs(inputs: Any) -> None:
    """A clear error for inputs the wire would misread (a bare array, a list of floats)."""
    if not isinstance(inputs, Mapping):
        raise InvalidInputError(
            f"inputs must be a dict of input name -> numpy array, not {_type_name(inputs)}"
        )
    for name, value in inputs.items():
        problem = wire.name_problem(name)
        if problem is not None:
            raise InvalidInputError(f"input name {name!r}: the name {problem}")
        if not isinstance(value, np.ndarray):
            raise InvalidInputError(
                f"input {name!r} is {_type_name(value)}, not a numpy array; convert it with "
                "numpy.asarray(value, dtype=...) in the model's dtype (`ipuserve models` "
                "lists it)"
            )


def _type_name(value: Any) -> str:
    kind = type(value)
    return f"a {kind.__module__}.{kind.__qualname__}".replace("a builtins.", "a ")


def _check_endpoints(endpoints: list[Any], address: Any) -> None:
    """Each a ZeroMQ endpoint to connect to, and at least one."""
    if not endpoints:
        raise ConfigError(f"a Client needs at least one broker endpoint, got {address!r}")
    for endpoint in endpoints:
        if not isinstance(endpoint, str):
            raise ConfigError(f"an endpoint must be a string, not {_type_name(endpoint)}")
        problem = endpoint_problem(endpoint)
        if problem is not None:
            raise ConfigError(problem)


def _wait(future: Future[T] | Waiter[T], timeout: float | None, io: ThreadLoop) -> T:
    """The future's result; the I/O thread fails it at its deadline, the grace is a backstop."""
    try:
        return future.result(None if timeout is None else timeout + _RESULT_GRACE_S)
    except DeadlineExceeded:  # the request's own: a TimeoutError too, so caught first
        raise
    except FutureTimeout:
        raise DeadlineExceeded(f"no reply within {timeout} s{io.silence_hint()}") from None


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


def _stands_for_several(endpoint: str) -> bool:
    """Whether ``endpoint``'s host resolves to several addresses now (not resolvable
    yet: no, ZeroMQ resolves it when it can)."""
    try:
        return len(expand(endpoint)) > 1
    except OSError:
        return False
