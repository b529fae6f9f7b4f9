"""The gateway's settings, as one frozen dataclass the CLI (or a test) builds."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ipuserve.errors import ConfigError

DEFAULT_HTTP = "127.0.0.1:8000"
DEFAULT_GRPC = "127.0.0.1:8001"
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
#: JSON costs more to hold and parse than the tensors it spells: large tensors travel
#: as binary data (docs/gateway.md, "Request bodies")
DEFAULT_MAX_JSON_BYTES = 16 * 1024 * 1024
#: a quarter of the default connection cap: one address cannot take the rest's slots
DEFAULT_MAX_PER_PEER = 256
#: the variable of prometheus-client's multiprocess mode (the library's name, not ours):
#: the supervisor sets it for its children, gateway/metrics.py reads it; here because
#: the supervisor must not import prometheus-client, which decides its mode on import
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


@dataclass(frozen=True, kw_only=True)
class GatewayConfig:
    """What one gateway serves and how it guards it (docs/gateway.md, docs/security.md).

    ``grpc`` None disables the gRPC door. Without ``tls_cert``/``tls_key`` the doors bind
    loopback addresses only unless ``insecure``.
    """

    brokers: tuple[str, ...]
    http: str = DEFAULT_HTTP
    grpc: str | None = DEFAULT_GRPC
    tls_cert: Path | None = None
    tls_key: Path | None = None
    insecure: bool = False
    infer_tokens: Path | None = None
    admin_tokens: Path | None = None
    #: largest request body (HTTP) or message (gRPC) accepted
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    #: largest JSON an HTTP request may carry: a whole JSON body, or the JSON header of
    #: a binary-extension body
    max_json_bytes: int = DEFAULT_MAX_JSON_BYTES
    #: a client must send a request's headers within this long of connecting (or of
    #: its previous request on a kept-alive connection)
    header_timeout_s: float = 10.0
    #: ... and its body within this long of its headers
    body_timeout_s: float = 30.0
    #: open connections at once, per door; more are refused (HTTP: 503) and closed
    max_connections: int = 1024
    #: open HTTP connections from one address (IPv4, IPv6 /64) at once; more are answered
    #: 429 and closed; 0: no cap (behind a proxy every client has the proxy's address)
    max_connections_per_peer: int = DEFAULT_MAX_PER_PEER
    #: an HTTP answer the client does not read for this long (the write buffer above its
    #: high-water mark throughout) aborts the connection; gRPC: a keepalive ping unanswered
    write_timeout_s: float = 30.0
    #: a gRPC connection with no call for this long is closed (GOAWAY); 0: never
    grpc_idle_timeout_s: float = 60.0
    #: concurrent calls (HTTP/2 streams) on one gRPC connection
    grpc_max_streams: int = 1000
    #: a gRPC connection is closed (GOAWAY, calls under way get ``request_timeout_s``
    #: more) after this long, however busy; 0: never
    grpc_max_connection_age_s: float = 3600.0
    #: a request with no timeout of its own gets this one
    request_timeout_s: float = 30.0
    curve_secret_key: Path | None = None
    broker_public_key: Path | None = None
    #: bind both doors with SO_REUSEPORT, sharing their ports with the other processes
    #: of a supervisor (gateway/supervisor.py); off, a taken port fails to bind
    reuse_port: bool = False

    @property
    def json_limit(self) -> int:
        """The JSON limit in force: ``max_json_bytes``, never over the body limit."""
        return min(self.max_json_bytes, self.max_body_bytes)

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None and self.tls_key is not None


def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:8000`` for IPv6) as (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"address {address!r} is not HOST:PORT (e.g. 127.0.0.1:8000)")
    return host.removeprefix("[").removesuffix("]"), int(port)
