"""The blocking Client.infer's lighter future (:class:`~ipuserve.client.pending.Waiter`):
settled once, whoever comes first, and its caller woken by a reply, an error or close()."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import InvalidStateError
from typing import Any

import numpy as np
import pytest

from ipuserve import errors
from ipuserve import protocol as wire
from ipuserve.client import Client, ClientConfig
from ipuserve.client.pending import Pending, Waiter, parse_reply
from tests.client.fake_broker import FakeBroker, inputs

FAST = ClientConfig(ping_interval_s=0.05, liveness_s=0.5, reconnect_max_s=0.05)


@pytest.fixture
def broker() -> Iterator[FakeBroker]:
    fake = FakeBroker().start()
    yield fake
    fake.stop()


def test_the_first_settle_wins_and_a_later_one_is_refused() -> None:
    waiter: Waiter[int] = Waiter()
    assert not waiter.done()
    waiter.set_result(7)
    assert waiter.done()
    with pytest.raises(InvalidStateError):
        waiter.set_exception(errors.ClosedError("late"))
    assert waiter.result(0) == 7
    assert waiter.result() == 7  # done for good


def test_an_error_is_raised_and_pending_ignores_a_second_settle() -> None:
    waiter: Waiter[Any] = Waiter()
    pending = Pending(wire.ListModels(b"12345678"), waiter, None, parse_reply)
    pending.fail(errors.OverloadedError("full"))
    pending.succeed({"late": 1})  # the core's exactly-once: suppressed, not raised
    with pytest.raises(errors.OverloadedError, match="full"):
        waiter.result(0)


def test_a_wait_that_runs_out_is_a_timeout_error() -> None:
    with pytest.raises(TimeoutError):
        Waiter().result(0.001)


def _settle_when_both_ready(
    waiter: Waiter[str], start: threading.Barrier, value: str, refused: list[str]
) -> None:
    start.wait(10)
    try:
        waiter.set_result(value)
    except InvalidStateError:
        refused.append(value)


def test_racing_settles_leave_exactly_one_outcome() -> None:
    """A reply on the I/O thread and close() on another may settle at once."""
    for _ in range(200):
        waiter: Waiter[str] = Waiter()
        start = threading.Barrier(2)
        refused: list[str] = []
        threads = [
            threading.Thread(target=_settle_when_both_ready, args=(waiter, start, v, refused))
            for v in ("a", "b")
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert len(refused) == 1
        assert waiter.result(0) == ({"a", "b"} - set(refused)).pop()


def test_infer_returns_the_reply_through_the_waiter(broker: FakeBroker) -> None:
    with Client(broker.address, timeout=10, config=FAST) as client:
        given = inputs(3)
        outputs = client.infer("add", given)
        np.testing.assert_array_equal(outputs["y"], given["a"] + given["b"])


def test_close_wakes_an_infer_blocked_on_its_waiter(broker: FakeBroker) -> None:
    arrived = threading.Event()
    broker.handler = lambda _request: arrived.set()  # never answered
    client = Client(broker.address, timeout=None, config=FAST)
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            client.infer("add", inputs(1))
        except BaseException as exc:
            outcome.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    assert arrived.wait(10)
    client.close()
    caller.join(10)
    assert not caller.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], errors.ClosedError)
