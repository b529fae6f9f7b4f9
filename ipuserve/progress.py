"""The one progress report for long runs: one self-overwriting line on stderr.

The runtime's tools and ``ipuserve bench`` both draw theirs with it (it lives in the
common ground because both may import it, and neither the other). They call a
:data:`ProgressCallback` with a :class:`Progress` snapshot as often as they like
(every run, every tick of a wait); :class:`ProgressLine` redraws at most every
``interval_s`` so the reporting costs nothing measurable. By default it is on only
when the stream is a terminal, so pipes, logs and ``--json`` output stay clean;
``enabled`` overrides that either way. :meth:`ProgressLine.note` says something on a
line of its own, terminal or not (what a user must see even in a log).
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
    unit: str  # "items", "runs", "requests"
    #: more to show after the rate, e.g. ``errors 0  in flight 16``
    detail: str = ""
    #: whether the line shows ``done`` per second (not for a count that is no work
    #: done, such as the versions READY while a load waits)
    rate: bool = True


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
        #: the last snapshot the interval kept off the line: the line must end on it
        #: (a wait that ended within the interval would otherwise show a stale state)
        self._skipped: Progress | None = None

    @property
    def enabled(self) -> bool:
        """Whether it draws (a caller may skip the work of a snapshot when not)."""
        return self._enabled

    def __call__(self, progress: Progress) -> None:
        if not self._enabled:
            return
        now = time.monotonic()
        if now < self._next_draw:
            self._skipped = progress  # drawn by finish() if nothing newer is
            return
        self._next_draw = now + self._interval_s
        self._draw(progress)

    def _draw(self, progress: Progress) -> None:
        speed = progress.done / progress.elapsed_s if progress.elapsed_s > 0 else 0.0
        detail = f"  {progress.detail}" if progress.detail else ""
        rate = f"  ~{speed:10.0f} {progress.unit}/s" if progress.rate else ""
        self._stream.write(
            f"\r{progress.phase:9} {progress.elapsed_s:7.1f} s  {progress.done:10d} "
            f"{progress.unit}{rate}{detail}"
        )
        self._stream.flush()
        self._drawn = True
        self._skipped = None

    def note(self, text: str) -> None:
        """Write ``text`` on a line of its own, even where no line is drawn; a line
        drawn so far stays above it."""
        self.finish()
        self._stream.write(text + "\n")
        self._stream.flush()

    def finish(self) -> None:
        """Draw the last snapshot if the interval held it back, then end the line, if
        one was drawn, so what follows starts on a fresh line."""
        if self._skipped is not None:
            self._draw(self._skipped)
        if self._drawn:
            self._stream.write("\n")
            self._stream.flush()
            self._drawn = False


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed or unusual streams
        return False
