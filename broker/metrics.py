"""The broker's metrics (names and meanings); the machinery is :mod:`ipuserve.metrics`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ipuserve.metrics import Family, Histogram, MetricsServer, Registry

if TYPE_CHECKING:
    from ipuserve.security import ZapHandler

__all__ = ["BrokerMetrics", "MetricsServer"]


class BrokerMetrics(Registry):
    def __init__(self) -> None:
        p = "ipuserve_broker_"
        self.requests = Family(p + "requests_total", "Requests accepted, by model.")
        self.replies = Family(p + "replies_total", "Results delivered to clients, by model.")
        self.errors = Family(
            p + "errors_total",
            'Error replies sent to clients, by code and model (model="" if unreadable).',
        )
        self.dropped = Family(p + "dropped_total", "Messages dropped unanswered, by reason.")
        self.abandoned = Family(
            p + "abandoned_total",
            "Queued requests dropped because their client disconnected, by model.",
        )
        self.duplicates = Family(
            p + "duplicate_results_total", "Results for jobs already answered (late or duplicate)."
        )
        self.resent = Family(p + "resent_requests_total", "Re-sent requests still pending.")
        self.requeued = Family(p + "requeued_total", "Jobs re-queued after their worker left.")
        self.workers_lost = Family(p + "workers_lost_total", "Workers dropped, by reason.")
        self.workers = Family(p + "workers", "Registered workers.", "gauge")
        self.queued = Family(p + "queued", "Queued requests, by model.", "gauge")
        self.in_flight = Family(
            p + "in_flight", "Jobs held by workers (what their credit counts).", "gauge"
        )
        self.requests_in_flight = Family(
            p + "requests_in_flight",
            "Requests held by workers (a group job holds several).",
            "gauge",
        )
        # the model repository (docs/repository.md)
        self.repository_commands = Family(
            p + "repository_commands_total", "Repository commands answered, by action."
        )
        self.repository_refused = Family(
            p + "repository_refused_total",
            "Repository commands refused, by reason (PERMISSION_DENIED, NO_ROOM, "
            "UNKNOWN_MODEL, ...).",
        )
        self.loads_sent = Family(
            p + "loads_sent_total",
            "LOADs sent to repository workers, by why (command, replacement).",
        )
        self.hosts = Family(p + "hosts", "Repository workers reporting to this broker.", "gauge")
        # each counts requests: a group job observes its time once per request it holds
        self.queue_seconds = Histogram(p + "queue_seconds", "Admission to dispatch, per request.")
        self.worker_seconds = Histogram(p + "worker_seconds", "Dispatch to result, per request.")
        self.request_seconds = Histogram(p + "request_seconds", "Admission to reply, per request.")
        # CURVE (docs/security.md): copied from the ZAP handler's counters at each scrape
        self.refused_handshakes = Family(
            p + "refused_handshakes_total",
            "Peers refused at the CURVE handshake, by socket (frontend, backend): a key "
            "not in the socket's allow-lists, no CURVE, or a wrong broker key.",
        )
        self.refused_messages = Family(
            p + "refused_messages_total",
            "Messages refused on open connections, by socket (frontend, backend): their "
            "sender's key was removed from the allow-lists (and SIGHUP) after it connected.",
        )
        self.admitted_handshakes = Family(
            p + "admitted_handshakes_total", "Peers admitted at the CURVE handshake, by role."
        )
        self.allowed_keys = Family(
            p + "allowed_keys", "Public keys in the allow-lists in force, by role.", "gauge"
        )
        self._zap: ZapHandler | None = None

    def watch_security(self, zap: ZapHandler) -> None:
        """Report ``zap``'s counters (read at each scrape: its own thread keeps them)."""
        self._zap = zap

    def render(self) -> str:
        zap = self._zap
        if zap is not None:
            for domain, count in zap.refused_by_domain.items():
                self.refused_handshakes.set(count, socket=domain)
            for domain, count in zap.refused_messages_by_domain.items():
                self.refused_messages.set(count, socket=domain)
            for role, count in zap.admitted_by_role.items():
                self.admitted_handshakes.set(count, role=role)
            for role, count in zap.key_counts.items():
                self.allowed_keys.set(count, role=role)
        return super().render()
