"""The worker's metrics: its jobs, and the runtime's own monitoring statistics.

Job counters and latency histograms (time queued in the worker, on the device,
and in the worker end to end) are updated as jobs finish; the batch histograms
(real samples per device run, and how long each batch took to form from its first
sample) as the batch policy closes batches, so its decisions can be seen. The ModelRunner's
monitoring statistics (spec section 3.8) are read when the endpoint is scraped,
per replica: request and batch counts, flushes, padding, read timeouts, and the
mean and p99 of each request phase.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from ipuserve.metrics import Family, Histogram, Registry

#: Upper bounds of the samples-per-batch buckets (a batch holds at least one).
BATCH_SIZE_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0)
#: Upper bounds of the batch-forming buckets: sub-millisecond waits matter here.
BATCH_WAIT_BUCKETS = (0.0, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016,
                      0.032, 0.064, 0.128, 0.256, 0.512, 1.0, 5.0)  # fmt: skip

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


class WorkerMetrics(Registry):
    def __init__(self, model: str, batch_policy: str = "") -> None:
        p = "ipuserve_worker_"
        self.model = model
        self.policy = Family(p + "batch_policy", "The batch policy (label), 1.", "gauge")
        if batch_policy:
            self.policy.set(1.0, model=model, policy=batch_policy)
        self.batch_samples = Histogram(
            p + "batch_samples", "Real samples per device run (padding not counted).",
            BATCH_SIZE_BUCKETS,
        )  # fmt: skip
        self.batch_wait_seconds = Histogram(
            p + "batch_wait_seconds",
            "From a batch's first sample to the batch being full or run partial.",
            BATCH_WAIT_BUCKETS,
        )
        self.jobs = Family(p + "jobs_total", "Jobs answered, by model and outcome (ok or code).")
        self.in_flight = Family(p + "in_flight", "Jobs submitted and not yet answered.", "gauge")
        self.queue_seconds = Histogram(p + "queue_seconds", "Submit to the device taking the job.")
        self.device_seconds = Histogram(p + "device_seconds", "The job on the (simulated) device.")
        self.job_seconds = Histogram(p + "job_seconds", "Submit to result, in the worker.")
        self._runner: Any = None
        # Jobs are submitted on the socket thread and finish on each replica's device
        # thread: a read-modify-write of a sample from two threads could lose an update.
        self._lock = threading.Lock()

    def watch(self, runner: Any) -> None:
        """Report ``runner``'s monitoring statistics at every scrape."""
        self._runner = runner

    def submitted(self) -> None:
        with self._lock:
            self.in_flight.inc(model=self.model)

    def finished(
        self, outcome: str, seconds: float, queue_us: float = 0.0, device_us: float = 0.0
    ) -> None:
        with self._lock:
            self.in_flight.inc(-1.0, model=self.model)
            self.jobs.inc(model=self.model, outcome=outcome)
            self.job_seconds.observe(seconds)
            if outcome == "ok":
                self.queue_seconds.observe(queue_us / 1e6)
                self.device_seconds.observe(device_us / 1e6)

    def batch_closed(self, samples: int, waited_s: float) -> None:
        """A replica's batch is full, or its policy runs it partial (a runtime thread)."""
        with self._lock:
            self.batch_samples.observe(samples)
            self.batch_wait_seconds.observe(waited_s)

    def refused(self, model: str, outcome: str) -> None:
        """A job answered without running (refused, or expired while waiting). Another
        model's name is counted under "" so that made-up names add no labels."""
        with self._lock:
            self.jobs.inc(model=model if model == self.model else "", outcome=outcome)

    def render(self) -> str:
        with self._lock:  # one consistent snapshot of the job metrics
            jobs = super().render()
        return jobs + "".join(line + "\n" for line in self._runtime_lines())

    def _runtime_lines(self) -> Iterable[str]:
        """The runtime's statistics as families built at each scrape: each family's
        samples together, every replica's under its label."""
        runner = self._runner
        if runner is None:
            return
        p = "ipuserve_runtime_"
        counts = {
            key: Family(f"{p}{name}_total", help_) for key, (name, help_) in _RUNTIME_COUNTS.items()
        }
        mean = Family(f"{p}phase_mean_microseconds", "Mean time of a request phase.", "gauge")
        p99 = Family(f"{p}phase_p99_microseconds", "p99 time of a request phase.", "gauge")
        for replica in range(runner.config().replication_factor):
            labels = {"model": self.model, "replica": str(replica)}
            totals = runner.getMonitoringStatisticsTotalCount({}, replica_id=replica)
            for key, family in counts.items():
                family.set(totals.get(f"{key}_monitoring_statistics_count", 0.0), **labels)
            means = runner.getMonitoringStatisticsMean({}, replica_id=replica)
            p99s = runner.getMonitoringStatisticsPercentile({}, 0.99, replica_id=replica)
            for phase in _PHASES:
                if f"{phase}_monitoring_statistics_mean_us" in means:
                    mean.set(means[f"{phase}_monitoring_statistics_mean_us"], **labels, phase=phase)
                    p99.set(
                        p99s[f"{phase}_monitoring_statistics_percentile_us"], **labels, phase=phase
                    )
        for family in (*counts.values(), mean, p99):
            yield from family.render()


class CreditMetrics(Registry):
    """What a worker with several brokers holds against its one capacity
    (:class:`ipuserve.worker.credit.CreditPool`): an operator checks from these that
    the brokers' credits never add up to more than the worker can hold."""

    def __init__(self, capacity: int) -> None:
        p = "ipuserve_worker_"
        self.capacity = Family(
            p + "capacity", "Jobs the worker holds at most, all brokers together.", "gauge"
        )
        self.capacity.set(float(capacity))
        self.held = Family(
            p + "jobs_held", "Jobs held now (waiting or running), all brokers together.", "gauge"
        )
        self.held.set(0.0)
        self.held_max = Family(
            p + "jobs_held_max", "The most jobs held at once since the worker started.", "gauge"
        )
        self.held_max.set(0.0)
        self.broker_credit = Family(
            p + "broker_credit", "Credit announced to each broker connection.", "gauge"
        )

    def set_credit(self, broker: str, credit: int | None) -> None:
        """A connection's credit; None removes its sample (the broker is no longer served)."""
        if credit is None:
            self.broker_credit.samples.pop((("broker", broker),), None)
        else:
            self.broker_credit.set(float(credit), broker=broker)
