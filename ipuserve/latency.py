"""The one latency summary: what every benchmark and tool reports for a set of latencies.

``ipuserve bench`` (the fabric suite, the load generator, the benchmark scripts) and
the runtime's tools (``ipuserve tools ...``) summarise latencies the same way, so
their figures read alike and a percentile means the same thing in every report. It
lives in the common ground because both may import it and neither may import the
other (tests/test_layout.py): the runtime knows no client, and the bench starts the
runtime only as a process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

#: The percentiles every report holds, as (key, percent).
PERCENTILES: tuple[tuple[str, float], ...] = (
    ("p50", 50.0),
    ("p90", 90.0),
    ("p99", 99.0),
    ("p99.9", 99.9),
)

#: The summary's keys, in the order it holds them.
KEYS: tuple[str, ...] = ("count", "mean", *(key for key, _ in PERCENTILES), "max")


def latency_us(latencies_ns: Sequence[int] | np.ndarray[Any, Any]) -> dict[str, float]:
    """``count``, ``mean``, the :data:`PERCENTILES` and ``max`` of nanosecond
    latencies, in microseconds to the nanosecond (all zero when there are none: a run
    in which nothing succeeded still reports)."""
    values = np.asarray(latencies_ns, dtype=np.float64) / 1e3
    if values.size == 0:
        return {"count": 0, **dict.fromkeys(KEYS[1:], 0.0)}
    found = np.percentile(values, [q for _, q in PERCENTILES])
    summary: dict[str, float] = {"count": int(values.size), "mean": round(float(values.mean()), 3)}
    summary.update(
        {key: round(float(v), 3) for (key, _), v in zip(PERCENTILES, found, strict=True)}
    )
    summary["max"] = round(float(values.max()), 3)
    return summary
