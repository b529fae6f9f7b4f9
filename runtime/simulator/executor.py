"""The device's own thread: every program a device runs, runs here, in order.

A real IPU runs one program at a time and the host talks to it through
stream callbacks; one thread per device gives the simulation the same shape.
Jobs are plain callables; their results (or exceptions) come back through
``concurrent.futures.Future``.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from ipuserve.errors import ClosedError

log = logging.getLogger(__name__)
T = TypeVar("T")

_PR_SET_TIMERSLACK = 29


def tighten_timer_slack() -> None:
    """Ask Linux for 1 us sleep precision on this thread (default slack is 50 us).

    Simulated device time is taken by sleeping; with the default slack every
    sleep overshoots by ~50-60 us, which would be most of a small model's run.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_TIMERSLACK, 1000, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: keep the default precision
        pass


_Job = tuple[Callable[[], Any], "Future[Any]"]


class DeviceThread:
    """Runs submitted jobs one at a time on a dedicated, lazily started thread."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, job: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise ClosedError(f"{self._name} is detached; its thread has stopped")
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._jobs.put((job, future))
        return future

    def call(self, job: Callable[[], T]) -> T:
        """Run ``job`` on the device thread and wait for it (inline if already there)."""
        if self.on_device_thread():
            return job()
        return self.submit(job).result()

    def on_device_thread(self) -> bool:
        return self._thread is not None and threading.current_thread() is self._thread

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop taking jobs, let queued ones finish, and join the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
            self._jobs.put(None)
        if thread is not None and not self.on_device_thread():
            thread.join(timeout)
            if thread.is_alive():
                log.warning("%s did not stop within %s s", self._name, timeout)

    def _loop(self) -> None:
        tighten_timer_slack()
        while (item := self._jobs.get()) is not None:
            job, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(job())
            except BaseException as error:  # delivered to the waiting caller
                future.set_exception(error)
