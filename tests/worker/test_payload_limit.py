"""The broker's payload limit (from WELCOME) bounds what a worker sends back."""

from __future__ import annotations

from ipuserve import protocol as wire
from tests.worker.fakes import ADD, FakeBroker, GatedAdd, add_inputs, add_job
from tests.worker.test_node import (  # noqa: F401  (fixtures)
    StartNode,
    broker,
    expect_fail,
    expect_result,
    start_node,
)


def welcome_with_limit(broker: FakeBroker, start_node: StartNode, limit: int) -> bytes:  # noqa: F811
    """Start an add worker and welcome it with the broker's payload ``limit``."""
    start_node(GatedAdd().backend())
    identity, hello = broker.expect(wire.Hello)
    assert hello.models == (ADD,)
    broker.send(identity, wire.Welcome("epoch1", 50, 60_000, max_payload_bytes=limit))
    return identity


def test_outputs_beyond_the_brokers_limit_fail_with_payload_too_large(
    broker: FakeBroker,  # noqa: F811
    start_node: StartNode,  # noqa: F811
) -> None:
    small = add_inputs(rows=2)  # z: 2 x 8 float32 = 64 bytes
    limit = small["x"].nbytes * 2 + 1  # 129 B: z of 2 rows (64 B) fits, of 5 rows (160 B) not
    identity = welcome_with_limit(broker, start_node, limit)
    broker.job(identity, b"big", add_inputs(rows=5))
    fail = expect_fail(broker, b"big", "PAYLOAD_TOO_LARGE")
    assert "160 bytes" in fail.message and f"limit is {limit}" in fail.message
    expect_result(broker, b"ok", broker.job(identity, b"ok", small))


def test_a_groups_outputs_beyond_the_limit_fail_the_group(
    broker: FakeBroker,  # noqa: F811
    start_node: StartNode,  # noqa: F811
) -> None:
    identity = welcome_with_limit(broker, start_node, 129)
    member = wire.Tensors.of(add_inputs(rows=2))  # z: 64 bytes each; 3 of them 192
    group = wire.Tensors.group([member, member, member])
    broker.send(identity, wire.Jobs((add_job(b"g", group),)))
    fail = expect_fail(broker, b"g", "PAYLOAD_TOO_LARGE")
    assert "group of 3 requests take 192 bytes" in fail.message
