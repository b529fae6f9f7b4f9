"""What ``executeAsync`` returns, and the bookkeeping of one request in flight.

:class:`OutputFuture` behaves like the spec's Python future (``wait()``,
``future[name]``) and also like a ``concurrent.futures.Future``
(``result``, ``exception``, ``done``, ``add_done_callback``) so servers can be
told of completion without a thread per request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

import numpy as np

from ipuserve.errors import RequestTimeoutError
from ipuserve.runtime.model_runner.memory import TensorResult
from ipuserve.runtime.model_runner.monitoring import Monitor, RequestTrace

if TYPE_CHECKING:
    from ipuserve.runtime.model_runner.replica import Replica

log = logging.getLogger(__name__)


class OutputFuture(Mapping[str, TensorResult]):
    """The outputs of one request, some time from now.

    Deliberately lighter than ``concurrent.futures.Future`` (which allocates a
    Condition per instance): one lock held until completion, for waiters, and one
    for the callbacks list. Every request of every client allocates one.
    """

    __slots__ = (
        "_callbacks",
        "_done",
        "_error",
        "_names",
        "_outputs",
        "_replica",
        "_state",
        "trace",
    )

    def __init__(self, names: list[str], replica: Replica) -> None:
        self._names = names
        self._replica = replica
        self._done = threading.Lock()
        self._done.acquire()  # released once, on completion
        self._state = threading.Lock()
        self._outputs: dict[str, TensorResult] | None = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[OutputFuture], object]] | None = []
        self.trace: RequestTrace | None = None

    def wait(self, timeout: float | None = None) -> None:
        """Block until every output is ready (or the request failed)."""
        if self._callbacks is None:
            return
        if not self._done.acquire(timeout=-1 if timeout is None else max(timeout, 0)):
            raise RequestTimeoutError(self._timeout_message(timeout))
        self._done.release()  # let the next waiter through

    def result(self, timeout: float | None = None) -> dict[str, TensorResult]:
        self.wait(timeout)
        if self._error is not None:
            raise self._error
        assert self._outputs is not None
        return self._outputs

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self.wait(timeout)
        return self._error

    def done(self) -> bool:
        return self._callbacks is None

    def add_done_callback(self, fn: Callable[[OutputFuture], object]) -> None:
        """``fn(self)`` runs once the request finished -- on the device thread, so keep it short."""
        with self._state:
            if self._callbacks is not None:
                self._callbacks.append(fn)
                return
        fn(self)

    def __getitem__(self, name: str) -> TensorResult:
        return self.result()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def _timeout_message(self, timeout: float | None) -> str:
        waiting = self._replica.waiting_for()
        where = (
            f"replica {self._replica.index} is waiting for input tensor {waiting!r}"
            if waiting
            else f"replica {self._replica.index} has not produced them yet"
        )
        return f"outputs {self._names} not ready after {timeout} s: {where}"

    # completion (runtime side); the first outcome wins -----------------------------
    def _resolve(self, outputs: dict[str, TensorResult]) -> None:
        self._complete(outputs, None)

    def _fail(self, error: BaseException) -> None:
        self._complete(None, error)

    def _complete(
        self, outputs: dict[str, TensorResult] | None, error: BaseException | None
    ) -> None:
        with self._state:
            callbacks = self._callbacks
            if callbacks is None:
                return
            self._outputs, self._error = outputs, error
            self._callbacks = None
        self._done.release()
        for callback in callbacks:
            try:
                callback(self)
            except Exception:  # a caller's callback must not break the device loop
                log.exception("done callback of a request raised")


class Request:
    """One request's progress through the queues; every callback runs on the device thread."""

    __slots__ = (
        "computation_started",
        "finished",
        "future",
        "inputs_left",
        "monitor",
        "outputs",
        "outputs_left",
        "samples",
        "t_enqueued",
        "t_read_complete",
        "t_read_start",
        "t_submit",
        "user_outputs",
    )

    def __init__(
        self,
        future: OutputFuture,
        *,
        inputs: int,
        outputs: int,
        samples: int,
        user_outputs: bool,
        monitor: Monitor,
        t_submit: float,
        finished: Callable[[Request], None],
        computation_started: Callable[[], float],
    ) -> None:
        self.future = future
        self.finished = finished
        self.computation_started = computation_started
        self.inputs_left = inputs
        self.outputs_left = outputs
        self.samples = samples
        self.user_outputs = user_outputs
        self.monitor = monitor
        self.outputs: dict[str, TensorResult] = {}
        self.t_submit = t_submit
        self.t_enqueued = t_submit
        self.t_read_start = 0.0
        self.t_read_complete = 0.0

    def read_started(self) -> None:
        if not self.t_read_start:
            self.t_read_start = time.perf_counter()

    def read_completed(self) -> None:
        self.inputs_left -= 1
        if self.inputs_left == 0:
            self.t_read_complete = time.perf_counter()

    def output_written(self, name: str, array: np.ndarray) -> None:
        if not array.flags.c_contiguous:  # batching_dim != 0: np.frombuffer must work
            array = np.ascontiguousarray(array)
        self.outputs[name] = TensorResult.wrap(array, user_allocated=self.user_outputs)
        self.outputs_left -= 1
        if self.outputs_left == 0:
            self._finish()

    def _finish(self) -> None:
        done = time.perf_counter()
        start = self.t_read_start or self.t_enqueued
        # Computation starts when the device has the whole request *and* takes the set
        # it is in: a prefetched batch may wait behind earlier ones (that is queueing).
        computed_from = max(self.t_read_complete or start, self.computation_started())
        trace = RequestTrace(
            request_duration_us=(done - self.t_submit) * 1e6,
            read_preparation_duration_us=(self.t_enqueued - self.t_submit) * 1e6,
            read_queue_duration_us=(computed_from - self.t_enqueued) * 1e6,
            computation_duration_us=(done - computed_from) * 1e6,
        )
        self.future.trace = trace
        self.monitor.record(trace)
        self.finished(self)  # bookkeeping first: nothing may see it done and still pending
        self.future._resolve(self.outputs)
