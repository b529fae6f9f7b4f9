"""The broker's settings: one dataclass, filled by the CLI (or a test) at the edge."""

from __future__ import annotations

from dataclasses import dataclass

from ipuserve.errors import ConfigError
from ipuserve.protocol import DEFAULT_LIMITS


@dataclass(frozen=True, kw_only=True)
class BrokerConfig:
    """How the broker listens, balances and judges liveness.

    A worker silent for ``liveness_ms`` is dropped and its jobs re-queued; a job is
    tried on at most ``max_attempts`` workers that die holding it. For one
    ``grace_ms`` after start (default: one liveness window) requests for models
    nobody serves yet are queued, because workers may be reconnecting after a
    broker restart. Likewise a model whose last worker left waits ``orphan_ms`` for one
    to (re)join; after that its requests are refused at once (UNAVAILABLE) instead of
    each waiting out its timeout. ``queue_limit`` bounds each model's queue. Replies to a client
    first fill its ZeroMQ pipe (``client_hwm`` messages), then wait in a broker-side
    backlog (``client_backlog`` messages, retried in order); a client that stopped
    reading loses the replies beyond both (counted), and nobody else waits for it.

    ``curve_secret_key`` (the broker's ``.key_secret``) with the allow-list
    directories ``client_keys`` and ``worker_keys`` (and optionally ``admin_keys``)
    puts both sockets under CURVE: only peers whose public key is in the list of a
    role the socket admits complete a handshake (docs/security.md). Without them the
    broker is plaintext and in protected mode: its ZAP handler admits only peers on
    this host (loopback, ipc://), so a keyless broker bound to ``tcp://*`` on a public
    host does not hand its workers' tensors to anyone who reaches the port.
    ``insecure`` (keyless only) admits every address instead. ``metrics_host`` is
    loopback by default for the same reason: the metrics endpoint is plain HTTP.
    """

    frontend: str = "tcp://*:5555"
    backend: str = "tcp://*:5556"
    heartbeat_ms: int = 1000
    liveness_ms: int = 3000
    grace_ms: int | None = None
    orphan_ms: int = 30_000
    queue_limit: int = 1000
    max_attempts: int = 3
    max_payload_bytes: int = DEFAULT_LIMITS.max_payload_bytes
    client_hwm: int = 1000
    client_backlog: int = 1000
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    shutdown_linger_ms: int = 100
    curve_secret_key: str | None = None
    client_keys: str | None = None
    worker_keys: str | None = None
    admin_keys: str | None = None
    insecure: bool = False

    def __post_init__(self) -> None:
        for name in (
            "heartbeat_ms",
            "liveness_ms",
            "queue_limit",
            "max_attempts",
            "client_hwm",
            "client_backlog",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        random_port = self.frontend.endswith((":*", ":0"))  # two different ports then
        if self.frontend == self.backend and not random_port:
            raise ConfigError(
                f"frontend and backend must differ (both {self.frontend}): clients and "
                "workers each need a port of their own"
            )
        if self.liveness_ms < self.heartbeat_ms:
            raise ConfigError("liveness_ms must be at least heartbeat_ms")
        if self.orphan_ms < 0:
            raise ConfigError(f"orphan_ms must be >= 0, got {self.orphan_ms}")
        if self.grace_ms is not None and self.grace_ms < 0:
            raise ConfigError(f"grace_ms must be >= 0, got {self.grace_ms}")
        if self.max_payload_bytes < 1:
            raise ConfigError(f"max_payload_bytes must be >= 1, got {self.max_payload_bytes}")
        self._check_keys()

    def _check_keys(self) -> None:
        """Keys are all or nothing: a broker given some of them and not others would
        otherwise start plaintext (or refuse every peer of a role) without saying so."""
        dirs = {"client_keys": self.client_keys, "worker_keys": self.worker_keys}
        given = [name for name, value in dirs.items() if value is not None]
        if self.admin_keys is not None:
            given.append("admin_keys")
        if self.curve_secret_key is not None and self.insecure:
            raise ConfigError(
                "insecure and curve_secret_key exclude each other: insecure opens a broker "
                "without keys to every address; one with keys admits peers by key"
            )
        if self.curve_secret_key is None:
            if given:
                raise ConfigError(
                    f"{' and '.join(given)} need curve_secret_key too: the allow-lists "
                    "apply to a broker with keys (CURVE)"
                )
            return
        missing = [name for name, value in dirs.items() if value is None]
        if missing:
            raise ConfigError(
                f"curve_secret_key needs {' and '.join(missing)} too: a broker with keys "
                "admits clients and workers by the allow-list of each role"
            )

    @property
    def curve(self) -> bool:
        """Whether the sockets are under CURVE (keys given)."""
        return self.curve_secret_key is not None

    @property
    def startup_grace_s(self) -> float:
        return (self.liveness_ms if self.grace_ms is None else self.grace_ms) / 1000
