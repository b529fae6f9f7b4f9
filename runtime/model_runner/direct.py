"""A lone job without the queue machinery: the device takes its arrays directly.

A request that arrives while its replica holds nothing else, while the device
waits for the first input of its next run, and that is exactly one compiled
batch, needs none of what the queues do: there is nothing to pack it with, no
partial batch to time or flush, no other request to split the outputs among.
Through the queues it still paid an input and an output ring item, the ring's
read lock, the batch assembly, the output split and their releases; at one
request in flight that was most of the runtime's own Python per request
(docs/benchmarks.md, "Issue 21"). Here the caller parks the job in one slot and
interrupts the device's wait on its first input queue
(:meth:`~ipuserve.runtime.queues.InputQueue.interrupt`); the device's input
callbacks return the job's arrays, its output callbacks hand the run's outputs
to the request, and the run's end clears the slot.

The request keeps everything else: its ``OutputFuture``, its trace, the batch
policy's and the monitor's accounts, failure handling (the replica fails it
like any other pending request). Only the ModelRunner configuration a worker
uses takes the path: no look-ahead thread (which would hold the next inputs
already), ``flush_on_waiting_outputs`` (so an idle device runs no dummy batches
that could stand between the slot and its run), no conditional inputs, batching
dimension 0 and library-allocated outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np

from ipuserve.runtime.model_runner.futures import Request
from ipuserve.runtime.popef.types import Anchor
from ipuserve.runtime.queues import InputQueue

StreamCallback = Callable[[np.ndarray], Any]


class DirectJob(NamedTuple):
    request: Request
    inputs: Mapping[str, np.ndarray]
    outputs: frozenset[str]


class DirectPath:
    """The slot for one lone job, and the stream callbacks that serve it.

    ``geometry`` maps each queue-fed input to the (shape, dtype) of one compiled
    batch; ``first`` is the input the device reads first in a run.
    """

    def __init__(self, geometry: dict[str, tuple[tuple[int, ...], np.dtype[Any]]], first: str):
        self._geometry = geometry
        self._names = frozenset(geometry)
        self.first = first
        #: The job the device's current (or next) run serves; None on the queue path.
        #: Set by the caller under the replica's lock, cleared by the device thread.
        self.job: DirectJob | None = None
        #: Runs that served a parked job (read by tests and benchmarks).
        self.runs = 0

    def idle(self, waiting_for: str | None) -> bool:
        """No job parked, and the device waits for (or starts reading) its first input."""
        return self.job is None and waiting_for == self.first

    def fits(self, inputs: Mapping[str, Any]) -> bool:
        """Whether ``inputs`` are exactly one batch the device can read as they are."""
        if inputs.keys() != self._names:
            return False
        for name, array in inputs.items():
            shape, dtype = self._geometry[name]
            if (
                not isinstance(array, np.ndarray)
                or array.shape != shape
                or array.dtype != dtype
                or not array.flags.c_contiguous
            ):
                return False
        return True

    def reader(
        self, name: str, queued: StreamCallback, waiting: Callable[[str | None], None]
    ) -> StreamCallback:
        """The input callback: the job's array when a job is parked, else the queue's
        (``waiting(name)`` around the queue's wait, for timeout messages and for
        :meth:`Replica.submit` to see the device idle on its first input)."""

        def read(buffer: np.ndarray) -> Any:
            job = self.job
            if job is None:
                waiting(name)
                result = queued(buffer)
                waiting(None)
                job = self.job
                if job is None:
                    return result
            if name == self.first:
                self.runs += 1
                job.request.read_started()
            job.request.read_completed()
            return job.inputs[name]

        return read

    def writer(self, name: str, queued: StreamCallback) -> StreamCallback:
        """The output callback: straight to the parked job's request, else the queue's."""

        def write(array: np.ndarray) -> Any:
            job = self.job
            if job is None:
                return queued(array)
            if name in job.outputs:
                job.request.output_written(name, array)  # the device's memory, as queued
            return None

        return write


def direct_path(
    queues: Mapping[str, InputQueue], ordered: list[Anchor] | None
) -> DirectPath | None:
    """The path for a replica whose queue-fed inputs the device reads in ``ordered``
    order (None: some are conditional, and the path is not taken)."""
    if not ordered:
        return None
    geometry = {
        name: (tuple(queue.tensorInfo().shape()), queue.tensorInfo().numpyDType())
        for name, queue in queues.items()
    }
    return DirectPath(geometry, ordered[0].name())
