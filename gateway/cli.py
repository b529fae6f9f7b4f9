"""``ipuserve gateway``: the Open Inference Protocol front door (mounted by
ipuserve.face.cli). Every option has its ``IPUSERVE_GATEWAY_*`` variable."""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

import click

from ipuserve.clikit import Endpoint, TimeoutSeconds, fail, option
from ipuserve.errors import ConfigError
from ipuserve.gateway.app import serve, validate
from ipuserve.gateway.config import (
    DEFAULT_GRPC,
    DEFAULT_HTTP,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_JSON_BYTES,
    DEFAULT_MAX_PER_PEER,
    GatewayConfig,
    split_address,
)
from ipuserve.gateway.supervisor import Supervisor
from ipuserve.limits import MAX_DURATION_MS
from ipuserve.security.cli import curve_client_options, keys_from_options

_FILE = click.Path(dir_okay=False, exists=True, path_type=Path)


class _OffOrSeconds(click.FloatRange):
    """Finite seconds >= 0, 0 meaning off."""

    def __init__(self) -> None:
        super().__init__(min=0, max=MAX_DURATION_MS / 1e3)

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        seconds: float = super().convert(value, param, ctx)
        if not math.isfinite(seconds):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        return seconds


_OFF_OR_SECONDS = _OffOrSeconds()


def _address(_ctx: object, _param: object, value: str | None) -> str | None:
    if value is None or value.strip().lower() in ("", "off"):
        return None
    try:
        split_address(value)
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from None
    return value


@click.command()
@option(
    "--broker",
    required=True,
    multiple=True,
    type=Endpoint(),
    help="A broker's frontend endpoint; repeat for several (in the variable: "
    "space-separated). A name that resolves to several addresses reaches each.",
)
@option("--http", default=DEFAULT_HTTP, callback=_address, help="HOST:PORT of the HTTP door.")
@option(
    "--grpc",
    default=DEFAULT_GRPC,
    callback=_address,
    help="HOST:PORT of the gRPC door; 'off' (or empty) serves HTTP only.",
)
@option("--tls-cert", type=_FILE, help="PEM certificate (chain): serve HTTPS and gRPC over TLS.")
@option("--tls-key", type=_FILE, help="PEM private key of --tls-cert.")
@option(
    "--insecure",
    is_flag=True,
    help="Without TLS, bind addresses other hosts can reach (plaintext on the network): for "
    "a network you trust completely; prefer --tls-cert/--tls-key.",
)
@option(
    "--infer-tokens",
    type=_FILE,
    help="File of bearer tokens (one a line, # comments) that may call metadata, infer, "
    "statistics and /metrics. Once any token file is given, a role with no tokens is "
    "closed (403); with none, inference is open and repository calls are loopback-only.",
)
@option(
    "--admin-tokens",
    type=_FILE,
    help="File of admin bearer tokens: the model repository's index, load and unload "
    "(they may also do what infer tokens may).",
)
@option(
    "--max-body-bytes",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_BODY_BYTES,
    help="Largest HTTP request body / gRPC message (413 / RESOURCE_EXHAUSTED beyond).",
)
@option(
    "--max-json-bytes",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_JSON_BYTES,
    help="Largest JSON an HTTP request may carry: a whole JSON body, or a binary-data "
    "body's JSON header (413 beyond; large tensors travel as binary data).",
)
@option(
    "--header-timeout-s",
    type=TimeoutSeconds(),
    default=10.0,
    help="Close an HTTP connection that sent no complete request headers for this long.",
)
@option(
    "--body-timeout-s",
    type=TimeoutSeconds(),
    default=30.0,
    help="Answer 408 and close when a request body takes longer than this to arrive.",
)
@option(
    "--max-connections",
    type=click.IntRange(min=1),
    default=1024,
    help="Open connections at most, per door; more are closed (HTTP: answered 503).",
)
@option(
    "--max-connections-per-peer",
    type=click.IntRange(min=0),
    default=DEFAULT_MAX_PER_PEER,
    help="Open HTTP connections from one address (IPv4; IPv6 /64) at most; more are "
    "answered 429 and closed. 0: no cap (behind a proxy or load balancer, whose address "
    "every client has).",
)
@option(
    "--write-timeout-s",
    type=TimeoutSeconds(),
    default=30.0,
    help="Abort an HTTP connection whose answer goes unread this long (its write buffer "
    "full throughout), a gRPC one that answers no keepalive ping in this long.",
)
@option(
    "--grpc-idle-timeout-s",
    type=_OFF_OR_SECONDS,
    default=60.0,
    help="Close a gRPC connection with no call for this long (GOAWAY: clients reconnect "
    "when they call again); 0: never.",
)
@option(
    "--grpc-max-streams",
    type=click.IntRange(min=1),
    default=1000,
    help="Concurrent calls on one gRPC connection (HTTP/2 streams): grpcio refuses more "
    "(UNAVAILABLE), counting calls the gateway has not finished answering.",
)
@option(
    "--grpc-max-connection-age-s",
    type=_OFF_OR_SECONDS,
    default=3600.0,
    help="Close a gRPC connection this old (GOAWAY; calls under way get --timeout-s to "
    "finish); 0: never.",
)
@option(
    "--timeout-s",
    type=TimeoutSeconds(),
    default=30.0,
    help="A request's timeout when it gives none (parameters.timeout / gRPC deadline).",
)
@option(
    "--processes",
    type=click.IntRange(min=1),
    default=1,
    help="Gateway processes sharing the doors' ports (SO_REUSEPORT; the kernel spreads "
    "connections, not requests, over them); above 1, this process supervises them and "
    'restarts one that dies (docs/gateway.md, "Several processes").',
)
@option(
    "--supervised",
    is_flag=True,
    hidden=True,
    help="Set by --processes for its children only: bind with SO_REUSEPORT, print the "
    "start line (or why it could not start) on stdout, stop at the end of stdin.",
)
@curve_client_options
def gateway(
    broker: tuple[str, ...],
    http: str | None,
    grpc: str | None,
    tls_cert: Path | None,
    tls_key: Path | None,
    insecure: bool,
    infer_tokens: Path | None,
    admin_tokens: Path | None,
    max_body_bytes: int,
    max_json_bytes: int,
    header_timeout_s: float,
    body_timeout_s: float,
    max_connections: int,
    max_connections_per_peer: int,
    write_timeout_s: float,
    grpc_idle_timeout_s: float,
    grpc_max_streams: int,
    grpc_max_connection_age_s: float,
    timeout_s: float,
    processes: int,
    supervised: bool,
    curve_secret_key: Path | None,
    broker_public_key: Path | None,
) -> None:
    """Serve the Open Inference Protocol (KServe v2) over HTTP and gRPC in front of the
    brokers (docs/gateway.md): curl, tritonclient and any language's client work."""
    if http is None:
        raise click.BadParameter("the HTTP door cannot be off", param_hint="--http")
    if (tls_cert is None) != (tls_key is None):
        raise click.UsageError("--tls-cert and --tls-key go together")
    keys_from_options(curve_secret_key, broker_public_key)  # one without the other: usage
    config = GatewayConfig(
        brokers=broker,
        http=http,
        grpc=grpc,
        tls_cert=tls_cert,
        tls_key=tls_key,
        insecure=insecure,
        infer_tokens=infer_tokens,
        admin_tokens=admin_tokens,
        max_body_bytes=max_body_bytes,
        max_json_bytes=max_json_bytes,
        header_timeout_s=header_timeout_s,
        body_timeout_s=body_timeout_s,
        max_connections=max_connections,
        max_connections_per_peer=max_connections_per_peer,
        write_timeout_s=write_timeout_s,
        grpc_idle_timeout_s=grpc_idle_timeout_s,
        grpc_max_streams=grpc_max_streams,
        grpc_max_connection_age_s=grpc_max_connection_age_s,
        request_timeout_s=timeout_s,
        curve_secret_key=curve_secret_key,
        broker_public_key=broker_public_key,
        reuse_port=supervised,
    )
    if supervised:
        _serve_supervised(config)
    try:
        if processes > 1:
            validate(config)
            Supervisor(config, processes, child_argv, _to_stderr).run()
        else:
            asyncio.run(serve(config, _to_stderr))
    except ConfigError as exc:
        fail(str(exc))
    except OSError as exc:  # the address is taken, or not this host's
        fail(f"cannot serve: {exc}")


def _to_stderr(line: str) -> None:
    click.echo(line, err=True)


def _serve_supervised(config: GatewayConfig) -> NoReturn:
    """Serve as one of a supervisor's children: the start line, or the one line that
    says why there is none, goes to the supervisor on stdout; exit 1 after the latter.
    Its log records name it by its pid (the supervisor's log says which process that
    is), not all "MainProcess"."""
    multiprocessing.current_process().name = f"gateway-{os.getpid()}"
    try:
        asyncio.run(serve(config, _to_stdout, parent_pipe=sys.stdin.fileno()))
    except ConfigError as exc:
        _to_stdout(str(exc))
        sys.exit(1)
    except OSError as exc:
        _to_stdout(f"cannot serve: {exc}")
        sys.exit(1)
    sys.exit(0)


def _to_stdout(line: str) -> None:
    click.echo(line)
    sys.stdout.flush()


def child_argv(config: GatewayConfig) -> list[str]:
    """The command line of a supervisor's child serving ``config`` (its ports concrete):
    every option spelled out, so the variables the supervisor read cannot differ in the
    child (which inherits them) from what it was told."""
    level = logging.getLevelName(logging.getLogger("ipuserve").getEffectiveLevel())
    argv = [sys.executable, "-m", "ipuserve", "--log-level", level, "gateway"]
    for endpoint in config.brokers:
        argv += ["--broker", endpoint]
    argv += ["--http", config.http, "--grpc", config.grpc or "off"]
    paths = {
        "--tls-cert": config.tls_cert,
        "--tls-key": config.tls_key,
        "--infer-tokens": config.infer_tokens,
        "--admin-tokens": config.admin_tokens,
        "--curve-secret-key": config.curve_secret_key,
        "--broker-public-key": config.broker_public_key,
    }
    for flag, path in paths.items():
        if path is not None:
            argv += [flag, str(path)]
    if config.insecure:
        argv.append("--insecure")
    return [
        *argv,
        "--max-body-bytes", str(config.max_body_bytes),
        "--max-json-bytes", str(config.max_json_bytes),
        "--header-timeout-s", repr(config.header_timeout_s),
        "--body-timeout-s", repr(config.body_timeout_s),
        "--max-connections", str(config.max_connections),
        "--max-connections-per-peer", str(config.max_connections_per_peer),
        "--write-timeout-s", repr(config.write_timeout_s),
        "--grpc-idle-timeout-s", repr(config.grpc_idle_timeout_s),
        "--grpc-max-streams", str(config.grpc_max_streams),
        "--grpc-max-connection-age-s", repr(config.grpc_max_connection_age_s),
        "--timeout-s", repr(config.request_timeout_s),
        "--processes", "1",
        "--supervised",
    ]  # fmt: skip


commands: list[click.Command] = [gateway]
