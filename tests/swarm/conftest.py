"""Fixtures for the swarm end-to-end tests: an engine, the image, a swarm, a deployed stack.

Skipped, with the reason and what to do, without a reachable Docker engine, without
the image (and no base image to build it on), or when the engine cannot host a
single-node swarm; with ``IPUSERVE_SWARM_REQUIRED=1`` (as .ci/run sets) each of those
is a failure instead.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import NoReturn

import docker
import pytest

from tests.compose.harness import (
    DEFAULT_IMAGE,
    IMAGE_ENV,
    EngineUnavailable,
    ImageUnavailable,
    connect,
    engine_version,
    ensure_image,
    env_flag,
)
from tests.swarm.harness import (
    BROKERS_ENV,
    REQUIRED_ENV,
    STACK_ENV,
    Stack,
    Swarm,
    SwarmUnavailable,
    make_keys,
)

WORKERS = 2


def brokers() -> int:
    """Broker replicas to deploy: 2 (the issue's stack), or $IPUSERVE_SWARM_BROKERS."""
    return int(os.environ.get(BROKERS_ENV) or 2)


def _unavailable(reason: str) -> NoReturn:
    """Skip, or fail when the run must exercise Swarm (IPUSERVE_SWARM_REQUIRED=1)."""
    if env_flag(REQUIRED_ENV):
        pytest.fail(f"{REQUIRED_ENV}=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def swarm_engine() -> Iterator[docker.DockerClient]:
    try:
        client = connect()
    except EngineUnavailable as exc:
        _unavailable(
            f"no Docker engine reachable ({exc}); start dockerd or set DOCKER_HOST to run "
            f"the swarm tests (.ci/run does, with {REQUIRED_ENV}=1)"
        )
    try:
        print(f"Docker engine {engine_version(client)}")
        yield client
    finally:
        client.close()


@pytest.fixture(scope="session")
def swarm_image(swarm_engine: docker.DockerClient) -> str:
    try:
        return ensure_image(swarm_engine, os.environ.get(IMAGE_ENV) or DEFAULT_IMAGE)
    except ImageUnavailable as exc:
        _unavailable(str(exc))


@pytest.fixture(scope="session")
def swarm(swarm_engine: docker.DockerClient, swarm_image: str) -> Iterator[Swarm]:
    """The engine's single-node swarm; made (and left after) unless it was one already."""
    try:
        joined = Swarm.join_or_init(swarm_engine)
    except SwarmUnavailable as exc:
        _unavailable(f"{exc}; the swarm tests need an engine that can be a single-node swarm")
    print(f"swarm: {'made by this session' if joined.created else 'the engine was in one'}")
    try:
        yield joined
    finally:
        joined.leave()


@pytest.fixture(scope="module")
def stack(
    swarm: Swarm, swarm_image: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """compose.yaml deployed with brokers() brokers and WORKERS workers; removed whatever
    happens, and checked gone."""
    deployed = Stack(
        name=os.environ.get(STACK_ENV) or f"ipuserve-swarm-{uuid.uuid4().hex[:8]}",
        engine=swarm.engine,
        keys=make_keys(tmp_path_factory.mktemp("stack-keys")),
        settings={
            IMAGE_ENV: swarm_image,
            "IPUSERVE_BROKERS": str(brokers()),
            "IPUSERVE_WORKERS": str(WORKERS),
            "IPUSERVE_MODEL": "mlp",
        },
    )
    try:
        print(deployed.deploy())
        yield deployed
    finally:
        print(deployed.describe())
        deployed.remove_probes()
        deployed.remove()
    assert not deployed.leftovers()
