"""``ipuserve gateway``: the Open Inference Protocol front door (mounted by
ipuserve.face.cli). Every option has its ``IPUSERVE_GATEWAY_*`` variable."""

from __future__ import annotations

import asyncio
from pathlib import Path

import click

from ipuserve.clikit import Endpoint, TimeoutSeconds, fail, option
from ipuserve.errors import ConfigError
from ipuserve.gateway.app import serve, split_address
from ipuserve.gateway.config import (
    DEFAULT_GRPC,
    DEFAULT_HTTP,
    DEFAULT_MAX_BODY_BYTES,
    GatewayConfig,
)
from ipuserve.security.cli import curve_client_options, keys_from_options

_FILE = click.Path(dir_okay=False, exists=True, path_type=Path)


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
    help="File of bearer tokens (one a line, # comments) that may call metadata, infer and "
    "statistics [default: no token needed].",
)
@option(
    "--admin-tokens",
    type=_FILE,
    help="File of admin bearer tokens (they may also do what infer tokens may).",
)
@option(
    "--max-body-bytes",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_BODY_BYTES,
    help="Largest HTTP request body / gRPC message (413 / RESOURCE_EXHAUSTED beyond).",
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
    help="Open HTTP connections at most; more are answered 503 and closed.",
)
@option(
    "--timeout-s",
    type=TimeoutSeconds(),
    default=30.0,
    help="A request's timeout when it gives none (parameters.timeout / gRPC deadline).",
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
    header_timeout_s: float,
    body_timeout_s: float,
    max_connections: int,
    timeout_s: float,
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
        header_timeout_s=header_timeout_s,
        body_timeout_s=body_timeout_s,
        max_connections=max_connections,
        request_timeout_s=timeout_s,
        curve_secret_key=curve_secret_key,
        broker_public_key=broker_public_key,
    )
    try:
        asyncio.run(serve(config, lambda line: click.echo(line, err=True)))
    except ConfigError as exc:
        fail(str(exc))
    except OSError as exc:  # the address is taken, or not this host's
        fail(f"cannot serve: {exc}")


commands: list[click.Command] = [gateway]
