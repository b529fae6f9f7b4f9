"""One gateway process: the HTTP and gRPC doors in one asyncio loop over one
:class:`~ipuserve.client.AsyncClient`, until SIGTERM or SIGINT.

Before anything binds, :func:`check_binding` applies the front door's rule: without
TLS, only loopback addresses unless ``insecure`` (as the broker's protected mode admits
only peers on its host); :func:`check_descriptors` lifts the descriptor limit and
warns when the connection caps do not fit in it. The start-up line names the bound
addresses (with the ports got for port 0), the brokers and the security in force.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import signal
import ssl
from collections.abc import Callable
from typing import Any

from ipuserve.client import AsyncClient
from ipuserve.errors import ConfigError
from ipuserve.gateway.accept_guard import RESERVED_DESCRIPTORS, raise_descriptor_limit
from ipuserve.gateway.auth import Tokens
from ipuserve.gateway.config import GatewayConfig, split_address
from ipuserve.gateway.http_server import HttpServer, start_http
from ipuserve.gateway.metrics import GatewayMetrics
from ipuserve.gateway.service import InferenceService

log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name other hosts may resolve to this one: not loopback


def check_binding(config: GatewayConfig) -> None:
    """Refuse a non-loopback address without TLS unless ``config.insecure``."""
    if config.tls or config.insecure:
        return
    for door, address in (("--http", config.http), ("--grpc", config.grpc)):
        if address is None:
            continue
        host, _ = split_address(address)
        if not is_loopback(host):
            raise ConfigError(
                f"{door} {address} is reachable from other hosts, and without TLS anyone "
                "on the network could read and send requests: serve TLS (--tls-cert and "
                "--tls-key), bind a loopback address, or pass --insecure for a network you "
                "trust completely (protected mode, as the broker's; docs/security.md)"
            )


def validate(config: GatewayConfig) -> Tokens:
    """Everything about ``config`` that can be wrong before a socket is bound: the bind
    rule, the TLS files, the token files (:class:`ConfigError`, with the message the
    gateway fails with). The supervisor of several processes calls it once, so a bad
    option fails once rather than in every process."""
    check_binding(config)
    ssl_context(config)
    return Tokens.from_files(infer=config.infer_tokens, admin=config.admin_tokens)


def ssl_context(config: GatewayConfig) -> ssl.SSLContext | None:
    if not config.tls:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(str(config.tls_cert), str(config.tls_key))
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load the TLS certificate or key: {exc}") from exc
    return context


def security_line(config: GatewayConfig, tokens: Tokens) -> str:
    transport = (
        "TLS"
        if config.tls
        else ("INSECURE plaintext" if config.insecure else "plaintext, loopback only")
    )
    return f"security {transport}, {tokens.describe()}"


def check_descriptors(config: GatewayConfig) -> None:
    """Lift the descriptor limit to the hard one, and warn when even that is below what
    the connection caps admit (each connection a descriptor, on each door): past it new
    connections wait in the kernel's backlog (gateway/accept_guard.py) rather than
    being answered over the cap."""
    limit = raise_descriptor_limit()
    doors = 1 if config.grpc is None else 2
    needed = doors * config.max_connections + RESERVED_DESCRIPTORS
    if limit < needed:
        log.warning(
            "the descriptor limit (%d, ulimit -n) is below what --max-connections %d "
            "admits on %d door(s) (%d with the gateway's own): raise the limit, or lower "
            "--max-connections to %d",
            limit,
            config.max_connections,
            doors,
            needed,
            max(1, (limit - RESERVED_DESCRIPTORS) // doors),
        )


class Gateway:
    """The running doors; :meth:`stop` closes them and the client."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        # prometheus-client chose where its values live when it was imported: in a
        # fresh gateway process, with the environment it started with (a supervisor's
        # children get PROMETHEUS_MULTIPROC_DIR there); gateway/metrics.py says why
        self.metrics = GatewayMetrics()
        self.tokens = Tokens.from_files(
            infer=config.infer_tokens,
            admin=config.admin_tokens,
            refusals=self.metrics.token_refusals,
        )
        self.client = AsyncClient(
            list(config.brokers),
            timeout=config.request_timeout_s,
            curve_secret_key=config.curve_secret_key,
            broker_public_key=config.broker_public_key,
        )
        self.service = InferenceService(self.client, metrics=self.metrics)
        self.http: HttpServer | None = None
        self.grpc: Any = None
        self.grpc_address: str | None = None

    async def start(self) -> None:
        config = self.config
        self.service.start()
        host, port = split_address(config.http)
        self.http = await start_http(
            self.service, host, port, config, self.tokens, ssl_context(config)
        )
        if config.grpc is not None:
            from ipuserve.gateway.grpc_server import start_grpc_bound  # grpcio only if used

            self.grpc, self.grpc_address = await start_grpc_bound(
                self.service, config.grpc, config, self.tokens
            )

    def start_line(self) -> str:
        assert self.http is not None
        host, _ = split_address(self.config.http)
        host = f"[{host}]" if ":" in host else host  # an IPv6 address, as a URL has it
        scheme = "https" if self.config.tls else "http"
        grpc = self.grpc_address or "off"
        return (
            f"ipuserve gateway: http {scheme}://{host}:{self.http.port}, grpc {grpc}, "
            f"brokers {', '.join(self.config.brokers)}, {security_line(self.config, self.tokens)}"
        )

    async def stop(self) -> None:
        if self.tokens.refused:
            log.info("refused %d calls without a valid token", self.tokens.refused)
        # both doors at once: each stops accepting, then waits (up to 5 s) for the
        # requests under way, which the client (closed last) is still carrying
        doors = [] if self.http is None else [self.http.stop()]
        if self.grpc is not None:
            doors.append(self.grpc.stop(5.0))
        await asyncio.gather(*doors)
        await self.service.stop()
        await self.client.aclose()


def _stop_at_eof(loop: asyncio.AbstractEventLoop, fd: int, stop: asyncio.Event) -> None:
    """Set ``stop`` once ``fd`` (a pipe) reaches its end: its writer is gone."""

    def readable() -> None:
        try:
            more = os.read(fd, 4096)
        except OSError:
            more = b""
        if not more:
            loop.remove_reader(fd)
            log.info("the supervisor is gone: stopping")
            stop.set()

    loop.add_reader(fd, readable)


async def serve(
    config: GatewayConfig, announce: Callable[[str], None], *, parent_pipe: int | None = None
) -> None:
    """Run a gateway until SIGTERM or SIGINT; ``announce`` gets the start-up line.

    ``parent_pipe``, a supervisor's child's: a pipe whose other end the supervisor holds
    and never writes; its end of file (the supervisor died, even by SIGKILL, which it
    cannot forward) stops this process as SIGTERM would, so no gateway outlives it.
    """
    check_binding(config)
    check_descriptors(config)
    gateway = Gateway(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    if parent_pipe is not None:
        _stop_at_eof(loop, parent_pipe, stop)
    try:
        await gateway.start()
        announce(gateway.start_line())
        await stop.wait()
        log.info("stopping: closing the doors, then the client")
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(signum)
        if parent_pipe is not None:
            loop.remove_reader(parent_pipe)
        await gateway.stop()
