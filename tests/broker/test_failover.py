"""The fabric under trouble, with real broker and worker processes on loopback."""

from __future__ import annotations

import pytest

from ipuserve import protocol as wire
from tests.helpers import (
    Load,
    Processes,
    RawClient,
    add_inputs,
    assert_add_reply,
    fn_worker_argv,
    metric,
    restart_broker,
    scrape,
    start_broker,
    start_worker,
    wait_registered,
)

pytestmark = pytest.mark.slow


def no_stray_replies(client: RawClient) -> None:
    """A PING answered after everything else, and nothing else arriving with it."""
    client.send(wire.Ping(b"last"))
    assert isinstance(client.recv(), wire.Pong)
    assert not client.socket.poll(200), "an extra reply arrived"


def test_kill_9_of_a_worker_under_load_answers_every_request_exactly_once(
    processes: Processes,
) -> None:
    broker = start_broker(processes)
    argv = fn_worker_argv("add", "--delay-ms", "5", "--credit", "4")
    victim = start_worker(processes, broker, argv, name="victim")
    start_worker(processes, broker, argv, name="survivor")
    with RawClient(broker.frontend) as client:
        load = Load(client, total=300, window=32)
        load.run(until=60)
        victim.kill()
        load.run()
        load.check(exactly_once=True)
        no_stray_replies(client)
        assert len(client.models()[0].workers) == 1
    samples = scrape(broker.metrics_url)
    assert metric(samples, "ipuserve_broker_workers_lost_total") == 1
    assert metric(samples, "ipuserve_broker_requeued_total") >= 1


def test_workers_re_register_by_themselves_after_a_broker_restart_under_load(
    processes: Processes,
) -> None:
    broker = start_broker(processes, liveness_ms=1000, grace_ms=5000)
    argv = fn_worker_argv("add", "--delay-ms", "2")
    workers = [start_worker(processes, broker, argv) for _ in range(2)]
    with RawClient(broker.frontend) as client:
        load = Load(client, total=200, window=16)
        load.run(until=40)
        marks = [w.mark() for w in workers]
        broker = restart_broker(processes, broker)
        while client.socket.poll(0):  # replies the old broker sent before it died
            load.take(client.recv())
        for request_id in load.unanswered():  # what the old broker took to its grave
            load.send(request_id)
        load.run()
        for worker, mark in zip(workers, marks, strict=True):
            wait_registered(worker, broker, since=mark)
        load.check(exactly_once=False)
        assert len(client.models()[0].workers) == 2


def test_deadlines_expire_and_full_queues_overload(processes: Processes) -> None:
    broker = start_broker(processes, "--queue-limit", "2")
    start_worker(processes, broker, fn_worker_argv("add", "--delay-ms", "300", "--credit", "1"))
    with RawClient(broker.frontend) as client:
        inputs = add_inputs(2)
        served = client.request("add", inputs)
        expiring = client.request("add", inputs, timeout_ms=50)
        queued = client.request("add", inputs)
        refused = client.request("add", inputs)
        replies = {}
        while len(replies) < 4:
            reply = client.recv()
            replies[reply.request_id] = reply  # type: ignore[union-attr]
    assert replies[refused].code == "OVERLOADED"  # type: ignore[union-attr]
    assert replies[expiring].code == "DEADLINE_EXCEEDED"  # type: ignore[union-attr]
    assert_add_reply(replies[served], inputs)
    assert_add_reply(replies[queued], inputs)


def test_a_stalled_client_does_not_slow_the_others(processes: Processes) -> None:
    broker = start_broker(processes, "--client-hwm", "2", "--client-backlog", "8")
    argv = fn_worker_argv("add", "--model", "echo", "--echo-bytes", str(256 << 10), "--credit", "8")
    start_worker(processes, broker, argv)
    blob = {"x": bytes(256 << 10)}
    with RawClient(broker.frontend, rcvhwm=1) as stalled, RawClient(broker.frontend) as active:
        import numpy as np

        payload = {"x": np.frombuffer(blob["x"], np.uint8).reshape(1, -1)}
        for _ in range(60):
            stalled.request("echo", payload)  # and never read a reply
        load = Load(active, total=200, window=8)
        load.run(timeout=10)
        load.check()
    samples = scrape(broker.metrics_url)
    assert samples['ipuserve_broker_dropped_total{reason="client_backlog_full"}'] > 0
