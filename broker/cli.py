"""Click commands owned by ipuserve.broker (mounted by ipuserve.face.cli)."""

from __future__ import annotations

import dataclasses
import logging
import re
import signal
from typing import TYPE_CHECKING

import click

from ipuserve.clikit import Endpoint, option
from ipuserve.errors import ConfigError
from ipuserve.protocol import DEFAULT_LIMITS

if TYPE_CHECKING:
    from ipuserve.broker.config import BrokerConfig

log = logging.getLogger(__name__)


def _as_options(message: str) -> str:
    """A BrokerConfig message in the CLI's words: each field named as the option that
    sets it (liveness_ms -> --liveness-ms)."""
    from ipuserve.broker.config import BrokerConfig

    names = (f.name for f in dataclasses.fields(BrokerConfig))
    for name in sorted(names, key=len, reverse=True):  # max_attempts before attempts
        message = re.sub(rf"\b{name}\b", "--" + name.replace("_", "-"), message)
    return message


@click.command("broker")
@option(
    "--frontend",
    default="tcp://*:5555",
    type=Endpoint(bind=True),
    help="Endpoint clients connect to.",
)
@option(
    "--backend",
    default="tcp://*:5556",
    type=Endpoint(bind=True, port=5556),
    help="Endpoint workers connect to.",
)
@option(
    "--heartbeat-ms",
    default=1000,
    type=click.IntRange(min=1),
    help="Interval of the broker's heartbeats to workers (sent to them in WELCOME).",
)
@option(
    "--liveness-ms",
    default=3000,
    type=click.IntRange(min=1),
    help="A worker silent this long is dropped and its requests re-queued.",
)
@option(
    "--grace-ms",
    default=None,
    type=click.IntRange(min=0),
    help="After start, queue requests for models nobody serves yet for this long "
    "[default: --liveness-ms].",
)
@option(
    "--orphan-ms",
    default=30_000,
    type=click.IntRange(min=0),
    help="A model whose last worker left waits this long for one to join; then its "
    "requests get UNAVAILABLE at once.",
)
@option(
    "--queue-limit",
    default=1000,
    type=click.IntRange(min=1),
    help="Queued requests per model before OVERLOADED.",
)
@option(
    "--max-attempts",
    default=3,
    type=click.IntRange(min=1),
    help="Workers that may die holding one request before WORKER_FAILED.",
)
@option(
    "--max-payload-bytes",
    default=DEFAULT_LIMITS.max_payload_bytes,
    type=click.IntRange(min=1),
    help="Largest total tensor payload of one message.",
)
@option(
    "--client-hwm",
    default=1000,
    type=click.IntRange(min=1),
    help="Replies ZeroMQ queues for one client (its pipe's high-water mark).",
)
@option(
    "--client-backlog",
    default=1000,
    type=click.IntRange(min=1),
    help="Further replies the broker keeps for a slow client before dropping them.",
)
@option(
    "--metrics-port",
    default=None,
    type=click.IntRange(min=0, max=65535),
    help="Serve Prometheus metrics over HTTP on this port (0: any free port), with the "
    "/healthz and /ready probes.",
)
@option(
    "--metrics-host",
    default="127.0.0.1",
    help="Address the metrics endpoint binds: loopback by default, as it is plain HTTP "
    "without authentication; 0.0.0.0 exposes it (docs/security.md).",
)
@option(
    "--curve-secret-key",
    default=None,
    type=click.Path(dir_okay=False),
    help="The broker's secret key file (broker.key_secret, from `ipuserve keys generate`): "
    "both sockets speak CURVE and admit only allow-listed keys (docs/security.md); needs "
    "--client-keys and --worker-keys [default: plaintext, protected mode: only peers on "
    "this host (loopback, ipc://) are admitted].",
)
@option(
    "--client-keys",
    default=None,
    type=click.Path(file_okay=False),
    help="Folder of the public key files (*.key) of clients the frontend admits; re-read "
    "on SIGHUP.",
)
@option(
    "--worker-keys",
    default=None,
    type=click.Path(file_okay=False),
    help="Folder of the public key files of workers the backend admits; re-read on SIGHUP.",
)
@option(
    "--admin-keys",
    default=None,
    type=click.Path(file_okay=False),
    help="Folder of the public key files of admins (on the frontend: what a client may, "
    "and what changes the fleet); re-read on SIGHUP.",
)
@option(
    "--insecure",
    is_flag=True,
    help="Without keys, admit peers from every address, not only from this host "
    "(a warning is logged): for a network you trust completely; prefer keys.",
)
def broker(
    frontend: str,
    backend: str,
    heartbeat_ms: int,
    liveness_ms: int,
    grace_ms: int | None,
    orphan_ms: int,
    queue_limit: int,
    max_attempts: int,
    max_payload_bytes: int,
    client_hwm: int,
    client_backlog: int,
    metrics_port: int | None,
    metrics_host: str,
    curve_secret_key: str | None,
    client_keys: str | None,
    worker_keys: str | None,
    admin_keys: str | None,
    insecure: bool,
) -> None:
    """Balance requests from clients across workers until SIGTERM."""
    from ipuserve.broker.config import BrokerConfig
    from ipuserve.broker.loop import Broker
    from ipuserve.malloc import retain_freed_memory
    from ipuserve.security import reload_on_sighup

    retain_freed_memory()

    try:
        options = BrokerConfig(
            frontend=frontend,
            backend=backend,
            heartbeat_ms=heartbeat_ms,
            liveness_ms=liveness_ms,
            grace_ms=grace_ms,
            orphan_ms=orphan_ms,
            queue_limit=queue_limit,
            max_attempts=max_attempts,
            max_payload_bytes=max_payload_bytes,
            client_hwm=client_hwm,
            client_backlog=client_backlog,
            metrics_port=metrics_port,
            metrics_host=metrics_host,
            curve_secret_key=curve_secret_key,
            client_keys=client_keys,
            worker_keys=worker_keys,
            admin_keys=admin_keys,
            insecure=insecure,
        )
    except ConfigError as exc:  # settings that disagree: named as the options they are
        raise click.UsageError(_as_options(str(exc))) from None
    try:
        server = Broker(options)
    except (ConfigError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc

    def stop(signum: int, _frame: object) -> None:
        log.warning("broker received %s: stopping", signal.Signals(signum).name)
        server.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    if server.zap is not None and options.curve:  # keyless: SIGHUP keeps its default
        reload_on_sighup(server.zap)
    metrics = server.metrics_server
    where = f", metrics http://{metrics_host}:{metrics.port}/metrics" if metrics else ""
    click.echo(  # at the default log level too: with --metrics-port 0 nothing else says it
        f"ipuserve broker: frontend {server.frontend_endpoint}, backend "
        f"{server.backend_endpoint}, epoch {server.epoch}, {_security(options)}{where}",
        err=True,
    )
    server.run()


def _security(options: BrokerConfig) -> str:
    """The start-up line's word on who is admitted (the ZAP handler logs it in full)."""
    if options.curve:
        return "security CURVE (peers admitted by key)"
    if options.insecure:
        return "security INSECURE (every address admitted, nothing encrypted)"
    return "security protected mode (only peers on this host admitted; see --insecure)"


commands: list[click.Command] = [broker]
