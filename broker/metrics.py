"""The broker's metrics (names and meanings); the machinery is :mod:`ipuserve.metrics`.

Per model and version (:meth:`BrokerMetrics.of`): requests, replies, and the three
latency histograms, each observed once per request (a group job's requests share
their job's times). The children of one model version are looked up once and kept:
a ``labels()`` call costs ~0.8 µs, on every request otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import Counter, Metric
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ipuserve.metrics import Histogram, Metrics, MetricsServer

if TYPE_CHECKING:
    from ipuserve.security import ZapHandler

__all__ = ["BrokerMetrics", "MetricsServer", "ModelSeries"]


@dataclass(frozen=True, slots=True)
class ModelSeries:
    """One model version's children of the per-model families."""

    requests: Counter
    replies: Counter
    queue_seconds: Histogram
    worker_seconds: Histogram
    request_seconds: Histogram


class BrokerMetrics(Metrics):
    def __init__(self) -> None:
        super().__init__()
        p = "ipuserve_broker_"
        mv = ("model", "version")
        self.requests = self.counter(p + "requests_total", "Requests accepted, by model.", mv)
        self.replies = self.counter(
            p + "replies_total", "Results delivered to clients, by model.", mv
        )
        self.errors = self.counter(
            p + "errors_total",
            'Error replies sent to clients, by code and model (model="" if unreadable).',
            ("code", "model"),
        )
        self.dropped = self.counter(
            p + "dropped_total", "Messages dropped unanswered, by reason.", ("reason",)
        )
        self.abandoned = self.counter(
            p + "abandoned_total",
            "Queued requests dropped because their client disconnected, by model.",
            ("model",),
        )
        self.duplicates = self.counter(
            p + "duplicate_results_total", "Results for jobs already answered (late or duplicate)."
        )
        self.resent = self.counter(p + "resent_requests_total", "Re-sent requests still pending.")
        self.requeued = self.counter(
            p + "requeued_total", "Jobs re-queued after their worker left."
        )
        self.workers_lost = self.counter(
            p + "workers_lost_total",
            "Workers dropped without a goodbye, by reason (silent, unreachable, ...).",
            ("reason",),
        )
        self.departures = self.counter(
            p + "worker_departures_total",
            'Workers that left saying so, by reason ("bye": drained, then BYE).',
            ("reason",),
        )
        self.workers = self.gauge(p + "workers", "Registered workers.")
        self.queued = self.gauge(p + "queued", "Queued requests, by model version.", mv)
        self.in_flight = self.gauge(
            p + "in_flight", "Jobs held by workers (what their credit counts)."
        )
        self.requests_in_flight = self.gauge(
            p + "requests_in_flight", "Requests held by workers (a group job holds several)."
        )
        # the model repository (docs/repository.md)
        self.repository_commands = self.counter(
            p + "repository_commands_total", "Repository commands answered, by action.", ("action",)
        )
        self.repository_refused = self.counter(
            p + "repository_refused_total",
            "Repository commands refused, by reason (PERMISSION_DENIED, NO_ROOM, "
            "UNKNOWN_MODEL, ...).",
            ("reason",),
        )
        self.loads_sent = self.counter(
            p + "loads_sent_total",
            "LOADs sent to repository workers, by why (command, replacement).",
            ("why",),
        )
        self.hosts = self.gauge(p + "hosts", "Repository workers reporting to this broker.")
        # each counts requests: a group job observes its time once per request it holds
        self.queue_seconds = self.histogram(
            p + "queue_seconds", "Admission to dispatch, per request.", mv
        )
        self.worker_seconds = self.histogram(
            p + "worker_seconds", "Dispatch to result, per request.", mv
        )
        self.request_seconds = self.histogram(
            p + "request_seconds", "Admission to reply, per request.", mv
        )
        self._series: dict[tuple[str, str], ModelSeries] = {}

    def of(self, model: str, version: str = "1") -> ModelSeries:
        """``model`` ``version``'s series ("" for a request whose model is not known:
        any client may name any model, so only registered names get a series)."""
        key = (model, version)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = ModelSeries(
                self.requests.labels(model, version),
                self.replies.labels(model, version),
                self.queue_seconds.labels(model, version),
                self.worker_seconds.labels(model, version),
                self.request_seconds.labels(model, version),
            )
        return series

    def watch_security(self, zap: ZapHandler) -> None:
        """Report ``zap``'s counters, read at each scrape (its own thread keeps them)."""
        self.registry.register(_ZapCounts(zap))


class _ZapCounts(Collector):
    """CURVE (docs/security.md): the ZAP handler's counters, as families built at each
    scrape from what the handler counts."""

    def __init__(self, zap: ZapHandler) -> None:
        self._zap = zap

    def collect(self) -> Iterator[Metric]:
        p, zap = "ipuserve_broker_", self._zap
        refused = CounterMetricFamily(
            p + "refused_handshakes_total",
            "Peers refused at the CURVE handshake, by socket (frontend, backend): a key "
            "not in the socket's allow-lists, no CURVE, or a wrong broker key.",
            labels=("socket",),
        )
        for domain, count in zap.refused_by_domain.items():
            refused.add_metric((domain,), count)
        refused_messages = CounterMetricFamily(
            p + "refused_messages_total",
            "Messages refused on open connections, by socket (frontend, backend): their "
            "sender's key was removed from the allow-lists (and SIGHUP) after it connected.",
            labels=("socket",),
        )
        for domain, count in zap.refused_messages_by_domain.items():
            refused_messages.add_metric((domain,), count)
        admitted = CounterMetricFamily(
            p + "admitted_handshakes_total",
            "Peers admitted at the CURVE handshake, by role.",
            labels=("role",),
        )
        for role, count in zap.admitted_by_role.items():
            admitted.add_metric((role,), count)
        keys = GaugeMetricFamily(
            p + "allowed_keys",
            "Public keys in the allow-lists in force, by role.",
            labels=("role",),
        )
        for role, count in zap.key_counts.items():
            keys.add_metric((role,), count)
        yield from (refused, refused_messages, admitted, keys)
