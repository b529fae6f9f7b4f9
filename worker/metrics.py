"""The worker's metrics: its jobs per model version, the runtime's own monitoring
statistics, its credit pool, and what a model repository hosts.

Job counters and latency histograms (time queued in the worker, on the device, and in
the worker end to end) are updated as jobs finish; the batch histograms (real samples
per device run, and how long each batch took to form from its first sample) as the
batch policy closes batches, so its decisions can be seen. Every histogram carries
``model`` and ``version`` labels. The ModelRunner's monitoring statistics (spec
section 3.8) are read when the endpoint is scraped, per model version and replica:
request and batch counts, flushes, padding, read timeouts, and the mean and p99 of
each request phase.

A worker process keeps its job families once (:class:`WorkerFamilies`, one registry:
each family once on the page) and gives each model version it serves a
:class:`WorkerMetrics` over them, with that version's children bound once (a
``labels()`` call costs ~0.8 µs, twice per job otherwise). prometheus-client's values
take their own lock, so updates from the socket thread and the device threads are
never lost.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from prometheus_client import Metric
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from ipuserve.metrics import Metrics

#: Upper bounds of the samples-per-batch buckets (a batch holds at least one).
BATCH_SIZE_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0)
#: Upper bounds of the batch-forming buckets: sub-millisecond waits matter here.
BATCH_WAIT_BUCKETS = (0.0, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016,
                      0.032, 0.064, 0.128, 0.256, 0.512, 1.0, 5.0)  # fmt: skip
#: Upper bounds of the load and unload buckets: a small model loads in milliseconds,
#: a large one (or a busy machine) in tens of seconds.
LOAD_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

#: the runtime's count statistic -> (metric name, help)
_RUNTIME_COUNTS = {
    "request": ("requests", "Requests the replica's ModelRunner took."),
    "batches": ("batches", "Batches the replica ran on its device."),
    "flushed_batches": ("flushed_batches", "Batches run part-empty (flushed) on a timeout."),
    "padded_samples": ("padded_samples", "Padding samples added to flushed batches."),
    "read_timeouts": (
        "read_timeouts",
        "Times the device waited timeout_ns for an input; it rises while idle too.",
    ),
}
_PHASES = ("request", "read_preparation", "read_queue", "computation")
_MV = ("model", "version")


class WorkerFamilies(Metrics):
    """A worker process's job families, shared by every model version it serves."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        p = "ipuserve_worker_"
        self.policy = self.gauge(
            p + "batch_policy", "The batch policy (label), 1.", (*_MV, "policy")
        )
        self.batch_samples = self.histogram(
            p + "batch_samples", "Real samples per device run (padding not counted).",
            _MV, BATCH_SIZE_BUCKETS,
        )  # fmt: skip
        self.batch_wait_seconds = self.histogram(
            p + "batch_wait_seconds",
            "From a batch's first sample to the batch being full or run partial.",
            _MV,
            BATCH_WAIT_BUCKETS,
        )
        self.jobs = self.counter(
            p + "jobs_total",
            "Jobs answered, by model, version and outcome (ok or code).",
            (*_MV, "outcome"),
        )
        self.in_flight = self.gauge(p + "in_flight", "Jobs submitted and not yet answered.", _MV)
        self.queue_seconds = self.histogram(
            p + "queue_seconds", "Submit to the device taking the job.", _MV
        )
        self.device_seconds = self.histogram(
            p + "device_seconds", "The job on the (simulated) device.", _MV
        )
        self.job_seconds = self.histogram(
            p + "job_seconds", "Submit to result, in the worker.", _MV
        )
        self.runtime = RuntimeStatistics()
        self.registry.register(self.runtime)


class WorkerMetrics:
    """One model version's job metrics (the families' children for it)."""

    def __init__(
        self,
        model: str,
        batch_policy: str = "",
        version: str = "1",
        families: WorkerFamilies | None = None,
    ) -> None:
        """``families``: the process's (a worker hosting several model versions shares
        one); by default a set of its own."""
        self.families = f = WorkerFamilies() if families is None else families
        self.registry = f.registry
        self.model, self.version = model, version
        if batch_policy:
            f.policy.labels(model, version, batch_policy).set(1.0)
        self._in_flight = f.in_flight.labels(model, version)
        self._ok = f.jobs.labels(model, version, "ok")
        self._queue = f.queue_seconds.labels(model, version)
        self._device = f.device_seconds.labels(model, version)
        self._job = f.job_seconds.labels(model, version)
        self._batch_samples = f.batch_samples.labels(model, version)
        self._batch_wait = f.batch_wait_seconds.labels(model, version)

    def watch(self, runner: Any) -> None:
        """Report ``runner``'s monitoring statistics at every scrape."""
        self.families.runtime.watch(self.model, self.version, runner)

    def close(self) -> None:
        """The version is unloaded: its runtime statistics leave the page (its job
        counts stay, as counters do)."""
        self.families.runtime.unwatch(self.model, self.version)

    def submitted(self) -> None:
        self._in_flight.inc()

    def finished(
        self, outcome: str, seconds: float, queue_us: float = 0.0, device_us: float = 0.0
    ) -> None:
        self._in_flight.dec()
        if outcome == "ok":
            self._ok.inc()
            self._queue.observe(queue_us / 1e6)
            self._device.observe(device_us / 1e6)
        else:
            self.families.jobs.labels(self.model, self.version, outcome).inc()
        self._job.observe(seconds)

    def batch_closed(self, samples: int, waited_s: float) -> None:
        """A replica's batch is full, or its policy runs it partial (a runtime thread)."""
        self._batch_samples.observe(samples)
        self._batch_wait.observe(waited_s)

    def refused(self, model: str, outcome: str) -> None:
        """A job answered without running (refused, or expired while waiting). Another
        model's name is counted under "" so that made-up names add no labels."""
        ours = model == self.model
        labels = (self.model, self.version) if ours else ("", "")
        self.families.jobs.labels(*labels, outcome).inc()

    def value(self, name: str, **labels: str) -> float:
        """:meth:`ipuserve.metrics.Metrics.value` over the families."""
        return self.families.value(name, **labels)

    def render(self) -> str:
        return self.families.render()


class RuntimeStatistics(Collector):
    """The watched ModelRunners' monitoring statistics as families built at each
    scrape: each family's samples together, every model version's and replica's under
    its labels."""

    def __init__(self) -> None:
        self._runners: dict[tuple[str, str], Any] = {}

    def watch(self, model: str, version: str, runner: Any) -> None:
        self._runners[model, version] = runner

    def unwatch(self, model: str, version: str) -> None:
        self._runners.pop((model, version), None)

    def collect(self) -> Iterator[Metric]:
        runners = list(self._runners.items())  # a C-level copy: a load may add one
        if not runners:
            return
        p, labels = "ipuserve_runtime_", ("model", "version", "replica")
        counts = {
            key: CounterMetricFamily(f"{p}{name}_total", help_, labels=labels)
            for key, (name, help_) in _RUNTIME_COUNTS.items()
        }
        phased = (*labels, "phase")
        mean = GaugeMetricFamily(f"{p}phase_mean_microseconds", "Mean time of a request phase.",
                                 labels=phased)  # fmt: skip
        p99 = GaugeMetricFamily(f"{p}phase_p99_microseconds", "p99 time of a request phase.",
                                labels=phased)  # fmt: skip
        for (model, version), runner in runners:
            for replica in range(runner.config().replication_factor):
                values = (model, version, str(replica))
                totals = runner.getMonitoringStatisticsTotalCount({}, replica_id=replica)
                for key, family in counts.items():
                    family.add_metric(values, totals.get(f"{key}_monitoring_statistics_count", 0))
                means = runner.getMonitoringStatisticsMean({}, replica_id=replica)
                p99s = runner.getMonitoringStatisticsPercentile({}, 0.99, replica_id=replica)
                for phase in _PHASES:
                    if f"{phase}_monitoring_statistics_mean_us" in means:
                        mean.add_metric(
                            (*values, phase), means[f"{phase}_monitoring_statistics_mean_us"]
                        )
                        p99.add_metric(
                            (*values, phase), p99s[f"{phase}_monitoring_statistics_percentile_us"]
                        )
        yield from (*counts.values(), mean, p99)


class CreditMetrics(Metrics):
    """What a worker with several brokers holds against its one capacity
    (:class:`ipuserve.worker.credit.CreditPool`): an operator checks from these that
    the brokers' credits never add up to more than the worker can hold."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        p = "ipuserve_worker_"
        self.capacity = self.gauge(
            p + "capacity", "Jobs the worker holds at most, all brokers together."
        )
        self.capacity.set(float(capacity))
        self.held = self.gauge(
            p + "jobs_held", "Jobs held now (waiting or running), all brokers together."
        )
        self.held_max = self.gauge(
            p + "jobs_held_max", "The most jobs held at once since the worker started."
        )
        self.broker_credit = self.gauge(
            p + "broker_credit", "Credit announced to each broker connection.", ("broker",)
        )

    def set_credit(self, broker: str, credit: int | None) -> None:
        """A connection's credit; None removes its sample (the broker is no longer served)."""
        if credit is None:
            with contextlib.suppress(KeyError):  # never set
                self.broker_credit.remove(broker)
        else:
            self.broker_credit.labels(broker).set(float(credit))


class RepositoryMetrics(Metrics):
    """What a worker hosting models from a repository reports as it loads and unloads
    them. Its model host calls :meth:`loaded`, :meth:`unloaded` and :meth:`free_ipus`;
    the registry goes on the worker's page beside its job families (pass
    ``[families.registry, repository.registry, ...]`` to
    :class:`ipuserve.metrics.MetricsServer`).

    - ``ipuserve_model_loaded{model,version}``: 1 while the version is loaded here
      (READY), 0 once unloaded (a version never loaded has no series);
    - ``ipuserve_worker_free_ipus``: simulated IPUs no loaded version holds;
    - ``ipuserve_model_load_seconds{model,version}`` and
      ``ipuserve_model_unload_seconds{model,version}``: from the order to READY, and
      from the order to its IPUs free (the drain included);
    - ``ipuserve_model_load_failures_total{model,version}``: loads that failed
      (:meth:`load_failed`).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        self.model_loaded = self.gauge(
            "ipuserve_model_loaded", "1 while the model version is loaded here, 0 once not.", _MV
        )
        self.free = self.gauge("ipuserve_worker_free_ipus", "Simulated IPUs no model holds.")
        self.load_seconds = self.histogram(
            "ipuserve_model_load_seconds", "From a load order to the version ready.",
            _MV, LOAD_BUCKETS,
        )  # fmt: skip
        self.unload_seconds = self.histogram(
            "ipuserve_model_unload_seconds",
            "From an unload order to the version's IPUs free (its drain included).",
            _MV,
            LOAD_BUCKETS,
        )
        self.load_failures = self.counter(
            "ipuserve_model_load_failures_total", "Loads that failed, by model version.", _MV
        )

    def loaded(self, model: str, version: str, seconds: float) -> None:
        """``model`` ``version`` is ready here, ``seconds`` after it was asked for."""
        self.model_loaded.labels(model, version).set(1.0)
        self.load_seconds.labels(model, version).observe(seconds)

    def unloaded(self, model: str, version: str, seconds: float) -> None:
        """``model`` ``version``'s IPUs are free, ``seconds`` after its unload was asked for."""
        self.model_loaded.labels(model, version).set(0.0)
        self.unload_seconds.labels(model, version).observe(seconds)

    def load_failed(self, model: str, version: str) -> None:
        self.load_failures.labels(model, version).inc()

    def free_ipus(self, count: int) -> None:
        self.free.set(float(count))
