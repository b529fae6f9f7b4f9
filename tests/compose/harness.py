"""Drive compose.yaml from a test: engine check, image, project up/down, health.

Everything here shells out to the commands a person would type: ``docker``
and ``docker compose`` or Debian's ``docker-compose``. (The ``docker`` Python SDK
would do too, but a failed ping leaves its socket to the garbage collector, and
this suite turns that ResourceWarning into an error.) Nothing waits a fixed
time: every wait polls a condition until a deadline.
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

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

T = TypeVar("T")


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes"}


class EngineUnavailable(Exception):
    """No Docker engine answered (or there is no docker CLI to ask)."""


def engine_version() -> str:
    """The version of the Docker engine that answers; EngineUnavailable if none does."""
    if shutil.which("docker") is None:
        raise EngineUnavailable("the docker CLI is not installed")
    try:
        result = subprocess.run(
            ["docker", "version", "--format", "{{.Server.Version}}"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise EngineUnavailable("`docker version` did not answer within 30s") from None
    if result.returncode != 0 or not result.stdout.strip():
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise EngineUnavailable(f"`docker version` failed: {last}")
    return result.stdout.strip()


def compose_command() -> list[str]:
    """$IPUSERVE_COMPOSE, else ``docker compose`` (v2) if it works, else ``docker-compose``."""
    chosen = os.environ.get(COMPOSE_ENV)
    if chosen:
        return shlex.split(chosen)
    docker_cli = shutil.which("docker")
    if docker_cli and _succeeds([docker_cli, "compose", "version"]):
        return [docker_cli, "compose"]
    v1 = shutil.which("docker-compose")
    if v1:
        return [v1]
    raise EngineUnavailable("neither `docker compose` nor `docker-compose` is installed")


def _succeeds(argv: Sequence[str]) -> bool:
    result = subprocess.run(argv, capture_output=True, check=False)
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


def image_exists(image: str) -> bool:
    return _succeeds(["docker", "image", "inspect", image])


def ensure_image(image: str) -> str:
    """Return ``image``, building it from a fresh wheelhouse first if the engine lacks it."""
    if image_exists(image):
        return image
    base = os.environ.get(BASE_IMAGE_ENV) or (
        DEBOOTSTRAP_BASE if image_exists(DEBOOTSTRAP_BASE) else None
    )
    wheelhouse = ROOT / "wheelhouse"
    shutil.rmtree(wheelhouse, ignore_errors=True)
    _run([sys.executable, "-m", "pip", "wheel", "--quiet", ".", "-w", str(wheelhouse)])
    argv = ["docker", "build", "--quiet", "-t", image]
    if base:  # else the Dockerfile's default, an official Python slim image
        argv += ["--build-arg", f"BASE_IMAGE={base}"]
    _run([*argv, "."])
    return image


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
    """What `docker inspect` says about one container of the project."""

    id: str
    name: str
    service: str
    status: str
    """'running', 'exited', 'restarting', ..."""
    health: str | None
    """'starting', 'healthy', 'unhealthy', or None without a health check."""

    @property
    def hostname(self) -> str:
        """The container's default hostname (its short id): the prefix of its worker id."""
        return self.id[:12]

    @property
    def summary(self) -> str:
        """The health while running with a health check, else the status."""
        return self.health if self.status == "running" and self.health else self.status


@dataclass
class ComposeProject:
    """One running copy of compose.yaml under its own project name."""

    name: str
    command: list[str]
    settings: dict[str, str]
    """Variables compose.yaml interpolates (IPUSERVE_IMAGE, IPUSERVE_FRONTEND_PORT, ...)."""
    _env: dict[str, str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # The host's own IPUSERVE_* settings (the test suite sets some for its
        # in-process simulator) must not leak into the containers through
        # compose.yaml's interpolation: start from the environment without them.
        base = {k: v for k, v in os.environ.items() if not k.startswith("IPUSERVE_")}
        self._env = {**base, **self.settings}

    def compose(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        argv = [*self.command, "--project-name", self.name, "--file", str(COMPOSE_FILE), *args]
        return _run(argv, env=self._env, timeout=timeout)

    def up(self, workers: int) -> None:
        self.compose(
            "up", "--detach", "--no-build", "--scale", f"worker={workers}", "broker", "worker"
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

    def container_ids(self, service: str | None = None) -> list[str]:
        argv = [
            "docker",
            "ps",
            "--all",
            "--quiet",
            "--no-trunc",
            "--filter",
            f"label={COMPOSE_LABEL}={self.name}",
        ]
        if service is not None:
            argv += ["--filter", f"label={SERVICE_LABEL}={service}"]
        return _run(argv).stdout.split()

    def containers(self, service: str | None = None) -> list[ContainerState]:
        ids = self.container_ids(service)
        if not ids:
            return []
        lines = _run(["docker", "inspect", "--format", _STATE_FORMAT, *ids]).stdout.splitlines()
        states = [_parse_state(line) for line in lines if line.strip()]
        return sorted(states, key=lambda state: state.name)

    def state(self, container_id: str) -> ContainerState:
        return _parse_state(
            _run(["docker", "inspect", "--format", _STATE_FORMAT, container_id]).stdout.strip()
        )

    def pause(self, container: ContainerState) -> None:
        _run(["docker", "pause", container.id])

    def kill(self, container: ContainerState) -> None:
        _run(["docker", "kill", container.id])

    def remove_leftovers(self) -> list[str]:
        """Force-remove whatever containers of this project still exist; their names."""
        leftover = self.containers()
        if leftover:
            _run(["docker", "rm", "--force", "--volumes", *(c.id for c in leftover)])
        return [c.name for c in leftover]

    def health(self) -> dict[str, str]:
        """Container name -> health while running ('healthy', ...), else its status."""
        return {c.name: c.summary for c in self.containers()}

    def wait_healthy(self, expected: int, timeout: float = 180) -> dict[str, str]:
        """Wait until exactly ``expected`` containers run and report healthy."""

        def all_healthy() -> dict[str, str] | None:
            status = self.health()
            bad = {n: s for n, s in status.items() if s in {"unhealthy", "exited", "dead"}}
            if bad:
                raise AssertionError(f"containers failed: {bad}\n{self.logs()}")
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
        try:
            result = self.compose("logs", "--no-color", "--tail", str(tail), timeout=60)
        except RuntimeError as exc:
            return f"(compose logs failed: {exc})"
        return result.stdout + result.stderr

    def describe(self) -> str:
        """Health and recent logs of the project, for a failure message (never raises)."""
        try:
            health = repr(self.health())
        except RuntimeError as exc:
            health = f"(unknown: {exc})"
        return f"--- compose project {self.name}: {health}\n{self.logs()}"


_STATE_FORMAT = (
    '{{.Id}}\t{{.Name}}\t{{index .Config.Labels "' + SERVICE_LABEL + '"}}\t'
    "{{.State.Status}}\t{{if .State.Health}}{{.State.Health.Status}}{{end}}"
)


def _parse_state(line: str) -> ContainerState:
    cid, name, service, status, health = (line.split("\t") + [""] * 5)[:5]
    return ContainerState(
        id=cid, name=name.lstrip("/"), service=service, status=status, health=health or None
    )
