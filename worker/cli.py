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
from ipuserve.limits import is_version, name_problem
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


class LoadSpec(click.ParamType):  # type: ignore[type-arg]
    """``NAME`` or ``NAME:VERSION`` (a positive integer): (name, version or None)."""

    name = "NAME[:VERSION]"

    def convert(self, value: Any, param: Any, ctx: Any) -> tuple[str, str | None]:
        if isinstance(value, tuple):
            return value
        name, colon, version = str(value).rpartition(":")
        if not colon:
            name, version = version, ""
        problem = name_problem(name)
        if problem is not None:
            self.fail(f"a model name {problem}", param, ctx)
        if colon and not is_version(version):
            self.fail(f"the version in {value!r} must be a positive integer", param, ctx)
        return name, version or None


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
    type=ModelFiles(dir_okay=False),
    help="Model file(s) making one model (repeat the option; the env var takes a "
    "space-separated list). Either this or --repository.",
)
@option(
    "--repository",
    default=None,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Host models from this model repository (REPO/NAME/VERSION/*.popef, "
    "docs/repository_layout.md) on the --ipus of this worker, loading and unloading "
    "versions when a broker's admin asks; each model's options come from its "
    "config.toml. Either this or --model.",
)
@option(
    "--load",
    "loads",
    multiple=True,
    type=LoadSpec(),
    help="With --repository: load NAME (its latest version) or NAME:VERSION at start "
    "(repeat the option; the env var takes a space-separated list).",
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
    repository: Path | None,
    loads: tuple[tuple[str, str | None], ...],
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
    """Serve a model (--model) or a repository's models (--repository) until SIGTERM.

    With --model, one ModelRunner serves the model's files; with --repository, versions
    are loaded and unloaded on this worker's IPUs as brokers ask (docs/repository_layout.md)."""
    _check_model_or_repository(models, repository, loads)
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
    if repository is not None:
        sys.exit(
            _serve_repository(
                repository, ipus, config, endpoints, loads, look_ahead, metrics_host, metrics_port
            )
        )
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


#: options that set one model's serving: with --repository its config.toml sets them
_PER_MODEL = ("name", "replicas", "batching_dim", "batch_policy", "batch_timeout_ms", "credit")


def _check_model_or_repository(
    models: tuple[str, ...], repository: Path | None, loads: tuple[object, ...]
) -> None:
    if bool(models) == (repository is not None):
        raise click.UsageError("give either --model (one model) or --repository (a repository)")
    if loads and repository is None:
        raise click.BadParameter("--load needs --repository", param_hint="'--load'")
    if repository is None:
        return
    context = click.get_current_context()
    given = [
        f"--{key.replace('_', '-')}"
        for key in _PER_MODEL
        if context.get_parameter_source(key) is not click.core.ParameterSource.DEFAULT
    ]
    if given:
        raise click.UsageError(
            f"{', '.join(given)} set(s) one model's serving; with --repository each "
            "model's config.toml does (docs/repository_layout.md)"
        )


def _serve_repository(
    root: Path,
    ipus: int | None,
    config: WorkerConfig,
    endpoints: Sequence[str],
    loads: Sequence[tuple[str, str | None]],
    look_ahead: str,
    metrics_host: str,
    metrics_port: int | None,
) -> int:
    """``--repository``: a ModelHost on this worker's IPUs; the exit code."""
    from ipuserve.runtime import DeviceManager
    from ipuserve.worker.host import ModelHost
    from ipuserve.worker.host_node import serve_host
    from ipuserve.worker.metrics import RepositoryMetrics, WorkerFamilies
    from ipuserve.worker.repository import Repository

    count = ipus if ipus is not None else DeviceManager().config.num_ipus  # the env's
    families, repository_metrics = WorkerFamilies(), RepositoryMetrics()
    repository_metrics.free_ipus(count)  # before any load: all of them
    host = ModelHost(
        Repository(root),
        count,
        config,
        endpoints,
        on_joined=lambda line: click.echo(line, err=True),
        look_ahead=look_ahead,
        metrics=repository_metrics,
        families=families,
    )
    for entry in host.repository.entries:
        if entry.problem:
            click.echo(f"ipuserve worker: {entry.name}:{entry.version}: {entry.problem}", err=True)
    health = {probes.LIVE: probes.not_yet("starting"), probes.READY: probes.not_yet("starting")}
    try:
        registries = [families.registry, repository_metrics.registry]
        server = _metrics_server(registries, metrics_host, metrics_port, health)
    except IpuserveError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        return serve_host(
            host,
            config,
            endpoints,
            loads,
            on_joined=lambda line: click.echo(line, err=True),
            health=health,
        )
    finally:
        if server is not None:
            server.close()


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
