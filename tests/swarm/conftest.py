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

import docker
import pytest

from tests.compose.harness import (
    DEFAULT_IMAGE,
    IMAGE_ENV,
    ImageUnavailable,
    ensure_image,
    reachable_engine,
    unavailable,
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


@pytest.fixture(scope="session")
def swarm_engine() -> Iterator[docker.DockerClient]:
    """A Docker SDK client of the reachable engine; skips (or fails, in CI) without one."""
    yield from reachable_engine(REQUIRED_ENV, "swarm")


@pytest.fixture(scope="session")
def swarm_image(swarm_engine: docker.DockerClient) -> str:
    try:
        return ensure_image(swarm_engine, os.environ.get(IMAGE_ENV) or DEFAULT_IMAGE)
    except ImageUnavailable as exc:
        unavailable(REQUIRED_ENV, str(exc))


@pytest.fixture(scope="session")
def swarm(swarm_engine: docker.DockerClient, swarm_image: str) -> Iterator[Swarm]:
    """The engine's single-node swarm; made (and left after) unless it was one already."""
    try:
        joined = Swarm.join_or_init(swarm_engine)
    except SwarmUnavailable as exc:
        unavailable(
            REQUIRED_ENV, f"{exc}; the swarm tests need an engine that can be a single-node swarm"
        )
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
