"""Drive compose.yaml from a test: engine check, image, project up/down, health.

The Docker engine is reached through the Docker SDK for Python (``docker``, the
``test`` extra): the reachability check (``ping``), the image, and everything
about the project's containers (found by their compose labels): state, health,
logs, pause, kill, removal. Only compose itself is a command line, the one a
person would type: ``docker compose`` (v2) or Debian's ``docker-compose`` (v1).
Nothing waits a fixed time: every wait polls a condition until a deadline.
"""

from __future__ import annotations

import gc
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import docker
import docker.errors
import pytest
import requests
from docker.models.containers import Container

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose.yaml"

REQUIRED_ENV = "IPUSERVE_COMPOSE_REQUIRED"
"""``1``: a missing Docker engine fails the test instead of skipping it (set by .ci/run)."""
IMAGE_ENV = "IPUSERVE_IMAGE"
"""The project image compose.yaml runs; built here when missing."""
BASE_IMAGE_ENV = "IPUSERVE_BASE_IMAGE"
"""The base for that build; default: the debootstrap base when present, else the Dockerfile's."""
PROJECT_ENV = "IPUSERVE_COMPOSE_PROJECT"
"""Compose project name; default: a fresh unique name per test session."""
COMPOSE_ENV = "IPUSERVE_COMPOSE"
"""The compose command, e.g. ``docker-compose``; default: ``docker compose`` if it works."""

DEFAULT_IMAGE = "ipuserve:dev"
DEBOOTSTRAP_BASE = "ipuserve-base:bookworm"
COMPOSE_LABEL = "com.docker.compose.project"
SERVICE_LABEL = "com.docker.compose.service"
ONE_SHOT_SERVICES = frozenset({"keys"})
"""Services that run to completion (compose.yaml's `keys`): done, not unhealthy, once exited 0."""
BUILD_STAGE_LABEL = "org.ipuserve.stage=build"
"""The Dockerfile's label on its build stage (pruned after a build here, as .ci/run does)."""

T = TypeVar("T")


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes"}


def unavailable(required_env: str, reason: str) -> NoReturn:
    """Skip with ``reason``, or fail when the run must exercise Docker (``required_env``
    set, as .ci/run sets it)."""
    if env_flag(required_env):
        pytest.fail(f"{required_env}=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def reachable_engine(required_env: str, tests: str) -> Iterator[docker.DockerClient]:
    """A session fixture's Docker SDK client of the reachable engine, closed after;
    skips (or fails, with ``required_env``) without one, saying how to run ``tests``."""
    try:
        client = connect()
    except EngineUnavailable as exc:
        unavailable(
            required_env,
            f"no Docker engine reachable ({exc}); start dockerd or set DOCKER_HOST to run "
            f"the {tests} tests (.ci/run does, with {required_env}=1)",
        )
    try:
        print(f"Docker engine {engine_version(client)}")
        yield client
    finally:
        client.close()


class EngineUnavailable(Exception):
    """No Docker engine answered (or compose is not installed)."""


class ImageUnavailable(Exception):
    """The project image is missing and cannot be built here (no base image to build on)."""


def connect(timeout: float = 30) -> docker.DockerClient:
    """A client of the engine ``docker.from_env()`` finds (DOCKER_HOST, else the local
    socket) that answered a ping; EngineUnavailable, with the reason, if none does.

    The caller closes the client.
    """
    # When the engine's unix socket is missing or refuses, the SDK leaves the
    # socket it failed to connect for the garbage collector, whose ResourceWarning
    # this suite turns into an error. Collect it here, with that warning ignored
    # (it says nothing about the code under test), once nothing refers to it any
    # more: not even the SDK's exception, so that is not chained to ours.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        client: docker.DockerClient | None = None
        try:
            client = docker.from_env(timeout=int(timeout))
            client.ping()
            return client
        except (docker.errors.DockerException, requests.RequestException) as exc:
            if client is not None:
                client.close()
            reason = (str(exc).splitlines() or [type(exc).__name__])[0]
        gc.collect()
    raise EngineUnavailable(f"docker.from_env().ping() failed: {reason}")


def engine_version(client: docker.DockerClient) -> str:
    return str(client.version().get("Version", "unknown"))


def compose_command() -> list[str]:
    """$IPUSERVE_COMPOSE, else ``docker compose`` (v2) if it works, else ``docker-compose``."""
    chosen = os.environ.get(COMPOSE_ENV)
    if chosen:
        argv = shlex.split(chosen)
        if not _succeeds([*argv, "version"]):
            raise EngineUnavailable(f"{COMPOSE_ENV}={chosen!r}: `{chosen} version` fails")
        return argv
    docker_cli = shutil.which("docker")
    if docker_cli and _succeeds([docker_cli, "compose", "version"]):
        return [docker_cli, "compose"]
    v1 = shutil.which("docker-compose")
    if v1:
        return [v1]
    raise EngineUnavailable("neither `docker compose` nor `docker-compose` is installed")


def compose_version(command: Sequence[str]) -> str:
    """What ``COMMAND version`` prints first (for the test report)."""
    result = _run([*command, "version"], timeout=60)
    return (result.stdout.strip().splitlines() or ["unknown"])[0]


def _succeeds(argv: Sequence[str]) -> bool:
    try:
        result = subprocess.run(argv, capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0


def free_port() -> int:
    """A TCP port free on loopback right now (compose publishes the broker on it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def poll(
    condition: Callable[[], T | None],
    *,
    timeout: float,
    interval: float,
    what: str,
    diagnose: Callable[[], str] = lambda: "",
) -> T:
    """Call ``condition`` until it returns something other than None; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result is not None:
            return result
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}\n{diagnose()}")
        time.sleep(interval)


def metric_total(url: str, family: str) -> float:
    """Sum of every sample of one Prometheus family (all label sets) scraped from ``url``."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    total = 0.0
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name == family and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


# ---------------------------------------------------------------------------
# the image


def image_exists(client: docker.DockerClient, image: str) -> bool:
    try:
        client.images.get(image)
    except docker.errors.ImageNotFound:
        return False
    return True


def ensure_image(client: docker.DockerClient, image: str) -> str:
    """Return ``image``, building it from a fresh wheelhouse first if the engine lacks it.

    The build needs a base image: $IPUSERVE_BASE_IMAGE, else the debootstrap base when
    present, else the Dockerfile's default, pulled if missing. ImageUnavailable, saying
    what to do, when that base is neither there nor pullable (an engine without access
    to a registry), rather than a build that fails half-way.
    """
    if image_exists(client, image):
        return image
    base = os.environ.get(BASE_IMAGE_ENV) or (
        DEBOOTSTRAP_BASE if image_exists(client, DEBOOTSTRAP_BASE) else None
    )
    _ensure_base(client, base or dockerfile_base(), image)
    wheelhouse = ROOT / "wheelhouse"
    shutil.rmtree(wheelhouse, ignore_errors=True)
    _run([sys.executable, "-m", "pip", "wheel", "--quiet", ".", "-w", str(wheelhouse)])
    # Without a base, the Dockerfile's default: an official Python slim image.
    buildargs = {"BASE_IMAGE": base} if base else {}
    try:
        client.images.build(
            path=str(ROOT), tag=image, buildargs=buildargs, rm=True, forcerm=True, timeout=600
        )
    except docker.errors.BuildError as exc:
        log = "".join(str(chunk.get("stream", chunk.get("error", ""))) for chunk in exc.build_log)
        raise RuntimeError(f"building {image} failed: {exc}\n{log[-4000:]}") from None
    client.images.prune(filters={"dangling": True, "label": BUILD_STAGE_LABEL})
    return image


def dockerfile_base() -> str:
    """The Dockerfile's default BASE_IMAGE (what a build without the build argument uses)."""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("ARG BASE_IMAGE="):
            return line.split("=", 1)[1].strip()
    raise RuntimeError("Dockerfile has no `ARG BASE_IMAGE=` default")


def _ensure_base(client: docker.DockerClient, base: str, image: str) -> None:
    """Make sure ``base`` is on the engine (pull it if not), or raise ImageUnavailable."""
    if image_exists(client, base):
        return
    try:
        client.images.pull(base)
    except (docker.errors.DockerException, requests.RequestException) as exc:
        reason = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ImageUnavailable(
            f"{image} is not on the engine and its base {base} is neither there nor "
            f"pullable ({reason}); build the base without a registry with "
            f"`sudo .ci/base-image.sh` (debootstrap: {DEBOOTSTRAP_BASE}, used when present), "
            f"set {BASE_IMAGE_ENV} to a Python >= 3.11 image the engine has, or set "
            f"{IMAGE_ENV} to an ipuserve image already built"
        ) from None


def _run(
    argv: Sequence[str], env: Mapping[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"command failed ({result.returncode}): {shlex.join(argv)}\n"
            f"--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}"
        )
    return result


# ---------------------------------------------------------------------------
# the compose project


@dataclass(frozen=True)
class ContainerState:
    """What the engine says about one container of the project (a snapshot)."""

    id: str
    name: str
    service: str
    hostname: str
    """The container's hostname (by default its short id): the prefix of its worker id."""
    status: str
    """'running', 'exited', 'restarting', 'paused', ..."""
    health: str | None
    """'starting', 'healthy', 'unhealthy', or None without a health check."""
    health_output: str = ""
    """Output of the last health check (for diagnostics)."""
    exit_code: int | None = None
    """The exit status once exited, else None."""

    @classmethod
    def of(cls, container: Container) -> ContainerState:
        attrs: dict[str, Any] = container.attrs
        state: dict[str, Any] = attrs.get("State") or {}
        health: dict[str, Any] = state.get("Health") or {}
        checks: list[dict[str, Any]] = health.get("Log") or []
        return cls(
            id=str(container.id),
            name=str(container.name),
            service=str(container.labels.get(SERVICE_LABEL, "")),
            hostname=str((attrs.get("Config") or {}).get("Hostname") or container.id[:12]),
            status=str(state.get("Status", "unknown")),
            health=str(health["Status"]) if health.get("Status") else None,
            health_output=str(checks[-1].get("Output", "")).strip() if checks else "",
            exit_code=int(state.get("ExitCode", 0)) if state.get("Status") == "exited" else None,
        )

    @property
    def summary(self) -> str:
        """The health while running with a health check, else the status."""
        return self.health if self.status == "running" and self.health else self.status


@dataclass
class ComposeProject:
    """One running copy of compose.yaml under its own project name."""

    name: str
    command: list[str]
    """The compose command line: ``docker compose`` or ``docker-compose``."""
    engine: docker.DockerClient
    """The engine the project runs on (for everything but compose itself)."""
    settings: dict[str, str]
    """Variables compose.yaml interpolates (IPUSERVE_IMAGE, IPUSERVE_FRONTEND_PORT, ...)."""
    _env: dict[str, str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # The host's own IPUSERVE_* settings (the test suite sets some for its
        # in-process simulator) must not leak into the containers through
        # compose.yaml's interpolation: start from the environment without them.
        base = {k: v for k, v in os.environ.items() if not k.startswith("IPUSERVE_")}
        self._env = {**base, **self.settings}

    # -- compose (the command line) -------------------------------------------

    def compose(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        argv = [*self.command, "--project-name", self.name, "--file", str(COMPOSE_FILE), *args]
        return _run(argv, env=self._env, timeout=timeout)

    def up(self, workers: int) -> None:
        self.compose(
            "up",
            "--detach",
            "--no-build",
            "--scale",
            f"worker={workers}",
            "broker",
            "worker",
            "repository-worker",
            "gateway",
        )

    def down(self) -> None:
        self.compose("down", "--volumes", "--remove-orphans", "--timeout", "10")

    def run_job(
        self, service: str, *args: str, env: Mapping[str, str] | None = None, timeout: float = 120
    ) -> str:
        """Run a one-shot service (one behind a profile) to completion; its stdout."""
        options = [arg for key, value in (env or {}).items() for arg in ("-e", f"{key}={value}")]
        result = self.compose(
            "--profile",
            service,
            "run",
            "--rm",
            "--no-deps",
            *options,
            service,
            *args,
            timeout=timeout,
        )
        return result.stdout

    # -- the engine (the Docker SDK) ------------------------------------------

    def _containers(self, service: str | None = None) -> list[Container]:
        """The project's containers, found by compose's labels, sorted by name."""
        labels = [f"{COMPOSE_LABEL}={self.name}"]
        if service is not None:
            labels.append(f"{SERVICE_LABEL}={service}")
        found: list[Container] = self.engine.containers.list(all=True, filters={"label": labels})
        return sorted(found, key=lambda container: str(container.name))

    def containers(self, service: str | None = None) -> list[ContainerState]:
        return [ContainerState.of(container) for container in self._containers(service)]

    def state(self, container_id: str) -> ContainerState:
        return ContainerState.of(self.engine.containers.get(container_id))

    def pause(self, container: ContainerState) -> None:
        self.engine.containers.get(container.id).pause()

    def kill(self, container: ContainerState) -> None:
        """SIGKILL: no drain, no goodbye to the broker."""
        self.engine.containers.get(container.id).kill()

    def remove_leftovers(self) -> list[str]:
        """Force-remove whatever containers of this project still exist; their names."""
        leftover = self._containers()
        for container in leftover:
            try:
                container.remove(force=True, v=True)
            except docker.errors.NotFound:
                pass  # went away by itself meanwhile
        return [str(container.name) for container in leftover]

    def health(self) -> dict[str, str]:
        """Container name -> health while running ('healthy', ...), else its status;
        one-shot services (``keys``) only once they failed (they are meant to exit)."""
        return {
            c.name: c.summary
            for c in self.containers()
            if c.service not in ONE_SHOT_SERVICES or c.exit_code not in (None, 0)
        }

    def copy_out(self, service: str, path: str, destination: Path) -> Path:
        """Copy ``path`` (a file or folder) out of ``service``'s first container into
        ``destination`` (as ``docker cp`` does, volumes included); the copy's path.

        How a host-side client gets compose's keys: they live in a named volume."""
        container = self._containers(service)[0]
        stream, _stat = container.get_archive(path)
        with tempfile.TemporaryFile() as archive:
            for chunk in stream:
                archive.write(chunk)
            archive.seek(0)
            with tarfile.open(fileobj=archive) as tar:
                tar.extractall(destination, filter="data")  # no owners, no odd paths
        return destination / Path(path).name

    def wait_healthy(self, expected: int, timeout: float = 180) -> dict[str, str]:
        """Wait until exactly ``expected`` containers run and report healthy."""

        def all_healthy() -> dict[str, str] | None:
            status = self.health()
            bad = {n: s for n, s in status.items() if s in {"unhealthy", "exited", "dead"}}
            if bad:
                raise AssertionError(f"containers failed: {bad}\n{self.describe()}")
            healthy = len(status) == expected and all(s == "healthy" for s in status.values())
            return status if healthy else None

        return poll(
            all_healthy,
            timeout=timeout,
            interval=1.0,
            what=f"{expected} healthy containers",
            diagnose=self.describe,
        )

    def logs(self, tail: int = 60) -> str:
        """The last ``tail`` log lines of every container of the project."""
        parts = []
        for container in self._containers():
            try:
                text = container.logs(tail=tail).decode(errors="replace")
            except docker.errors.DockerException as exc:
                text = f"(logs failed: {exc})\n"
            parts.append(f"--- logs of {container.name}\n{text}")
        return "".join(parts)

    def describe(self) -> str:
        """State, health checks and recent logs of the project, for a failure message.

        Never raises: it is what a failure reports.
        """
        try:
            states = self.containers()
        except docker.errors.DockerException as exc:
            return f"--- compose project {self.name}: (unknown: {exc})"
        lines = [f"--- compose project {self.name}: {len(states)} containers"]
        for state in states:
            line = f"    {state.name}: {state.summary}"
            if state.health_output and state.health != "healthy":
                line += f" (last health check: {state.health_output[-300:]!r})"
            lines.append(line)
        try:
            logs = self.logs()
        except docker.errors.DockerException as exc:
            logs = f"(logs failed: {exc})"
        return "\n".join(lines) + "\n" + logs
