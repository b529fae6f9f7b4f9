"""What the device's reads from the input queues tell: which input it waits for, when
it last read one, and whether that input was there when it asked.

Timeout messages name the input the device is blocked on; the lone-job path
(:mod:`.direct`) takes a request only while the device waits for the first input
of its next run; and the simulated device's clock asks when a run's inputs were
ready (``Session.inputs_ready_at``): a batch that was there when the device asked
is no device stall however late the device thread took it (the host's scheduler),
while one the device waited for starts its run when it came (docs/runtime.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ipuserve.runtime.model_runner.direct import DirectPath
from ipuserve.runtime.model_runner.futures import Request
from ipuserve.runtime.queues import InputQueue


class InputWaits:
    """Kept by the device thread around each read of an input queue (``wait``)."""

    def __init__(
        self, queues: Mapping[str, InputQueue], first: str | None, direct: DirectPath | None
    ) -> None:
        self._queues = queues
        self._first = first  # the input a run reads first (None: conditional inputs)
        self._direct = direct
        #: The input the device is reading (or blocked on); None between reads.
        self.waiting_for: str | None = None
        #: perf_counter() when the device last finished reading an input.
        self.read_at = 0.0
        #: perf_counter() when the input it last read was there; 0.0: before it asked.
        self.ready_at = 0.0
        self._waits_before = 0

    def tracked(self, name: str, callback: Callable[[np.ndarray], Any]) -> Callable[..., Any]:
        """``callback`` (the queue's) with :meth:`wait` around it."""

        def read(buffer: np.ndarray) -> Any:
            self.wait(name)
            result = callback(buffer)
            self.wait(None)
            return result

        return read

    def wait(self, name: str | None) -> None:
        """The device starts (``name``) or ends (None) reading an input from its queue."""
        if name is not None:
            self.waiting_for = name
            self._waits_before = self._queues[name].readerWaits()
            return
        waited = self.waiting_for
        self.waiting_for = None
        self.read_at = time.perf_counter()
        if waited is None:
            return
        queue = self._queues[waited]
        if queue.readerWaits() != self._waits_before:
            self.ready_at = self.read_at  # it waited: the input came just now
        elif waited == self._first:  # it was there: when its last request came
            job = self._direct.job if self._direct is not None else None
            tags = queue.lastRunTags() if job is None else (job.request,)
            self.ready_at = max((t.t_enqueued for t in tags if isinstance(t, Request)), default=0.0)
