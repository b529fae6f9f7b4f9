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

import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from types import TracebackType
from typing import TypeVar, Unpack

from ipuserve import protocol as wire
from ipuserve.client.base import (
    CLIENT_TIMEOUT,
    ClientBase,
    ClientSetup,
    Inputs,
    RequestOptions,
)
from ipuserve.client.fleet import FleetModel, merge_models
from ipuserve.client.pending import (
    InferFuture,
    Outputs,
    Pending,
    Waiter,
    parse_models,
    parse_reply,
)
from ipuserve.client.repository import Pause, RepositoryIndex, Step, Stepper, Steps
from ipuserve.client.thread_loop import ThreadLoop
from ipuserve.errors import (
    DeadlineExceeded,
    IpuserveError,
    RuntimeUsageError,
)

T = TypeVar("T")
_RESULT_GRACE_S = 5.0  # how long past its deadline a caller waits for the I/O thread


class Client(ClientBase[ThreadLoop, RepositoryIndex]):
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
    missing). A broker that refuses the handshake never answers, but the socket's
    connection monitor sees the refusal: requests fail at once with
    :class:`HandshakeRefusedError`, saying why, not at their timeout (with several
    brokers, only when no other is usable; :mod:`ipuserve.client.core`).
    """

    def _start(self, setup: ClientSetup) -> ThreadLoop:
        io = ThreadLoop(setup.endpoints, setup.connect, setup.config, follow=setup.follow)
        io.thread.start()
        return io

    # ------------------------------------------------------------------ requests

    def infer_async(
        self, model: str, inputs: Inputs, **options: Unpack[RequestOptions]
    ) -> InferFuture:
        """Send one request; the future holds ``{output name: read-only array}`` (an
        :class:`~ipuserve.client.Outputs`: its ``version`` says which version answered).
        ``version``: that version of the model; None: its default (docs/repository.md).

        ``timeout`` (seconds; ``None`` waits for ever) defaults to the client's. The
        inputs are copied first, so the caller may change its arrays as soon as this
        returns. ``copy=False`` sends them as they are, without a copy: then they must
        not change until the future is done, or the request carries (and a re-send
        after a broker restart re-sends) whatever they hold by then
        (:class:`~ipuserve.client.RequestOptions`).

        Raises at once what is known locally: :class:`ClosedError` after
        :meth:`close`; ``TypeError`` for an option it does not take;
        :class:`ConfigError` for a timeout that is not seconds > 0 (or None);
        :class:`InvalidInputError` for a model or input name that is not a string of
        1..256 characters, or ``inputs`` that are not a mapping of name ->
        ``numpy.ndarray`` or hold a dtype the wire does not carry.

        On the main thread the request is handed to the I/O thread rather than sent
        from here: Python raises Ctrl-C's KeyboardInterrupt there, and it must not
        land in a call meant to return at once after its request has left (a load
        generator would take it for a refusal and lose track of the request).
        """
        message, timeout = self._new_request(model, inputs, options)
        direct = threading.current_thread() is not threading.main_thread()
        future = InferFuture(message.request_id, self._io.thread, owner=self)
        self._io.submit(Pending(message, future, timeout, parse_reply), direct=direct)
        return future

    def infer(
        self,
        model: str,
        inputs: Inputs,
        *,
        timeout: float | None = CLIENT_TIMEOUT,
        version: str | int | None = None,
    ) -> Outputs:
        """Send one request and wait for its outputs (raises the reported error class):
        ``{output name: read-only array}``, whose ``version`` says which model version
        answered (:class:`~ipuserve.client.Outputs`).

        ``timeout`` (seconds; ``None`` waits for ever) defaults to the client's.
        ``version``: that version of the model (a whole number, as a string or an int);
        None: the model's default version. The inputs are sent without a copy: they must
        not change while this runs."""
        self._refuse_blocking_on_io_thread("infer")
        message, timeout = self._new_request(
            model, inputs, {"timeout": timeout, "copy": False, "version": version}
        )
        waiter: Waiter[Outputs] = Waiter()  # lighter than the InferFuture nobody sees
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

    def _ask_models(self, to: str | None, timeout: float | None) -> Future[list[wire.ModelInfo]]:
        """Send a LIST_MODELS (``to``: that broker only, never moved to another)."""
        self._refuse_blocking_on_io_thread("models")
        future: Future[list[wire.ModelInfo]] = Future()
        message = wire.ListModels(next(self._ids).to_bytes(8, "little"))
        pending = Pending(message, future, timeout, parse_models)
        self._io.submit(pending, to=to)
        return future

    def _walk(self, steps: Steps) -> RepositoryIndex:
        """The repository calls' steps, blocking (ClientBase)."""
        self._refuse_blocking_on_io_thread("load_model/unload_model/repository_index")
        stepper = Stepper(steps)
        step = stepper.next(None)
        while step is not None:
            step = stepper.next(self._take(step))
        assert stepper.result is not None
        return stepper.result

    def _take(self, step: Step) -> RepositoryIndex | None:
        if isinstance(step, Pause):
            time.sleep(step.seconds)
            return None
        future: Future[RepositoryIndex] = Future()
        self._io.submit(self._repository_pending(step, future))
        return _wait(future, self.timeout, self._io)

    def _refuse_blocking_on_io_thread(self, what: str) -> None:
        """A blocking call from a done-callback would wait for the thread it blocks."""
        if threading.current_thread() is self._io.thread:
            hint = "use infer_async() there" if what == "infer" else "call it from another thread"
            raise RuntimeUsageError(
                f"{what}() called from a future's callback would deadlock the client's "
                f"I/O thread; {hint}"
            )

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None
    ) -> None:
        self.close()


def _wait(future: Future[T] | Waiter[T], timeout: float | None, io: ThreadLoop) -> T:
    """The future's result; the I/O thread fails it at its deadline, the grace is a backstop."""
    try:
        return future.result(None if timeout is None else timeout + _RESULT_GRACE_S)
    except DeadlineExceeded:  # the request's own: a TimeoutError too, so caught first
        raise
    except FutureTimeout:
        raise DeadlineExceeded(f"no reply within {timeout} s{io.silence_hint()}") from None
