"""BrokerNodes (one worker, several brokers) against fake brokers that follow a name's
addresses: a broker whose address goes away gets its jobs back, and its share of the
capacity goes to the others once what it gave the worker has finished."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq

from ipuserve import protocol as wire
from ipuserve.discovery import EndpointSet
from ipuserve.worker.brokers import BrokerNodes
from ipuserve.worker.config import WorkerConfig
from ipuserve.worker.credit import CreditPool
from ipuserve.worker.node import WorkerNode
from tests.worker.fakes import TIMEOUT, FakeBroker, GatedAdd

CAPACITY = 4


def fake_broker_at(endpoint: str) -> FakeBroker:
    """A FakeBroker bound where asked (FakeBroker() binds 127.0.0.1 on any port)."""
    broker = FakeBroker.__new__(FakeBroker)
    broker.socket = zmq.Context.instance().socket(zmq.ROUTER)
    broker.socket.setsockopt(zmq.LINGER, 0)
    broker.socket.bind(endpoint)
    broker.endpoint = endpoint
    broker.outcomes = []
    return broker


def echo_credit_until(
    done: Callable[[], bool], *brokers: FakeBroker
) -> dict[int, list[wire.Message]]:
    """Answer credit changes as a broker does, on every broker, until ``done``; the other
    messages each broker got (by position)."""
    others: dict[int, list[wire.Message]] = {i: [] for i in range(len(brokers))}
    deadline = time.monotonic() + TIMEOUT
    while not done():
        assert time.monotonic() < deadline, f"never done; got {others}"
        for i, broker in enumerate(brokers):
            try:
                identity, message = broker.recv(timeout=0.005, heartbeats=True)
            except TimeoutError:
                continue
            if isinstance(message, wire.Heartbeat) and message.credit is not None:
                broker.send(identity, wire.Heartbeat(credit=message.credit))
            elif not isinstance(message, wire.Heartbeat):
                others[i].append(message)  # type: ignore[arg-type]
    return others


class Running:
    """BrokerNodes on a thread, following ``tcp://brokers.test:PORT`` whose addresses are the
    list ``addresses`` as it is at each look-up."""

    def __init__(self, model: GatedAdd, port: str, addresses: list[str]) -> None:
        def resolver(_host: str) -> list[str]:
            return list(addresses)

        name = f"tcp://brokers.test:{port}"
        endpoints = EndpointSet([name], interval_s=0.05, resolver=resolver)
        config = WorkerConfig(
            broker=name,
            worker_id="w1",
            heartbeat_ms=50,
            handshake_timeout_ms=300,
            reconnect_min_ms=10,
            reconnect_max_ms=50,
        )
        backend = model.backend(threads=CAPACITY, capacity=CAPACITY)
        self.nodes = BrokerNodes(backend, config, [], endpoint_set=endpoints, resolver=resolver)
        self.exit_code: list[int] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.exit_code.append(self.nodes.run())

    def stop(self) -> list[int]:
        self.nodes.request_stop()
        self.thread.join(TIMEOUT)
        return self.exit_code

    def credits(self) -> dict[str, Any]:
        return {s.name: (s.granted, s.pending) for s in self.nodes.pool.shares}


@pytest.fixture
def brokers() -> Iterator[tuple[FakeBroker, FakeBroker, FakeBroker, str]]:
    """Three fake brokers on one port of three loopback addresses, and that port (a
    name that resolves to one address stands for itself: discovery.py)."""
    first = FakeBroker()
    port = first.endpoint.rsplit(":", 1)[1]
    others = [fake_broker_at(f"tcp://127.0.0.{i}:{port}") for i in (2, 3)]
    yield first, others[0], others[1], port
    for broker in (first, *others):
        broker.close()


def settled(running: Running, total: int, *names: str) -> bool:
    """Exactly ``names`` are served, their credits add up to ``total``, none pending."""
    now = running.credits()
    return set(now) == set(names) and (
        sum(g for g, _p in now.values()) == total and all(p is None for _g, p in now.values())
    )


def test_a_broker_gone_from_the_endpoints_gets_its_jobs_back_and_frees_its_share(
    brokers: tuple[FakeBroker, FakeBroker, FakeBroker, str],
) -> None:
    first, second, third, port = brokers
    addresses = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    model = GatedAdd(gated=True)
    running = Running(model, port, addresses)
    pool = running.nodes.pool
    try:
        on_first, on_second, _on_third = first.welcome(), second.welcome(), third.welcome()
        stays, gone, idle = (f"tcp://127.0.0.{i}:{port}" for i in (1, 2, 3))
        every = (first, second, third)
        echo_credit_until(lambda: settled(running, CAPACITY, stays, gone, idle), *every)
        assert min(g for g, _p in running.credits().values()) == 1  # 4 over 3: 1, 1 and 2
        second.job(on_second, b"j1")
        model.wait_started()
        addresses.remove("127.0.0.2")  # the broker's task is gone from the name
        beat: Any = None
        while not (isinstance(beat, wire.Heartbeat) and beat.credit is not None):
            _identity, beat = second.recv(heartbeats=True)
        assert beat.credit == 0  # as a drain does
        _identity, bye = second.expect(wire.Bye)
        assert bye.handed_back == (b"j1",)
        # j1 still runs (a backend cannot recall it): 3 for the two that stay, then 4
        echo_credit_until(
            lambda: settled(running, 3, stays, gone, idle) and pool.held == 1, first, third
        )
        assert running.credits()[gone] == (0, None)
        model.gate.set()
        echo_credit_until(lambda: settled(running, CAPACITY, stays, idle), first, third)
        inputs = first.job(on_first, b"j2")
        _identity, result = first.expect(wire.Result)
        assert result.job_id == b"j2"
        assert (result.tensors.arrays()["z"] == inputs["x"] + 2 * inputs["y"]).all()
        assert pool.held_max <= CAPACITY
    finally:
        assert running.stop() == [0]


def test_a_name_down_to_one_address_and_back_keeps_the_connection_to_that_broker(
    brokers: tuple[FakeBroker, FakeBroker, FakeBroker, str],
) -> None:
    """A name that resolves to one address is used as the name (discovery.py): the
    broker at that address is the same, so its connection goes on -- no BYE, no
    handed-back jobs -- both when the name shrinks to it and when it grows again."""
    first, second, _third, port = brokers
    addresses = ["127.0.0.1", "127.0.0.2"]
    model = GatedAdd()
    running = Running(model, port, addresses)
    name, at_first, at_second = (
        f"tcp://{h}:{port}" for h in ("brokers.test", "127.0.0.1", "127.0.0.2")
    )
    try:
        on_first, _on_second = first.welcome(), second.welcome()
        echo_credit_until(lambda: settled(running, CAPACITY, at_first, at_second), first, second)
        addresses.remove("127.0.0.2")
        others = echo_credit_until(lambda: settled(running, CAPACITY, name), first, second)
        assert not [m for m in others[0] if isinstance(m, wire.Bye)]  # the first is kept
        if not [m for m in others[1] if isinstance(m, wire.Bye)]:
            second.expect(wire.Bye)  # the broker gone from the name is left
        addresses.append("127.0.0.2")
        on_second = second.welcome()  # a new connection to the broker that came back
        others = echo_credit_until(
            lambda: settled(running, CAPACITY, at_first, at_second), first, second
        )
        assert not [m for m in others[0] if isinstance(m, wire.Bye)]  # the first was kept
        for broker, identity, job_id in ((first, on_first, b"a"), (second, on_second, b"b")):
            inputs = broker.job(identity, job_id)
            _identity, result = broker.expect(wire.Result)
            assert result.job_id == job_id
            assert (result.tensors.arrays()["z"] == inputs["x"] + 2 * inputs["y"]).all()
    finally:
        assert running.stop() == [0]


def test_a_job_past_the_connections_credit_is_refused_when_the_capacity_is_shared(
    brokers: tuple[FakeBroker, FakeBroker, FakeBroker, str],
) -> None:
    """With several brokers a job beyond what the connection was told (a broker that
    does not keep to its credit) would take the worker past its capacity: OVERLOADED,
    where a lone broker's extra jobs would wait (tests/worker/test_node.py)."""
    broker = brokers[0]
    pool = CreditPool(2)
    other = pool.share("elsewhere")
    assert other.hello(0) == 2  # another broker holds the whole capacity (unconfirmed)
    model = GatedAdd()
    config = WorkerConfig(broker=broker.endpoint, worker_id="w1", heartbeat_ms=50)
    node = WorkerNode(model.backend(), config, share=pool.share(broker.endpoint))
    thread = threading.Thread(target=node.run, daemon=True)
    thread.start()
    try:
        identity, hello = broker.expect(wire.Hello)
        assert hello.credit == 0
        broker.send(identity, wire.Welcome("epoch1", 50, 60_000))
        broker.job(identity, b"over")
        _identity, fail = broker.expect(wire.Fail)
        assert (fail.job_id, fail.code) == (b"over", "OVERLOADED")
        assert "more jobs than this connection's credit" in fail.message
        assert model.most_running == 0 and pool.held_max == 0
    finally:
        node.request_stop()
        thread.join(TIMEOUT)
