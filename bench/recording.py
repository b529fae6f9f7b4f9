"""What a load run recorded, and the summary the bench prints.

The load generators append one :class:`Sample` per finished request (from the
client's I/O thread; ``list.append`` is atomic, so no lock is needed). The
summary keeps only samples that finished inside the measurement window, so
warm-up and the drain after the stop are left out of every figure.

The latency split follows Triton's perf_analyzer: the workers report how long a
request waited in the broker's queue, in the worker before the device, and on
the device; what is left of the client-measured total is the wire (sockets,
framing, both hops and the client itself). The latency figures themselves are
:func:`ipuserve.latency.latency_us`, the one summary every report uses.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ipuserve.client.timing import Timing
from ipuserve.latency import latency_us


@dataclass(frozen=True, slots=True)
class Sample:
    """One finished request as a load generator saw it."""

    done_ns: int
    latency_ns: int
    error: str | None = None
    timing: Timing | None = None
    samples: int = 1
    nbytes: int = 0
    #: the error's message (``error`` is its code)
    message: str | None = None


#: ``Recording.stop_ns`` while the measurement window is still open
WINDOW_OPEN_NS = 2**62


@dataclass
class Recording:
    """Samples of one run plus the measurement window (``perf_counter_ns`` clock)."""

    samples: list[Sample] = field(default_factory=list)
    start_ns: int = 0
    stop_ns: int = 0
    skipped: int = 0
    #: stopped by Ctrl-C before its duration or request count
    interrupted: bool = False

    def add(self, sample: Sample) -> None:
        self.samples.append(sample)

    @property
    def window_closed(self) -> bool:
        return self.stop_ns < WINDOW_OPEN_NS

    def measured(self) -> list[Sample]:
        return [s for s in self.samples if self.start_ns <= s.done_ns <= self.stop_ns]


def summarize(recording: Recording) -> dict[str, Any]:
    """The JSON-ready summary of a run: counts, throughput, latency, split.

    ``errors`` counts the failed requests per error code; ``error_messages`` holds the
    first message of each code, so a run that fails says why. ``after_window`` counts
    the requests in flight when the window closed, which finish (or fail) later: they
    are left out of the figures, but a failure among them must not go unseen.
    """
    kept = recording.measured()
    ok = [s for s in kept if s.error is None]
    seconds = max((recording.stop_ns - recording.start_ns) / 1e9, 1e-9)
    errors = Counter(s.error for s in kept if s.error is not None)
    late = [s for s in recording.samples if s.done_ns > recording.stop_ns]
    messages: dict[str, str] = {}
    for s in (*kept, *late):
        if s.error is not None and s.error not in messages:
            messages[s.error] = s.message or ""
    late_errors = Counter(s.error for s in late if s.error is not None)
    return {
        "requests": len(kept),
        "ok": len(ok),
        "errors": dict(sorted(errors.items())),
        "error_messages": dict(sorted(messages.items())),
        "skipped": recording.skipped,
        "interrupted": recording.interrupted,
        "after_window": {
            "ok": sum(1 for s in late if s.error is None),
            "errors": dict(sorted(late_errors.items())),
        },
        "duration_s": round(seconds, 3),
        "throughput": throughput(ok, seconds),
        "latency_us": latency_us([s.latency_ns for s in ok]),
        "split_us": split_us([s.timing for s in ok if s.timing is not None]),
    }


def throughput(ok: list[Sample], seconds: float) -> dict[str, float]:
    return {
        "req_per_s": round(len(ok) / seconds, 1),
        "samples_per_s": round(sum(s.samples for s in ok) / seconds, 1),
        "mb_per_s": round(sum(s.nbytes for s in ok) / seconds / 1e6, 2),
    }


SPLIT_PARTS = ("broker_queue", "worker_queue", "device", "worker_other", "wire")


def split_us(timings: list[Timing]) -> dict[str, float]:
    """Mean microseconds per part; the parts add up to ``total`` (means are additive)."""
    if not timings:
        return {name: 0.0 for name in [*SPLIT_PARTS, "total"]}
    columns = {
        "broker_queue": [t.broker_queue_us for t in timings],
        "worker_queue": [t.worker_queue_us for t in timings],
        "device": [t.device_us for t in timings],
        "worker_other": [t.worker_other_us for t in timings],
        "wire": [t.wire_us for t in timings],
    }
    out = {name: round(float(np.mean(v)), 1) for name, v in columns.items()}
    out["total"] = round(sum(out.values()), 1)
    return out
