"""Host look-ahead (``max_look_ahead``): assemble the next runs' inputs while the device computes.

Poplar lets the host prepare a number of synchronisation points in advance so
the IPU never waits for the host to pack a batch. Here a prefetch thread calls
the input queues' stream callbacks for the runs ahead -- packing requests into
batches, waiting and flushing on timeouts -- and hands complete input sets to
the device thread through a bounded queue whose size is the look-ahead.

Only inputs read unconditionally at the top of the main program can be fetched
ahead: an input read inside a conditional branch may never be read by the run,
so models with such inputs run without look-ahead (as the spec warns, prefetch
and conditional inputs deadlock on real hardware too).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ipuserve.runtime.popef.types import Anchor, Model

log = logging.getLogger(__name__)

StreamCallback = Callable[[np.ndarray], Any]
_POLL_S = 0.1  # how often blocked hand-offs re-check for shutdown; no cost while data flows


@dataclass(frozen=True)
class PrefetchedInput:
    handle: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    fetch: StreamCallback


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def prefetchable(model: Model, fed_by_queues: set[str]) -> list[Anchor] | None:
    """The queue-fed main-program inputs in read order, or None if any is conditional."""
    executable = model.executable
    by_name = {a.name(): a for a in model.metadata.anchors()}
    ordered: list[Anchor] = []
    for index in model.metadata.programFlow().main():
        for step in executable.program(index).steps:
            if step.op == "switch" and _streams_in(step.branches, by_name, fed_by_queues):
                return None
            anchor = by_name.get(step.anchor or "")
            if step.op == "stream_in" and anchor is not None and anchor.name() in fed_by_queues:
                ordered.append(anchor)
    return ordered


def _streams_in(
    branches: tuple[tuple[Any, ...], ...], by_name: dict[str, Anchor], fed: set[str]
) -> bool:
    for branch in branches:
        for step in branch:
            anchor = by_name.get(step.anchor or "")
            if step.op == "stream_in" and anchor is not None and anchor.name() in fed:
                return True
            if step.branches and _streams_in(step.branches, by_name, fed):
                return True
    return False


class Prefetcher:
    """Fetches whole input sets ahead of the device, at most ``depth`` runs ahead."""

    def __init__(
        self,
        inputs: list[PrefetchedInput],
        depth: int,
        name: str,
        on_device_idle: Callable[[], float | None] | None = None,
    ) -> None:
        self._inputs = inputs
        self._on_device_idle = on_device_idle
        #: True while the device waits for an input set: read by the batching policy.
        self.device_waiting = False
        #: time.monotonic() when the device last began waiting for an input set.
        self.idle_since = 0.0
        #: perf_counter() when the device took its current input set (computation starts).
        self.taken_at = 0.0
        #: perf_counter() when the set the device took became ready: 0.0 when it was
        #: ready before the device asked (the simulated device's clock reads it).
        self.ready_at = 0.0
        self._first = inputs[0].handle
        # Two C-implemented queues instead of one bounded queue.Queue (whose Condition
        # costs several microseconds per hand-over): ready input sets, and tokens for
        # the sets the prefetcher may still fetch ahead.
        self._ready: queue.SimpleQueue[dict[str, np.ndarray] | _Failed] = queue.SimpleQueue()
        self._room: queue.SimpleQueue[None] = queue.SimpleQueue()
        for _ in range(depth):
            self._room.put(None)
        self._current: dict[str, np.ndarray] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"{name}-prefetch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def device_callback(self, handle: str) -> StreamCallback:
        """The stream callback the device uses for ``handle``: served from the fetched set."""

        def read(_offered: np.ndarray) -> np.ndarray:
            if handle == self._first:
                self._current = self._next_set()
            return self._current[handle]

        return read

    def discard(self) -> None:
        """Drop sets fetched before a failure: their requests have been failed."""
        while True:
            try:
                self._ready.get_nowait()
            except queue.Empty:
                return

    def stop(self, timeout: float = 30.0) -> None:
        self._stopping = True
        self.discard()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while self._wait_for_room():
            try:
                fetched: dict[str, np.ndarray] | _Failed = self._fetch_set()
            except Exception as error:  # handed to the device thread
                fetched = _Failed(error)
            self._ready.put(fetched)

    def _wait_for_room(self) -> bool:
        """Block until the device has taken a set (look-ahead bound); False when stopping."""
        while not self._stopping:
            try:
                self._room.get(timeout=_POLL_S)
                return not self._stopping
            except queue.Empty:
                continue
        return False

    def _fetch_set(self) -> dict[str, np.ndarray]:
        fetched: dict[str, np.ndarray] = {}
        for spec in self._inputs:
            offered = np.empty(spec.shape, dtype=spec.dtype)
            given = spec.fetch(offered)
            fetched[spec.handle] = offered if given is None else given
        return fetched

    def _next_set(self) -> dict[str, np.ndarray]:
        try:
            fetched = self._ready.get_nowait()
            self.ready_at = 0.0
        except queue.Empty:
            fetched = self._wait_for_set()
            self.ready_at = time.perf_counter()
        self.taken_at = self.ready_at or time.perf_counter()
        self._room.put(None)
        if isinstance(fetched, _Failed):
            raise fetched.error
        return fetched

    def _wait_for_set(self) -> dict[str, np.ndarray] | _Failed:
        """The device is about to idle: say so (the batch policy may flush, or name a
        wait after which it is asked again), then wait."""
        self.idle_since = time.monotonic()
        self.device_waiting = True
        try:
            again = self._on_device_idle() if self._on_device_idle is not None else None
            while True:
                try:
                    return self._ready.get(timeout=_POLL_S if again is None else again)
                except queue.Empty:
                    if self._stopping:  # shutting down: let the run finish on zeros
                        self._ready.put(
                            {s.handle: np.zeros(s.shape, s.dtype) for s in self._inputs}
                        )
                    elif again is not None and self._on_device_idle is not None:
                        again = self._on_device_idle()
        finally:
            self.device_waiting = False
