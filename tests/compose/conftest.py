"""Fixtures for the compose end-to-end tests: a Docker engine, the image, a running stack.

Without a reachable Docker engine these tests are skipped, with the reason, unless
``IPUSERVE_COMPOSE_REQUIRED=1`` (as .ci/run sets), where that is a failure.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import docker
import pytest

from tests.compose.harness import (
    DEFAULT_IMAGE,
    IMAGE_ENV,
    PROJECT_ENV,
    REQUIRED_ENV,
    ComposeProject,
    EngineUnavailable,
    ImageUnavailable,
    compose_command,
    compose_version,
    ensure_image,
    free_port,
    reachable_engine,
    unavailable,
)

WORKERS = 2
#: the long-running containers: a broker, the workers, a repository worker and a gateway
SERVING = 1 + WORKERS + 1 + 1


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[docker.DockerClient]:
    """A Docker SDK client of the reachable engine; skips (or fails, in CI) without one."""
    yield from reachable_engine(REQUIRED_ENV, "compose")


@pytest.fixture(scope="session")
def compose_cli(docker_engine: docker.DockerClient) -> list[str]:
    """The compose command line (v2 plugin or Debian's docker-compose)."""
    try:
        command = compose_command()
    except EngineUnavailable as exc:
        unavailable(REQUIRED_ENV, f"{exc}; install Docker Compose to run the compose tests")
    print(f"compose: {' '.join(command)}: {compose_version(command)}")
    return command


@pytest.fixture(scope="session")
def ipuserve_image(docker_engine: docker.DockerClient) -> str:
    """The project image, built here if missing; skips (fails, in CI) when it cannot be."""
    try:
        return ensure_image(docker_engine, os.environ.get(IMAGE_ENV) or DEFAULT_IMAGE)
    except ImageUnavailable as exc:
        unavailable(REQUIRED_ENV, str(exc))


@pytest.fixture(scope="module")
def stack(
    docker_engine: docker.DockerClient, compose_cli: list[str], ipuserve_image: str
) -> Iterator[ComposeProject]:
    """compose.yaml brought up with one broker, two workers, a repository worker and a
    gateway; torn down whatever happens (its volumes too)."""
    name = os.environ.get(PROJECT_ENV) or f"ipuserve-test-{uuid.uuid4().hex[:8]}"
    frontend_port, metrics_port, http_port = free_port(), free_port(), free_port()
    project = ComposeProject(
        name=name,
        command=compose_cli,
        engine=docker_engine,
        settings={
            IMAGE_ENV: ipuserve_image,
            "IPUSERVE_FRONTEND_PORT": f"127.0.0.1:{frontend_port}",
            "IPUSERVE_METRICS_PORT": f"127.0.0.1:{metrics_port}",
            "IPUSERVE_HTTP_PORT": f"127.0.0.1:{http_port}",
            "IPUSERVE_GRPC_PORT": f"127.0.0.1:{free_port()}",
            "IPUSERVE_MODEL": "mlp",
            # the opt-in compose.yaml's header shows: the tokens the `keys` job made
            "IPUSERVE_GATEWAY_INFER_TOKENS": "/keys/gateway/infer.tokens",
            "IPUSERVE_GATEWAY_ADMIN_TOKENS": "/keys/gateway/admin.tokens",
        },
    )
    try:
        project.up(workers=WORKERS)
        project.wait_healthy(expected=SERVING)
        yield project
    finally:
        print(project.describe())
        try:
            project.down()
        finally:
            leftover = project.remove_leftovers()
        assert not leftover, f"`down` left containers behind: {leftover}"


@dataclass(frozen=True)
class HostKeys:
    """A host-side client's CURVE keys, copied out of compose's `keys` volume."""

    client_secret: Path
    broker_public: Path


@pytest.fixture(scope="module")
def host_keys(stack: ComposeProject, tmp_path_factory: pytest.TempPathFactory) -> HostKeys:
    """compose.yaml's client key and the broker's public key, on the host (the broker
    container mounts the volume: `docker cp` works with both compose versions)."""
    folder = tmp_path_factory.mktemp("compose-keys")
    client = stack.copy_out("broker", "/keys/client", folder)
    broker = stack.copy_out("broker", "/keys/broker/broker.key", folder)
    return HostKeys(client_secret=client / "client.key_secret", broker_public=broker)


@pytest.fixture(scope="module")
def frontend(stack: ComposeProject) -> str:
    """The broker's frontend address as seen from the host."""
    return f"tcp://{stack.settings['IPUSERVE_FRONTEND_PORT']}"


@pytest.fixture(scope="module")
def gateway_url(stack: ComposeProject) -> str:
    """The gateway's HTTP door as seen from the host."""
    return f"http://{stack.settings['IPUSERVE_HTTP_PORT']}"


@pytest.fixture(scope="module")
def gateway_token(stack: ComposeProject, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The gateway's admin token (an admin may also infer), copied out of the `keys`
    volume as compose.yaml's header says."""
    folder = tmp_path_factory.mktemp("gateway-tokens")
    return stack.copy_out("broker", "/keys/gateway/admin.tokens", folder).read_text().strip()


@pytest.fixture(scope="module")
def metrics_url(stack: ComposeProject) -> str:
    """The broker's Prometheus endpoint as seen from the host."""
    return f"http://{stack.settings['IPUSERVE_METRICS_PORT']}/metrics"
