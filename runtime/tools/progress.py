"""A progress report for long runs: one self-overwriting line on stderr.

Benchmarks call a :data:`ProgressCallback` with a :class:`Progress` snapshot as
often as they like (every run, every tick of a wait); :class:`ProgressLine`
redraws at most every ``interval_s`` so the reporting costs nothing measurable.
By default it is on only when the stream is a terminal, so pipes, logs and
``--json`` output stay clean; ``enabled`` overrides that either way.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO


@dataclass(frozen=True)
class Progress:
    """Where a benchmark is: its phase, seconds since start and units done so far."""

    phase: str  # "warm-up" or "measuring"
    elapsed_s: float
    done: int
    unit: str  # "items", "runs"


ProgressCallback = Callable[[Progress], None]


class ProgressLine:
    """Draws :class:`Progress` snapshots as one updating line (``\\r``, no newline)."""

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        enabled: bool | None = None,
        interval_s: float = 0.2,
    ) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = _is_terminal(self._stream) if enabled is None else enabled
        self._interval_s = interval_s
        self._next_draw = 0.0
        self._drawn = False

    def __call__(self, progress: Progress) -> None:
        if not self._enabled:
            return
        now = time.monotonic()
        if now < self._next_draw:
            return
        self._next_draw = now + self._interval_s
        speed = progress.done / progress.elapsed_s if progress.elapsed_s > 0 else 0.0
        self._stream.write(
            f"\r{progress.phase:9} {progress.elapsed_s:7.1f} s  {progress.done:10d} "
            f"{progress.unit}  ~{speed:10.0f} {progress.unit}/s"
        )
        self._stream.flush()
        self._drawn = True

    def finish(self) -> None:
        """End the line, if one was drawn, so what follows starts on a fresh line."""
        if self._drawn:
            self._stream.write("\n")
            self._stream.flush()
            self._drawn = False


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed or unusual streams
        return False
