"""The client's view of one outstanding request: its future, its message, its deadline.

Owned by the client's core once handed over (its :class:`PendingTable`, guarded
by the driver); callers only ever see the :class:`InferFuture`. The request
*message* (not its frames) is kept until the reply so it can be re-sent after a
broker restart with the same id and with the time it has left as its timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import heapq
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from ipuserve import protocol as wire
from ipuserve.client.repository import RepositoryIndex
from ipuserve.client.timing import Timing
from ipuserve.errors import RuntimeUsageError

Arrays = dict[str, np.ndarray[Any, Any]]
T = TypeVar("T")


class Outputs(dict[str, np.ndarray[Any, Any]]):
    """A reply's outputs, ``{output name: read-only array}`` -- a plain dict to every
    caller -- that also says which model version answered (``version``: the reply's;
    None from a broker that does not say). A dict, so that every face and every
    existing caller keeps its result as it was, and the version reaches the caller of
    :meth:`Client.infer`, of a future's ``result()`` and of ``await
    AsyncClient.infer`` alike."""

    __slots__ = ("version",)

    def __init__(self, arrays: Arrays, version: str | None = None) -> None:
        super().__init__(arrays)
        self.version = version

    def __reduce__(self) -> tuple[Any, ...]:  # pickled with its version
        return (Outputs, (dict(self), self.version))


class InferFuture(Future[Outputs]):
    """A ``concurrent.futures.Future`` of a result, plus where its time went.

    ``timing`` is set just before the result (``None`` for errors and models()):
    the fabric's ``broker_queue_us``, ``worker_queue_us``, ``device_us`` and
    ``worker_us`` from the reply header, and ``total_us`` measured by the client
    from ``infer_async`` to the reply.
    """

    def __init__(
        self, request_id: bytes, io_thread: threading.Thread | None = None, owner: Any = None
    ) -> None:
        super().__init__()
        self.request_id = request_id
        self.timing: Timing | None = None
        self._io_thread = io_thread
        # A client closes itself when collected: ``Client(addr).infer_async(...)`` must
        # keep it alive until the answer, so the pending future holds it till then.
        self._owner = owner
        if owner is not None:
            self.add_done_callback(_release_owner)

    def result(self, timeout: float | None = None) -> Outputs:
        self._refuse_waiting_on_io_thread()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._refuse_waiting_on_io_thread()
        return super().exception(timeout)

    def _refuse_waiting_on_io_thread(self) -> None:
        """The client's I/O thread completes futures: waiting on it for one deadlocks."""
        if not self.done() and threading.current_thread() is self._io_thread:
            raise RuntimeUsageError(
                "waiting for a request's result in a future's done-callback would deadlock "
                "the client's I/O thread, which completes the futures; give that future a "
                "callback of its own instead (add_done_callback)"
            )


class Waiter(Generic[T]):
    """The blocking :meth:`Client.infer`'s future: a result, and one lock its caller
    blocks on, taken at birth and let go when the request is settled.

    A ``concurrent.futures.Future`` is more than a caller that waits at once needs:
    a Condition (an RLock and a list of waiters, a new lock for each wait), done-
    callbacks, cancellation, and the Client kept alive through it (here the caller
    holds the Client while it waits). This one costs two plain locks: ``_claim``
    makes the first settle the only one (the I/O thread's reply and ``close()``
    failing what is outstanding may race), ``_done`` wakes the caller.
    """

    __slots__ = ("_claim", "_done", "_error", "_result")

    def __init__(self) -> None:
        self._claim = threading.Lock()
        self._done = threading.Lock()
        self._done.acquire()
        self._result: T | None = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._claim.locked()

    def set_result(self, result: T, /) -> None:
        self._settle(result, None)

    def set_exception(self, exception: BaseException, /) -> None:
        self._settle(None, exception)

    def _settle(self, result: T | None, error: BaseException | None) -> None:
        if not self._claim.acquire(blocking=False):
            raise InvalidStateError("the request is settled already")
        self._result, self._error = result, error
        self._done.release()

    def result(self, timeout: float | None = None) -> T:
        """The result, or the error raised; TimeoutError when ``timeout`` runs out."""
        if not self._done.acquire(timeout=-1 if timeout is None else timeout):
            raise TimeoutError
        self._done.release()  # done for good: a second call returns at once
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]


def _release_owner(future: Future[Outputs]) -> None:
    if isinstance(future, InferFuture):
        future._owner = None


Message = wire.Request | wire.ListModels | wire.RepositoryCommand


class Settleable(Protocol):
    """A request's future as the core settles it: a ``concurrent.futures.Future``
    (:class:`~ipuserve.client.Client`) or an ``asyncio.Future``
    (:class:`~ipuserve.client.AsyncClient`)."""

    def done(self) -> bool: ...

    def set_result(self, result: Any, /) -> None: ...

    def set_exception(self, exception: BaseException, /) -> None: ...


#: what set_result/set_exception raise on a future its caller cancelled meanwhile
_SETTLED = (InvalidStateError, asyncio.InvalidStateError)


@dataclass(slots=True)
class Pending:
    """One request between hand-over and reply; touched only by the core."""

    message: Message
    future: Settleable
    timeout_s: float | None
    parse: Callable[[wire.Message, Pending], Any]
    started_ns: int = field(default_factory=time.perf_counter_ns)
    deadline_ns: int | None = None
    #: sent once already: a re-send carries what is left of the timeout
    sent: bool = False
    #: past its deadline already once: waiting ClientConfig.deadline_grace_s for the
    #: broker's DEADLINE_EXCEEDED
    graced: bool = False
    #: the request's tensor bytes (0 for a models() query): what the payload limit,
    #: the hold until the first PONG and batching look at
    payload_bytes: int = field(init=False, default=0)
    #: where the request's time went, once answered (parse_reply)
    timing: Timing | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.timeout_s is not None:
            self.deadline_ns = self.started_ns + int(self.timeout_s * 1e9)
        if isinstance(self.message, wire.Request):
            self.payload_bytes = self.message.tensors.nbytes

    def succeed(self, result: Any) -> None:
        """Settle the future, unless its caller cancelled it meanwhile."""
        with contextlib.suppress(*_SETTLED):
            self.future.set_result(result)

    def fail(self, error: BaseException) -> None:
        """Settle the future with ``error``, unless its caller cancelled it meanwhile:
        ``cancel()`` runs on the caller's thread, between any check and this call, and
        the InvalidStateError it then caused once ended the I/O thread, failing every
        other request of the client."""
        with contextlib.suppress(*_SETTLED):
            self.future.set_exception(error)

    @property
    def request_id(self) -> bytes:
        return self.message.request_id

    @property
    def model(self) -> str | None:
        """The model an inference request is for (None: a models() query)."""
        message = self.message
        return message.model if isinstance(message, wire.Request) else None

    def frames(self, now_ns: int) -> list[wire.Frame]:
        """The message to (re)send now, encoded."""
        return self.message_at(now_ns).encode()

    def message_at(self, now_ns: int) -> Message:
        """The message to send now: as built the first time (the broker's deadline is then
        at most one turn of the I/O thread later than ours), and on a re-send with
        what is left of the timeout."""
        message = self.message
        resent, self.sent = self.sent, True
        if resent and isinstance(message, wire.Request) and self.deadline_ns is not None:
            left_ms = max((self.deadline_ns - now_ns) / 1e6, 0.001)
            message = dataclasses.replace(message, timeout_ms=round(left_ms, 3))
        return message


def parse_reply(message: wire.Message, pending: Pending) -> Outputs:
    """A REPLY's tensors as read-only views, with the version that answered; the
    timing goes on the future."""
    assert isinstance(message, wire.Reply)
    pending.timing = timing_of(message.timing, pending.started_ns)
    future = pending.future
    if isinstance(future, InferFuture):
        future.timing = pending.timing
    return Outputs(message.tensors.arrays(), message.version)


def parse_models(message: wire.Message, _pending: Pending) -> list[wire.ModelInfo]:
    assert isinstance(message, wire.ModelsReply)
    return list(message.models)


def parse_repository(message: wire.Message, _pending: Pending) -> RepositoryIndex:
    assert isinstance(message, wire.RepositoryReply)
    return RepositoryIndex(message.models, message.message)


def timing_of(reported: Mapping[str, float], started_ns: int) -> Timing:
    return Timing(
        total_us=(time.perf_counter_ns() - started_ns) / 1e3,
        broker_queue_us=reported.get("broker_queue_us", 0.0),
        worker_queue_us=reported.get("worker_queue_us", 0.0),
        device_us=reported.get("device_us", 0.0),
        worker_us=reported.get("worker_us", 0.0),
    )


#: The deadline heap is rebuilt without answered requests past this size (and 4x pending).
_COMPACT_AT = 1024


class PendingTable:
    """The requests sent and not answered yet, by id, and their deadlines (a heap).

    Every request leaves the table once: answered, failed, expired, or taken when
    the client closes; that is what makes its future settle exactly once.
    """

    def __init__(self) -> None:
        self._by_id: dict[bytes, Pending] = {}
        #: (deadline_ns, seq, request id); answered requests' entries stay until their
        #: deadline or the next compaction
        self.deadlines: list[tuple[int, int, bytes]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, request_id: bytes) -> bool:
        return request_id in self._by_id

    def get(self, request_id: bytes) -> Pending | None:
        return self._by_id.get(request_id)

    def ids(self) -> list[bytes]:
        return list(self._by_id)

    def values(self) -> list[Pending]:
        return list(self._by_id.values())

    def add(self, pending: Pending) -> None:
        self._by_id[pending.request_id] = pending
        if pending.deadline_ns is not None:
            self._push(pending.deadline_ns, pending.request_id)
            if len(self.deadlines) > max(_COMPACT_AT, 4 * len(self._by_id)):
                self._compact()

    def pop(self, request_id: bytes) -> Pending | None:
        return self._by_id.pop(request_id, None)

    def take_all(self) -> list[Pending]:
        taken = list(self._by_id.values())
        self._by_id.clear()
        return taken

    def next_deadline_ns(self) -> int | None:
        return self.deadlines[0][0] if self.deadlines else None

    def expired(self, now_ns: int, grace_ns: int | None) -> Iterator[Pending]:
        """Take out the requests whose deadline passed. With ``grace_ns``, one past its
        deadline for the first time stays that much longer instead (the broker's own
        DEADLINE_EXCEEDED, which says where it waited, is then on its way)."""
        while self.deadlines and self.deadlines[0][0] <= now_ns:
            _, _, request_id = heapq.heappop(self.deadlines)
            pending = self._by_id.get(request_id)
            if pending is None or pending.deadline_ns is None or pending.deadline_ns > now_ns:
                continue
            if grace_ns is not None and not pending.graced:
                pending.graced = True
                self._push(pending.deadline_ns + grace_ns, request_id)
                continue
            del self._by_id[request_id]
            yield pending

    def _push(self, deadline_ns: int, request_id: bytes) -> None:
        heapq.heappush(self.deadlines, (deadline_ns, next(self._seq), request_id))

    def _compact(self) -> None:
        """Drop the entries of requests answered since: each stays in the heap until its
        deadline otherwise, so with long timeouts the heap grew with every request."""
        self.deadlines = [entry for entry in self.deadlines if entry[2] in self._by_id]
        heapq.heapify(self.deadlines)


#: which reply command answers which request
EXPECTS: dict[type[Message], type[wire.Message]] = {
    wire.Request: wire.Reply,
    wire.ListModels: wire.ModelsReply,
    wire.RepositoryCommand: wire.RepositoryReply,
}


def refuse_if_forked(created_in: int) -> None:
    """A Client inherited through ``os.fork()`` has no I/O thread (threads do not
    survive a fork) and shares its sockets with the parent: a request handed to it
    would never leave, so the child is told at once."""
    if os.getpid() != created_in:
        raise RuntimeUsageError(
            "this Client was created in another process (this one was forked from "
            "it): its I/O thread and sockets stay there; create a new Client here"
        )
