"""Broker tests: an in-process broker on a thread, raw DEALER peers, and process fixtures."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from ipuserve.broker.config import BrokerConfig
from ipuserve.broker.loop import Broker
from tests.helpers import RawClient, processes  # noqa: F401  (processes: a fixture)

StartBroker = Callable[..., Broker]


@pytest.fixture
def start_broker_thread() -> Iterator[StartBroker]:
    """Start Broker(config) on a thread; stopped and joined at teardown."""
    started: list[tuple[Broker, threading.Thread]] = []

    def start(**overrides: Any) -> Broker:
        settings: dict[str, Any] = {
            "frontend": "tcp://127.0.0.1:*",
            "backend": "tcp://127.0.0.1:*",
            "heartbeat_ms": 50,
            "liveness_ms": 5000,
            "grace_ms": 0,
            **overrides,
        }
        broker = Broker(BrokerConfig(**settings))
        thread = threading.Thread(target=broker.run, name="broker", daemon=True)
        thread.start()
        started.append((broker, thread))
        return broker

    yield start
    for broker, thread in started:
        broker.stop()
        thread.join(timeout=10)
        assert not thread.is_alive(), "the broker loop did not stop"


@pytest.fixture
def broker(start_broker_thread: StartBroker) -> Broker:
    """A broker on a thread with the default test settings."""
    return start_broker_thread()


@pytest.fixture
def client(broker: Broker) -> Iterator[RawClient]:
    """A bare DEALER on that broker's frontend."""
    with RawClient(broker.frontend_endpoint) as raw:
        yield raw
