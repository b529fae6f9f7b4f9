"""A client's tuning (:class:`ClientConfig`) and its counters (:class:`ClientStats`).

Apart from the I/O loop so that callers, the bench and the tests can name them
without the core's machinery (:mod:`ipuserve.client.core`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ipuserve.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class ClientConfig:
    """Tuning of one client; the defaults suit a broker on the same network."""

    ping_interval_s: float = 1.0
    liveness_s: float = 3.0
    reconnect_max_s: float = 2.0
    send_hwm: int = 100_000
    recv_batch: int = 256
    #: requests with bigger payloads are never batched (they gain nothing from it)
    batch_payload_bytes: int = 64 << 10
    #: a batch leaves once it holds this many requests, without waiting for the turn
    #: to end: the next stage starts on it while this one prepares the rest
    batch_requests: int = 32
    routing_id: bytes | None = None
    #: past a request's timeout, how long a client whose broker answers waits for the
    #: broker's own DEADLINE_EXCEEDED, which says where the request waited (queue or
    #: worker, and whether any worker serves the model), before failing it itself
    deadline_grace_s: float = 0.05

    def __post_init__(self) -> None:
        if not 0 < self.ping_interval_s < self.liveness_s:
            raise ConfigError(
                f"need 0 < ping_interval_s ({self.ping_interval_s}) < liveness_s "
                f"({self.liveness_s}): a broker is only silent if it was asked"
            )
        # ZeroMQ would say only "Invalid argument", and recv_batch 0 never reads
        for name in ("send_hwm", "recv_batch", "batch_requests"):
            if getattr(self, name) < 1:
                raise ConfigError(f"ClientConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("reconnect_max_s", "batch_payload_bytes", "deadline_grace_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"ClientConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.routing_id is not None and not (
            isinstance(self.routing_id, bytes)
            and 0 < len(self.routing_id) <= 255
            and self.routing_id[0] != 0
        ):
            raise ConfigError(
                "ClientConfig.routing_id must be 1 to 255 bytes not starting with a zero "
                "byte (ZeroMQ reserves those), got "
                f"{self.routing_id!r:.80}"
            )


@dataclass
class ClientStats:
    """Counters kept under the client's work lock, by its I/O thread or a caller
    sending on the socket (read them from anywhere; they only grow)."""

    sent: int = 0
    #: of those, sent from the caller's own thread (the socket was idle: no hand-off)
    direct: int = 0
    #: of those, sent inside REQUESTS messages (several requests per message)
    batched: int = 0
    #: of those, sent as members of groups (one job for several requests)
    grouped: int = 0
    #: the groups those formed (each one job, as the broker carries it unchanged)
    groups: int = 0
    resent: int = 0
    #: of those, requests moved to another broker's link when theirs failed (a client
    #: with several brokers; ipuserve.client.core)
    failovers: int = 0
    #: requests a broker answered UNKNOWN_MODEL, sent to another broker (several brokers)
    unknown_model_retries: int = 0
    #: requests a stopping broker let go of, kept pending for the broker after it
    held_over_shutdown: int = 0
    replies: int = 0
    dropped_replies: int = 0
    malformed: int = 0
    expired: int = 0
    epoch_changes: int = 0
    #: connections to the broker made again after the first (a blip, a restart)
    reconnects: int = 0
    epoch: str | None = None
    #: the broker's payload limit, from its PONG (None until the first)
    max_payload_bytes: int | None = None
