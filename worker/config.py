"""The worker node's settings: one dataclass, filled by the CLI (or a test) at the edge."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

from ipuserve.errors import ConfigError
from ipuserve.protocol import DEFAULT_LIMITS
from ipuserve.security import ClientKeys


def default_worker_id() -> str:
    """hostname:pid, unique enough on one broker and readable in `ipuserve models`."""
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """How a worker talks to its broker.

    ``heartbeat_ms`` is the longest gap between the worker's heartbeats (the broker's
    WELCOME may ask for a shorter one); the broker's WELCOME also sets how long the
    broker may stay silent (its liveness window) before the worker reconnects.
    ``handshake_timeout_ms`` bounds the wait for WELCOME after a HELLO; reconnects
    back off exponentially from ``reconnect_min_ms`` to ``reconnect_max_ms``.
    On SIGTERM the worker finishes what it holds for at most ``drain_timeout_ms``.
    ``keys`` (its pair and the broker's public key, loaded at start) make every
    connection CURVE, for a broker with keys; None is plaintext.
    """

    broker: str
    worker_id: str = field(default_factory=default_worker_id)
    credit: int | None = None
    heartbeat_ms: float = 1000.0
    handshake_timeout_ms: float = 3000.0
    reconnect_min_ms: float = 100.0
    reconnect_max_ms: float = 5000.0
    drain_timeout_ms: float = 10_000.0
    bye_linger_ms: int = 1000
    max_payload_bytes: int = DEFAULT_LIMITS.max_payload_bytes
    keys: ClientKeys | None = None

    def __post_init__(self) -> None:
        if self.credit is not None and self.credit < 1:
            raise ConfigError(f"credit must be >= 1, got {self.credit}")
        for name in ("heartbeat_ms", "handshake_timeout_ms", "reconnect_min_ms"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.reconnect_max_ms < self.reconnect_min_ms:
            raise ConfigError("reconnect_max_ms must be >= reconnect_min_ms")
        if self.drain_timeout_ms < 0:
            raise ConfigError(f"drain_timeout_ms must be >= 0, got {self.drain_timeout_ms}")
