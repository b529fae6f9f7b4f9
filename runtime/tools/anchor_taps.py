"""Timed anchor callbacks for the callbacks benchmark: the host side of every stream.

A :class:`Tap` is one anchor's callback plus its counters. Input taps fill the
buffer the device offers from a source array prepared once (``np.copyto``), or
-- with ``zero_copy``, ipuserve's extension of the callback contract
(docs/architecture.md §1.1) -- hand the device the source array itself. Output
taps read the device's data into a destination array prepared once. Each call
is timed from entry to return; that is the host's share of a transfer.

:func:`connect_taps` installs them through ``Session.setUserInputHandler`` /
``setUserOutputHandler``, the spec's way of binding user callbacks, with
``skip_connected`` so tensor data (weights) stays bound to the model file.
Callbacks run on the device thread; the counters are read on the main thread
between runs, when the device thread is idle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ipuserve.runtime.popef.types import Anchor, TensorType
from ipuserve.runtime.session import CallbackHandle, CallbackInfo, Session
from ipuserve.runtime.tools.stats import LatencyRecorder, now_ns

Array = np.ndarray[Any, Any]


@dataclass(eq=False)
class Tap:
    """One anchor's callback and what it has moved."""

    anchor: Anchor
    buffer: Array  # input: the source; output: the destination
    times: LatencyRecorder
    calls: int = 0

    @property
    def direction(self) -> str:
        return "input" if self.anchor.type() is TensorType.INPUT else "output"

    def nbytes(self) -> int:
        return int(self.buffer.nbytes)

    def fill(self, offered: Array) -> None:
        """Input, copying: fill the device's buffer."""
        start = now_ns()
        np.copyto(offered, self.buffer)
        self.calls += 1
        self.times.add(now_ns() - start)

    def hand_over(self, _offered: Array) -> Array:
        """Input, zero-copy: give the device our own array instead of filling its buffer."""
        start = now_ns()
        self.calls += 1
        self.times.add(now_ns() - start)
        return self.buffer

    def read(self, data: Array) -> None:
        """Output: copy the device's data out before the callback returns."""
        start = now_ns()
        np.copyto(self.buffer, data)
        self.calls += 1
        self.times.add(now_ns() - start)


@dataclass
class Taps:
    """Every tap of a session, and the per-direction timing they share."""

    zero_copy: bool
    taps: list[Tap] = field(default_factory=list)
    times: dict[str, LatencyRecorder] = field(
        default_factory=lambda: {"input": LatencyRecorder(), "output": LatencyRecorder()}
    )

    def reset(self) -> None:
        """Forget the warm-up: zero every count and timing."""
        self.times = {"input": LatencyRecorder(), "output": LatencyRecorder()}
        for tap in self.taps:
            tap.calls, tap.times = 0, self.times[tap.direction]

    def bytes_moved(self, direction: str) -> int:
        return sum(t.calls * t.nbytes() for t in self.taps if t.direction == direction)

    def describe(self) -> list[dict[str, Any]]:
        return [
            {
                "name": t.anchor.name(),
                "direction": t.direction,
                "shape": t.anchor.tensorInfo().shape(),
                "dtype": str(t.buffer.dtype),
                "bytes": t.nbytes(),
                "calls": t.calls,
            }
            for t in self.taps
        ]

    # -- callback factories (Session.setUser*Handler) ---------------------------------
    def input_factory(self, info: CallbackInfo) -> CallbackHandle:
        tap = self._tap(info.anchor, source_tensor(info.anchor))
        return tap.hand_over if self.zero_copy else tap.fill

    def output_factory(self, info: CallbackInfo) -> CallbackHandle:
        tensor = info.anchor.tensorInfo()
        return self._tap(info.anchor, np.empty(tensor.shape(), tensor.numpyDType())).read

    def _tap(self, anchor: Anchor, buffer: Array) -> Tap:
        tap = Tap(
            anchor, buffer, self.times["input" if anchor.type() is TensorType.INPUT else "output"]
        )
        self.taps.append(tap)
        return tap


def connect_taps(session: Session, *, zero_copy: bool) -> Taps:
    """Bind a timed callback to every anchor of ``session`` that has no data source yet."""
    taps = Taps(zero_copy)
    session.setUserInputHandler(taps.input_factory, skip_connected=True)
    session.setUserOutputHandler(taps.output_factory, skip_connected=True)
    return taps


def source_tensor(anchor: Anchor) -> Array:
    """Input contents: floats ~ N(0, 1), integers and booleans 0 (a valid selector or index).

    C-contiguous and of the anchor's exact shape and dtype, as zero-copy requires.
    """
    info = anchor.tensorInfo()
    dtype = info.numpyDType()
    if dtype.kind == "f":
        return np.random.default_rng(0).standard_normal(info.shape()).astype(dtype)
    return np.zeros(info.shape(), dtype)
