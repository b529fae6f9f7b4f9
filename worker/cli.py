"""Click commands owned by ipuserve.worker (mounted by ipuserve.face.cli)."""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ipuserve import probes
from ipuserve.clikit import Endpoint, ModelName, option, parse_duration_ms
from ipuserve.discovery import split_endpoints
from ipuserve.errors import IpuserveError
from ipuserve.security.cli import curve_client_options, keys_from_options
from ipuserve.worker.config import WorkerConfig, default_worker_id

if TYPE_CHECKING:
    from ipuserve.metrics import Exposed
    from ipuserve.worker.metrics import CreditMetrics

log = logging.getLogger(__name__)

#: ipuserve.runtime.model_runner.batch_policy.POLICIES, spelled out: importing the
#: runtime here would cost every `ipuserve` command ~0.2 s (a test keeps them equal).
POLICIES = ("eager", "fixed", "adaptive")


class LookAhead(click.ParamType):  # type: ignore[type-arg]
    """``unlimited`` or a run count: the spec's ``ModelRunnerConfig.max_look_ahead``."""

    name = "unlimited|N"

    def convert(self, value: Any, param: Any, ctx: Any) -> str:
        text = str(value).strip().lower()
        if text != "unlimited" and not (text.isascii() and text.isdigit()):
            self.fail(f"expected 'unlimited' or a whole number >= 0, got {value!r}", param, ctx)
        return text if text == "unlimited" else str(int(text))


class ModelFiles(click.Path):
    """A model file; a list of them in the env var is split on whitespace, as the help
    says (click splits a Path list on os.pathsep)."""

    def split_envvar_value(self, rv: str) -> Sequence[str]:
        return rv.split()


@click.command("worker")
@option(
    "--broker",
    multiple=True,
    required=True,
    type=Endpoint(port=5556),
    help="A broker's backend endpoint, e.g. tcp://HOST:5556. Repeat the option (the env "
    "var takes a space-separated list) to serve several brokers at once: the worker "
    "registers with each and never holds more requests than its credit in all, shared "
    "by demand. A host that resolves to several addresses (Swarm's tasks.SERVICE) "
    "stands for a broker at each, followed as they change.",
)
@option(
    "--model",
    "models",
    multiple=True,
    required=True,
    type=ModelFiles(dir_okay=False),
    help="Model file(s) making one model (repeat the option; the env var takes a "
    "space-separated list).",
)
@option(
    "--name",
    default=None,
    type=ModelName(),
    help="Model name clients use [default: the model file's name].",
)
@option("--replicas", default=1, type=click.IntRange(min=1), help="Replicas (one device each).")
@option(
    "--batching-dim",
    default=None,
    type=click.IntRange(min=0),
    help="Dimension along which requests of any size are packed into the compiled batch; "
    "it must hold the compiled batch size in every input and output [default: 0 if it "
    "does, else the one dimension that does].",
)
@option(
    "--batch-policy",
    default="adaptive",
    type=click.Choice(POLICIES),
    help="When a partial batch runs: adaptive waits only for requests on their way "
    "back, and only while that is shorter than what a run costs the device and the "
    "host, both measured (no tuning); eager runs it "
    "as soon as the device is free; fixed waits --batch-timeout-ms from its first sample.",
)
@option(
    "--batch-timeout-ms",
    default=None,
    type=float,
    callback=parse_duration_ms,
    help="Longest a partial batch waits for more requests, from its first sample's "
    "arrival: the window of --batch-policy fixed (needed there), an upper bound for "
    "adaptive [default: no bound beyond its own, what one run costs the device and the "
    "host].",
)
@option(
    "--look-ahead",
    default="0",
    type=LookAhead(),
    help="Runs whose inputs a look-ahead thread prepares while the device computes (the "
    "runtime's max_look_ahead). 0: the device thread takes each job from the queues "
    "itself, one thread hand-off fewer per request; 'unlimited' or N: packing overlaps "
    "the device's runs, for models whose packing costs a noticeable share of a run.",
)
@option(
    "--ipus",
    default=None,
    type=click.IntRange(min=1),
    help="Size of this process's simulated IPU inventory (sets IPUSERVE_SIM_IPUS).",
)
@option(
    "--credit",
    default=None,
    type=click.IntRange(min=1),
    help="Requests held at once [default: what the runner can hold].",
)
@option(
    "--heartbeat-ms",
    default=1000.0,
    type=click.FloatRange(min=1.0),
    help="Longest gap between heartbeats to the broker.",
)
@option("--worker-id", default=None, help="Name shown by `ipuserve models` [default: host:pid].")
@option(
    "--drain-timeout-ms",
    default=10_000.0,
    type=float,
    callback=parse_duration_ms,
    help="On SIGTERM, finish held requests for at most this long, then hand back the rest.",
)
@option(
    "--reconnect-max-ms",
    default=5000.0,
    type=click.FloatRange(min=1.0),
    help="Longest wait between attempts to reach the broker.",
)
@option(
    "--metrics-port",
    default=None,
    type=click.IntRange(min=0, max=65535),
    help="Serve Prometheus metrics (jobs and the runtime's monitoring statistics) over HTTP "
    "on this port (0: any free port), with the /healthz and /ready probes.",
)
@option(
    "--metrics-host",
    default="127.0.0.1",
    help="Address the metrics endpoint binds: loopback by default, as it is plain HTTP "
    "without authentication; 0.0.0.0 exposes it (docs/security.md).",
)
@curve_client_options
def worker(
    broker: tuple[str, ...],
    models: tuple[str, ...],
    name: str | None,
    replicas: int,
    batching_dim: int | None,
    batch_policy: str,
    batch_timeout_ms: float | None,
    look_ahead: str,
    ipus: int | None,
    credit: int | None,
    heartbeat_ms: float,
    worker_id: str | None,
    drain_timeout_ms: float,
    reconnect_max_ms: float,
    metrics_port: int | None,
    metrics_host: str,
    curve_secret_key: Path | None,
    broker_public_key: Path | None,
) -> None:
    """Serve a model from a ModelRunner to the broker(s) until SIGTERM."""
    endpoints = split_endpoints(broker)
    config = WorkerConfig(
        broker=endpoints[0],
        worker_id=worker_id or default_worker_id(),
        credit=credit,
        heartbeat_ms=heartbeat_ms,
        handshake_timeout_ms=max(3 * heartbeat_ms, 1000.0),
        reconnect_max_ms=reconnect_max_ms,
        drain_timeout_ms=drain_timeout_ms,
        keys=keys_from_options(curve_secret_key, broker_public_key),
    )
    if ipus is not None:
        if replicas > ipus:
            raise click.BadParameter(
                f"{replicas} replicas need at least {replicas} IPUs (one device each), "
                f"but --ipus gives this worker {ipus}",
                param_hint="'--replicas'",
            )
        os.environ["IPUSERVE_SIM_IPUS"] = str(ipus)
    if batch_policy == "fixed" and not batch_timeout_ms:
        raise click.BadParameter(
            "--batch-policy fixed needs --batch-timeout-ms > 0 (its window)",
            param_hint="'--batch-timeout-ms'",
        )
    with _stopped_while_loading():  # until serve() installs the drain handler
        log.info("loading %s", ", ".join(models))
        backend = _runner_backend(
            list(models),
            name=name,
            replicas=replicas,
            batching_dim=batching_dim,
            batch_policy=batch_policy,
            batch_timeout_ms=batch_timeout_ms,
            look_ahead=look_ahead,
            credit=credit,
        )
        from ipuserve.worker.metrics import CreditMetrics

        credit_metrics = CreditMetrics(credit or backend.capacity())
        # serve() puts the broker nodes' probes here once it made them
        health = {probes.LIVE: probes.not_yet("starting"), probes.READY: probes.not_yet("starting")}
        try:
            server = _metrics_server(
                [backend.metrics.registry, credit_metrics.registry],
                metrics_host,
                metrics_port,
                health,
            )
        except IpuserveError as exc:
            backend.close()  # lets go of its IPUs
            raise click.ClickException(str(exc)) from None
    try:
        code = serve(backend, config, endpoints, credit_metrics, health)
    finally:
        if server is not None:
            server.close()
    sys.exit(code)


class _Stopped(BaseException):
    """SIGTERM while the model loads (as KeyboardInterrupt: past `except Exception`)."""


@contextlib.contextmanager
def _stopped_while_loading() -> Iterator[None]:
    """SIGTERM before the worker serves: it lets go of its IPUs and exits 143 saying so,
    where it once died silently (the drain handler comes only with serving). Nothing
    is lost: it has accepted no request yet."""

    def stop(_signum: int, _frame: object) -> None:
        raise _Stopped

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    except _Stopped:
        click.echo("ipuserve worker: stopped by SIGTERM while loading its model", err=True)
        sys.exit(128 + signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _metrics_server(metrics: Exposed, host: str, port: int | None, health: probes.Probes) -> Any:
    if port is None:
        return None
    from ipuserve.metrics import MetricsServer

    server = MetricsServer(metrics, host, port, health)
    # at the default log level too: with --metrics-port 0 nothing else says the port
    click.echo(f"ipuserve worker: metrics on http://{host}:{server.port}/metrics", err=True)
    return server


def _runner_backend(model_paths: list[str], **options: Any) -> Any:
    try:  # the lead's module; imported by name so this builds before it lands
        runner_backend = importlib.import_module("ipuserve.worker.runner_backend")
    except ImportError as exc:
        raise click.ClickException(f"the ModelRunner backend is not available: {exc}") from exc
    try:
        return runner_backend.RunnerBackend(model_paths, **options)
    except IpuserveError as exc:
        raise click.ClickException(f"cannot serve {', '.join(model_paths)}: {exc}") from exc


def serve(
    backend: Any,
    config: WorkerConfig,
    endpoints: Sequence[str] = (),
    metrics: CreditMetrics | None = None,
    health: dict[str, probes.Probe] | None = None,
) -> int:
    """Serve every broker ``endpoints`` stand for (default: ``config.broker``), one node
    each on its own thread, until SIGTERM/SIGINT drains them; the exit code. ``health``
    (the metrics server's probes) gets the broker nodes'."""
    from ipuserve.malloc import retain_freed_memory
    from ipuserve.worker.brokers import BrokerNodes

    retain_freed_memory()
    nodes = BrokerNodes(
        backend,
        config,
        endpoints or [config.broker],
        on_joined=lambda line: click.echo(line, err=True),
        metrics=metrics,
    )
    if health is not None:
        health[probes.LIVE], health[probes.READY] = nodes.live, nodes.ready

    def stop(signum: int, _frame: object) -> None:
        log.warning("worker received %s: draining", signal.Signals(signum).name)
        nodes.request_stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return nodes.run()


commands: list[click.Command] = [worker]
