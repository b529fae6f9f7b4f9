"""The abuse suite's gateway: one per module, default limits, in front of the gateway
tests' fabric (tests/gateway/conftest.py), watched by a :class:`~.watch.Watch`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.gateway.abuse.watch import HonestInfer, Watch
from tests.gateway.conftest import Fabric, GatewayProc, mlp_input, start_gateway, wait_ready

#: what a gateway's log never shows, whatever a client sent
NEVER_LOGGED = ("Traceback", "ERROR", "CRITICAL")


@pytest.fixture(scope="module")
def target(fabric: Fabric) -> Iterator[GatewayProc]:
    """A gateway with default limits; its log is checked for tracebacks at the end."""
    gateway = start_gateway(fabric.procs, fabric.broker, name="abused-gateway")
    wait_ready(gateway)
    yield gateway
    log = gateway.proc.output()
    for word in NEVER_LOGGED:
        assert word not in log, f"the abused gateway logged {word!r}:\n{log[-5000:]}"


@pytest.fixture(scope="module")
def watch(fabric: Fabric, target: GatewayProc) -> Watch:
    host, port = target.host_port.rsplit(":", 1)
    x = mlp_input(1, seed=5)
    want = fabric.models["mlp"].reference({"input": x})["logits"]
    return Watch(target.proc.pid, host, int(port), HonestInfer(host, int(port), x, want))
