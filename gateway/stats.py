"""Per-model counters in the shape of Triton's statistics extension, from the latency
split the fabric reports with every result (:class:`~ipuserve.client.Timing`).

The fabric batches behind the gateway's back, so an *execution* here is one request
the fabric ran (``execution_count`` counts requests, ``inference_count`` samples).
``queue`` is the time in the broker's and the worker's queues, ``compute_infer`` the
device time, ``compute_input`` the rest of the worker's time (validation, packing,
copies); ``compute_output`` is folded into that and stays 0. ``fail`` counts the
requests of a listed model that failed, refused by the gateway's or the broker's checks
or failed in the fabric (Triton counts the requests it rejects too): under the version
the request named, else the model's default as the gateway last listed it (a refusal
does not say which version refused). A success counts under the version that answered.

The counters are prometheus-client's (:class:`~gateway.metrics.GatewayMetrics`), so
that with several gateway processes a statistics call in any of them answers for all
(that module says how). Each success updates seven values: the success count (which
is also the count of ``execution_count``, ``queue``, ``compute_*``, all one per
success, so they are not stored again), the four times, the samples and the last
inference's time; a failure three. A read (:meth:`Statistics.snapshot`) collects the
families once and builds every model version's :class:`ModelStatistics` from them.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Metric

from ipuserve.client import Timing
from ipuserve.gateway.metrics import GatewayMetrics

__all__ = ["Duration", "ModelStatistics", "Snapshot", "Statistics"]

#: (model name, version)
Key = tuple[str, str]


@dataclass(frozen=True)
class Duration:
    """How many and how long, in all (nanoseconds)."""

    count: int
    ns: int


@dataclass(frozen=True)
class ModelStatistics:
    """One model version's statistics (Triton's ``ModelStatistics``)."""

    name: str
    version: str
    last_inference_ms: int
    inference_count: int
    execution_count: int
    success: Duration
    fail: Duration
    queue: Duration
    compute_input: Duration
    compute_infer: Duration
    compute_output: Duration


@dataclass(frozen=True, slots=True)
class _Series:
    """One model version's children, bound once."""

    successes: Counter
    failures: Counter
    success_seconds: Counter
    fail_seconds: Counter
    queue_seconds: Counter
    input_seconds: Counter
    infer_seconds: Counter
    samples: Counter
    last: Gauge


class Statistics:
    """Records requests into the gateway's metrics and reads them back in Triton's
    shape. Safe from any thread (prometheus-client's values take their lock)."""

    def __init__(self, metrics: GatewayMetrics | None = None) -> None:
        self.metrics = GatewayMetrics() if metrics is None else metrics
        self._series: dict[Key, _Series] = {}

    def _of(self, model: str, version: str) -> _Series:
        series = self._series.get((model, version))
        if series is None:
            series = self._series.setdefault((model, version), self._bind(model, version))
        return series

    def _bind(self, model: str, version: str) -> _Series:
        m = self.metrics
        return _Series(
            successes=m.inference_requests.labels(model, version, "success"),
            failures=m.inference_requests.labels(model, version, "fail"),
            success_seconds=m.inference_request_seconds.labels(model, version, "success"),
            fail_seconds=m.inference_request_seconds.labels(model, version, "fail"),
            queue_seconds=m.inference_queue_seconds.labels(model, version),
            input_seconds=m.inference_compute_input_seconds.labels(model, version),
            infer_seconds=m.inference_compute_infer_seconds.labels(model, version),
            samples=m.inference_samples.labels(model, version),
            last=m.inference_last.labels(model, version),
        )

    def succeeded(
        self, model: str, version: str, samples: int, seconds: float, timing: Timing
    ) -> None:
        s = self._of(model, version)
        s.last.set(time.time())
        s.samples.inc(samples)
        s.successes.inc()
        s.success_seconds.inc(seconds)
        s.queue_seconds.inc((timing.broker_queue_us + timing.worker_queue_us) * 1e-6)
        s.input_seconds.inc(timing.worker_other_us * 1e-6)
        s.infer_seconds.inc(timing.device_us * 1e-6)

    def failed(self, model: str, version: str, seconds: float) -> None:
        s = self._of(model, version)
        s.last.set(time.time())
        s.failures.inc()
        s.fail_seconds.inc(seconds)

    def snapshot(self) -> Snapshot:
        """Every model version's statistics as they are now (every process's, in
        multiprocess mode)."""
        return Snapshot.of(self.metrics.collector().collect())


@dataclass(slots=True)
class _Totals:
    """One model version's sums, as read (counts are floats on the page)."""

    last: float = 0.0
    samples: float = 0.0
    success: float = 0.0
    fail: float = 0.0
    success_s: float = 0.0
    fail_s: float = 0.0
    queue_s: float = 0.0
    input_s: float = 0.0
    infer_s: float = 0.0

    def frozen(self, model: str, version: str) -> ModelStatistics:
        successes = int(self.success)
        return ModelStatistics(
            name=model,
            version=version,
            last_inference_ms=int(self.last * 1e3),
            inference_count=int(self.samples),
            execution_count=successes,
            success=Duration(successes, _ns(self.success_s)),
            fail=Duration(int(self.fail), _ns(self.fail_s)),
            queue=Duration(successes, _ns(self.queue_s)),
            compute_input=Duration(successes, _ns(self.input_s)),
            compute_infer=Duration(successes, _ns(self.infer_s)),
            compute_output=Duration(successes, 0),
        )


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


#: sample name (and outcome label, if any) -> the _Totals field it adds to
_FIELDS = {
    ("ipuserve_gateway_inference_requests_total", "success"): "success",
    ("ipuserve_gateway_inference_requests_total", "fail"): "fail",
    ("ipuserve_gateway_inference_request_seconds_total", "success"): "success_s",
    ("ipuserve_gateway_inference_request_seconds_total", "fail"): "fail_s",
    ("ipuserve_gateway_inference_queue_seconds_total", None): "queue_s",
    ("ipuserve_gateway_inference_compute_input_seconds_total", None): "input_s",
    ("ipuserve_gateway_inference_compute_infer_seconds_total", None): "infer_s",
    ("ipuserve_gateway_inference_samples_total", None): "samples",
}
_LAST = "ipuserve_gateway_inference_last_timestamp_seconds"


class Snapshot:
    """Model versions' statistics read at one moment."""

    def __init__(self, totals: dict[Key, _Totals]) -> None:
        self._totals = totals

    @classmethod
    def of(cls, families: Iterable[Metric]) -> Snapshot:
        """From the gateway's families (one process's, or every process's merged)."""
        totals: dict[Key, _Totals] = {}
        for family in families:
            for sample in family.samples:
                labels = sample.labels
                if "version" not in labels or "model" not in labels:
                    continue
                key = (labels["model"], labels["version"])
                if sample.name == _LAST:
                    t = totals.setdefault(key, _Totals())
                    t.last = max(t.last, sample.value)
                    continue
                field = _FIELDS.get((sample.name, labels.get("outcome")))
                if field is not None:
                    t = totals.setdefault(key, _Totals())
                    setattr(t, field, getattr(t, field) + sample.value)
        return cls(totals)

    def of_version(self, model: str, version: str) -> ModelStatistics:
        """``model`` ``version``'s statistics (zeros if it never served)."""
        return self._totals.get((model, version), _Totals()).frozen(model, version)

    def names(self) -> list[str]:
        return list(dict.fromkeys(name for name, _ in self._totals))

    def versions(self, model: str) -> list[str]:
        """The versions of ``model`` that have counters."""
        return [v for name, v in self._totals if name == model]
