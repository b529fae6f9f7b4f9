"""The client's view of one outstanding request: its future, its message, its deadline.

Owned by the client's I/O thread once handed over; callers only ever see the
:class:`InferFuture`. The request *message* (not its frames) is kept until the
reply so it can be re-sent after a broker restart with the same id and with the
time it has left as its timeout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ipuserve import protocol as wire
from ipuserve.client.timing import Timing
from ipuserve.errors import RuntimeUsageError

Arrays = dict[str, np.ndarray[Any, Any]]


class InferFuture(Future[Arrays]):
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

    def result(self, timeout: float | None = None) -> Arrays:
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


def _release_owner(future: Future[Arrays]) -> None:
    if isinstance(future, InferFuture):
        future._owner = None


Message = wire.Request | wire.ListModels


@dataclass(slots=True)
class Pending:
    """One request between hand-over and reply; only the I/O thread touches it."""

    message: Message
    future: Future[Any]
    timeout_s: float | None
    parse: Callable[[wire.Message, Pending], Any]
    started_ns: int = field(default_factory=time.perf_counter_ns)
    deadline_ns: int | None = None
    #: sent once already: a re-send carries what is left of the timeout
    sent: bool = False
    #: past its deadline already once: waiting ClientConfig.deadline_grace_s for the
    #: broker's DEADLINE_EXCEEDED
    graced: bool = False

    def __post_init__(self) -> None:
        if self.timeout_s is not None:
            self.deadline_ns = self.started_ns + int(self.timeout_s * 1e9)

    def succeed(self, result: Any) -> None:
        """Settle the future, unless its caller cancelled it meanwhile."""
        with contextlib.suppress(InvalidStateError):
            self.future.set_result(result)

    def fail(self, error: BaseException) -> None:
        """Settle the future with ``error``, unless its caller cancelled it meanwhile:
        ``cancel()`` runs on the caller's thread, between any check and this call, and
        the InvalidStateError it then caused once ended the I/O thread, failing every
        other request of the client."""
        with contextlib.suppress(InvalidStateError):
            self.future.set_exception(error)

    @property
    def request_id(self) -> bytes:
        return self.message.request_id

    @property
    def payload_bytes(self) -> int:
        message = self.message
        return message.tensors.nbytes if isinstance(message, wire.Request) else 0

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


def parse_reply(message: wire.Message, pending: Pending) -> Arrays:
    """A REPLY's tensors as read-only views; the timing goes on the future."""
    assert isinstance(message, wire.Reply)
    future = pending.future
    if isinstance(future, InferFuture):
        future.timing = timing_of(message.timing, pending.started_ns)
    return message.tensors.arrays()


def parse_models(message: wire.Message, _pending: Pending) -> list[wire.ModelInfo]:
    assert isinstance(message, wire.ModelsReply)
    return list(message.models)


def timing_of(reported: Mapping[str, float], started_ns: int) -> Timing:
    return Timing(
        total_us=(time.perf_counter_ns() - started_ns) / 1e3,
        broker_queue_us=reported.get("broker_queue_us", 0.0),
        worker_queue_us=reported.get("worker_queue_us", 0.0),
        device_us=reported.get("device_us", 0.0),
        worker_us=reported.get("worker_us", 0.0),
    )


#: which reply command answers which request
EXPECTS: dict[type[Message], type[wire.Message]] = {
    wire.Request: wire.Reply,
    wire.ListModels: wire.ModelsReply,
}
