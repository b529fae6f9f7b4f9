"""AsyncClient, the asyncio face of the one client core, against a real ROUTER peer
(tests/client/fake_broker.py): results, errors, deadlines, several brokers, closing.

Each test runs its coroutine with ``asyncio.run`` in its body; the guarantees the two
faces share (exactly once, failover, re-sending) run against both in
test_client.py, test_fabric.py, test_several_brokers.py and tests/integration.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from ipuserve import errors
from ipuserve import protocol as wire
from ipuserve.client import AsyncClient, Client, ClientConfig
from tests.client.fake_broker import FakeBroker, add_handler, inputs
from tests.helpers import wait_until

FAST = ClientConfig(ping_interval_s=0.05, liveness_s=0.5)


@pytest.fixture
def broker() -> Iterator[FakeBroker]:
    fake = FakeBroker().start()
    yield fake
    fake.stop()


def expected(given: dict[str, np.ndarray[Any, Any]]) -> np.ndarray[Any, Any]:
    return given["a"] + given["b"]


def test_infer_and_infer_timed_return_the_numpy_result(broker: FakeBroker) -> None:
    async def run() -> None:
        async with AsyncClient(broker.address, timeout=10, config=FAST) as client:
            given = inputs(1)
            outputs = await client.infer("add", given)
            np.testing.assert_array_equal(outputs["y"], expected(given))
            assert not outputs["y"].flags.writeable  # a view of the received frame
            outputs, timing = await client.infer_timed("add", inputs(2))
            np.testing.assert_array_equal(outputs["y"], expected(inputs(2)))
            assert timing.device_us == 11.0 and timing.total_us > 0
            # (whether a request left from the coroutine or from a turn depends on
            # what the event loop had scheduled: not asserted)
            assert client.stats.replies == 2 and client.stats.sent == 2

    asyncio.run(run())


def test_many_coroutines_each_get_their_one_result_and_leave_together(
    broker: FakeBroker,
) -> None:
    async def run() -> None:
        async with AsyncClient(broker.address, timeout=10, config=FAST) as client:
            given = [inputs(i) for i in range(300)]
            results = await asyncio.gather(*(client.infer("add", g) for g in given))
            for outputs, g in zip(results, given, strict=True):
                np.testing.assert_array_equal(outputs["y"], expected(g))
            stats = client.stats
            assert stats.replies == 300 and stats.dropped_replies == 0
            assert stats.batched > 0  # one turn's requests went as REQUESTS messages

    asyncio.run(run())
    assert broker.batches > 0


def test_reported_errors_and_local_mistakes_raise_as_with_client(broker: FakeBroker) -> None:
    def refuse(request: wire.Request) -> wire.Message:
        return wire.ErrorReply(request.request_id, "UNKNOWN_MODEL", "told UnknownModelError")

    async def run() -> None:
        async with AsyncClient(broker.address, timeout=10, config=FAST) as client:
            broker.handler = refuse
            with pytest.raises(errors.UnknownModelError, match="told UnknownModelError"):
                await client.infer("add", inputs())
            with pytest.raises(errors.InvalidInputError, match="numpy array"):
                await client.infer("add", {"a": [1.0]})
            with pytest.raises(errors.ConfigError, match="timeout must be seconds > 0"):
                await client.infer("add", inputs(), timeout=-1)
            broker.handler = add_handler
            np.testing.assert_array_equal((await client.infer("add", inputs()))["y"],
                                          expected(inputs()))  # fmt: skip

    asyncio.run(run())


def test_no_reply_within_the_timeout_raises_deadline_exceeded(broker: FakeBroker) -> None:
    broker.handler = lambda r: None

    async def run() -> None:
        async with AsyncClient(broker.address, timeout=10, config=FAST) as client:
            with pytest.raises(errors.DeadlineExceeded, match=r"no reply within 0\.2 s \("):
                await client.infer("add", inputs(), timeout=0.2)
            assert client.stats.expired == 1

    asyncio.run(run())


def test_nothing_listening_says_nothing_ever_answered() -> None:
    async def run() -> None:
        async with AsyncClient("tcp://127.0.0.1:9", timeout=0.3) as client:
            with pytest.raises(errors.DeadlineExceeded, match="nothing has answered"):
                await client.infer("add", inputs())

    asyncio.run(run())


def test_models_of_several_brokers_are_merged_as_client_merges_them() -> None:
    a, b = FakeBroker().start(), FakeBroker().start()
    try:
        endpoints = [a.address, b.address]

        async def run() -> list[wire.ModelInfo]:
            async with AsyncClient(endpoints, timeout=10, config=FAST) as client:
                await asyncio.sleep(0)  # (nothing to wait for: links are made at once)
                assert sorted(link.endpoint for link in client.links()) == sorted(endpoints)
                return await client.models()

        merged = asyncio.run(run())
        with Client(endpoints, timeout=10, config=FAST) as client:
            wait_until(lambda: all(link.usable for link in client.links()))
            assert merged == client.models()
        (model,) = merged
        assert model.workers[0].credit == 16  # w1 on both brokers: one worker, added up
    finally:
        a.stop()
        b.stop()


def test_close_fails_what_is_pending_and_refuses_new_requests(broker: FakeBroker) -> None:
    broker.handler = lambda r: None

    async def run() -> None:
        client = AsyncClient(broker.address, timeout=10, config=FAST)
        pending = asyncio.ensure_future(client.infer("add", inputs()))
        wait_for = asyncio.get_running_loop().run_in_executor
        await wait_for(None, wait_until, lambda: len(broker.requests) == 1)
        await client.aclose()
        with pytest.raises(errors.ClosedError):
            await pending
        with pytest.raises(errors.ClosedError):
            await client.infer("add", inputs())

    asyncio.run(run())


def test_a_client_serves_the_event_loop_it_was_first_used_on(broker: FakeBroker) -> None:
    client = AsyncClient(broker.address, timeout=10, config=FAST)
    try:
        given = inputs(4)
        outputs = asyncio.run(client.infer("add", given))
        np.testing.assert_array_equal(outputs["y"], expected(given))
        with pytest.raises(errors.RuntimeUsageError, match="event loop it was first used on"):
            asyncio.run(client.infer("add", given))
    finally:
        client.close()
