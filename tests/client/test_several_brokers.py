"""A client with several brokers: spreading, failover with the same ids, coming back.

Real processes on loopback: two brokers, each with its own ``add`` worker (tests/
fn_worker.py), and one :class:`Client` given both frontends. Every result is checked
against numpy, and every request is settled exactly once (its future's one result).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import numpy as np
import pytest

from ipuserve.client import Client, ClientConfig
from tests.client.fake_broker import FakeBroker, add_handler
from tests.client.fake_broker import inputs as fake_inputs
from tests.helpers import (
    BrokerProc,
    Processes,
    add_expected,
    add_inputs,
    metric,
    restart_broker,
    scrape,
    start_broker,
    start_worker,
    wait_until,
)

#: a short liveness window: a silent broker is noticed quickly
CONFIG = ClientConfig(ping_interval_s=0.1, liveness_s=0.5, reconnect_max_s=0.1)


def accepted(broker: BrokerProc) -> float:
    """Requests the broker accepted, from its metrics."""
    return metric(scrape(broker.metrics_url), "ipuserve_broker_requests_total")


@pytest.fixture
def two_brokers(processes: Processes) -> tuple[BrokerProc, BrokerProc]:
    brokers = (start_broker(processes), start_broker(processes))
    for broker in brokers:
        start_worker(processes, broker)
    return brokers


def check(outputs: dict[str, Any], inputs: dict[str, Any]) -> None:
    np.testing.assert_allclose(outputs["z"], add_expected(inputs), rtol=1e-6)


def usable_links(client: Client) -> int:
    return sum(link.usable for link in client.links())


def test_requests_spread_over_both_brokers(two_brokers: tuple[BrokerProc, BrokerProc]) -> None:
    first, second = two_brokers
    with Client([first.frontend, second.frontend], timeout=20, config=CONFIG) as client:
        wait_until(lambda: usable_links(client) == 2)
        for i in range(40):  # one at a time: the round-robin among equals spreads them
            inputs = add_inputs(1 + i % 3, seed=i)
            check(client.infer("add", inputs), inputs)
        futures = [client.infer_async("add", add_inputs(2, seed=i)) for i in range(200)]
        for i, future in enumerate(futures):
            check(future.result(20), add_inputs(2, seed=i))
        assert client.stats.replies == 240
        assert client.stats.dropped_replies == 0
    counts = accepted(first), accepted(second)
    assert sum(counts) == 240
    assert min(counts) >= 40, counts  # neither broker was left out


def test_kill_one_broker_under_load_nothing_lost_nothing_twice(
    processes: Processes, two_brokers: tuple[BrokerProc, BrokerProc]
) -> None:
    first, second = two_brokers
    per_thread, threads = 150, 4
    settled: Counter[bytes] = Counter()
    lock = threading.Lock()
    failures: list[BaseException] = []
    progress = threading.Semaphore(0)
    times: list[float] = []

    def load(client: Client, seed: int) -> None:
        try:
            for i in range(per_thread):
                inputs = add_inputs(1 + i % 4, seed=seed * 1000 + i)
                future = client.infer_async("add", inputs)
                check(future.result(30), inputs)
                with lock:
                    settled[future.request_id] += 1
                    times.append(time.monotonic())
                progress.release()
        except BaseException as exc:  # reported by the test
            failures.append(exc)

    with Client([first.frontend, second.frontend], timeout=30, config=CONFIG) as client:
        wait_until(lambda: usable_links(client) == 2)
        workers = [threading.Thread(target=load, args=(client, s)) for s in range(threads)]
        for thread in workers:
            thread.start()
        for _ in range(threads * per_thread // 4):  # a quarter done: kill one broker
            assert progress.acquire(timeout=30)
        killed_at = time.monotonic()
        first.proc.kill()
        for thread in workers:
            thread.join(60)
        assert not failures, failures
        after = [t for t in times if t >= killed_at]
        gaps = np.diff([killed_at, *after])
        # the killed broker's requests went to the other at once (its connection
        # dropped), well within the liveness window
        assert client.stats.failovers >= 1
        assert gaps.max() < CONFIG.liveness_s, gaps.max()
        assert len(settled) == threads * per_thread
        assert set(settled.values()) == {1}
        stats = client.stats
        assert stats.replies == threads * per_thread
        # restarted, the broker gets new requests again
        first = restart_broker(processes, first)
        start_worker(processes, first)
        wait_until(lambda: usable_links(client) == 2, timeout=20)
        futures = [client.infer_async("add", add_inputs(1, seed=i)) for i in range(100)]
        for i, future in enumerate(futures):
            check(future.result(20), add_inputs(1, seed=i))
    assert accepted(first) > 0  # the new broker took part of the load again


def test_broker_silent_then_requests_move_with_the_same_ids(
    two_brokers: tuple[BrokerProc, BrokerProc],
) -> None:
    """SIGSTOP one broker: its connection stays up, it just stops answering. Its
    pending requests go to the other broker after the liveness window; when it is
    resumed it answers them too, and those second replies are dropped."""
    first, second = two_brokers
    with Client([first.frontend, second.frontend], timeout=20, config=CONFIG) as client:
        wait_until(lambda: usable_links(client) == 2)
        first.proc.popen.send_signal(19)  # SIGSTOP
        try:
            futures = [client.infer_async("add", add_inputs(1, seed=i)) for i in range(50)]
            for i, future in enumerate(futures):
                check(future.result(20), add_inputs(1, seed=i))
        finally:
            first.proc.popen.send_signal(18)  # SIGCONT
        moved = client.stats.failovers
        assert moved > 0  # some had gone to the stopped broker before it fell silent
        wait_until(lambda: client.stats.dropped_replies >= 1, timeout=20)
        assert client.stats.replies == 50


def test_a_duplicate_reply_settles_once() -> None:
    """Broker A falls silent holding a request; the client moves it to B, which
    answers; then A answers it too (the same id from two brokers): dropped, counted,
    and the future keeps B's one result."""
    a, b = FakeBroker().start(), FakeBroker().start()
    try:
        with Client([a.address, b.address], timeout=20, config=CONFIG) as client:
            wait_until(lambda: usable_links(client) == 2)
            a.silent = True
            both = [client.infer_async("add", fake_inputs(seed)) for seed in (1, 2)]
            for seed, future in zip((1, 2), both, strict=True):
                x = fake_inputs(seed)
                np.testing.assert_allclose(future.result(20)["y"], x["a"] + x["b"], rtol=1e-6)
            assert client.stats.failovers == 1
            (held,) = a.requests  # the one that went to A first
            b_answers = [r.request_id for r in b.requests]
            assert b_answers.count(held.request_id) == 1  # moved with the same id
            before = client.stats.replies
            a.send_raw(add_handler(held).encode())
            wait_until(lambda: client.stats.dropped_replies == 1)
            assert client.stats.replies == before
    finally:
        a.stop()
        b.stop()
