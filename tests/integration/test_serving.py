"""The serving system end to end: real broker and `ipuserve worker` processes (ModelRunners on
simulated IPUs), the real Client shared by eight threads, every result against numpy."""

from __future__ import annotations

import threading

import pytest

from ipuserve.client import Client
from tests.client.faces import MakeClient
from tests.helpers import (
    BrokerProc,
    Processes,
    metric,
    restart_broker,
    scrape,
    start_broker,
    wait_registered,
)
from tests.integration.fleet import (
    RESULT_TIMEOUT_S,
    Model,
    after,
    assert_all_correct,
    drive,
    mixed_plan,
    serve,
)

pytestmark = pytest.mark.slow


def test_ten_thousand_requests_three_workers_two_models(
    procs: Processes, models: dict[str, Model]
) -> None:
    broker = start_broker(procs)
    serve(procs, broker, models["mlp"], "mlp-1")
    serve(procs, broker, models["mlp"], "mlp-2")
    serve(procs, broker, models["simple"], "simple-1")
    with Client(broker.frontend, timeout=RESULT_TIMEOUT_S) as client:
        listed = {info.spec.name: len(info.workers) for info in client.models()}
        assert listed == {"mlp": 2, "simple": 1}
        outcomes = drive(client, mixed_plan(models, 10_000), window=16)
        assert client.stats.resent == 0
    assert len(outcomes) == 10_000
    assert_all_correct(outcomes)


def test_kill_9_of_a_worker_under_load(
    procs: Processes, models: dict[str, Model], make_client: MakeClient
) -> None:
    # liveness 1 s: short enough to notice the kill mid-load, long enough that the
    # survivor, stalled by a loaded machine, is not dropped as silent too (it was, at
    # 400 ms, once in a full suite run beside three other test runs)
    broker = start_broker(procs, liveness_ms=1000)
    victim = serve(procs, broker, models["mlp"], "victim")
    serve(procs, broker, models["mlp"], "survivor")
    plan = [(models["mlp"], 1 + i % 8) for i in range(3000)]
    answered = threading.Semaphore(0)
    killer = threading.Thread(target=lambda: after(answered, 500, victim.kill))
    killer.start()
    with make_client(broker.frontend, timeout=RESULT_TIMEOUT_S) as client:
        outcomes = drive(client, plan, window=16, progress=answered)
        stats = client.stats
    killer.join(RESULT_TIMEOUT_S)
    assert victim.wait() != 0  # it really died mid-load
    assert len(outcomes) == 3000
    assert_all_correct(outcomes)
    samples = scrape(broker.metrics_url)
    # The broker noticed the one loss and re-sent what the victim held to the survivor...
    lost = {k: v for k, v in samples.items() if k.startswith("ipuserve_broker_workers_lost")}
    assert metric(samples, "ipuserve_broker_workers_lost_total") == 1, lost
    assert metric(samples, "ipuserve_broker_requeued_total") >= 1
    # ...and answered each request exactly once: one job and one reply per call, and
    # no reply reached the client that no caller was waiting for (a duplicate).
    assert metric(samples, "ipuserve_broker_requests_total") == 3000
    assert metric(samples, "ipuserve_broker_replies_total") == 3000
    assert metric(samples, "ipuserve_broker_errors_total") == 0
    assert (stats.sent, stats.replies, stats.dropped_replies) == (3000, 3000, 0)
    assert stats.grouped > 0  # groups were in flight when the worker died (~90 % here)


def test_broker_restart_under_load(
    procs: Processes, models: dict[str, Model], make_client: MakeClient
) -> None:
    broker = start_broker(procs, grace_ms=5000)
    worker = serve(procs, broker, models["simple"], "simple-1")
    plan = [(models["simple"], 1 + i % 8) for i in range(3000)]
    answered = threading.Semaphore(0)
    restarted: list[BrokerProc] = []

    def restart() -> None:
        mark = worker.mark()
        restarted.append(restart_broker(procs, broker))
        wait_registered(worker, restarted[0], since=mark)  # the worker came back by itself

    restarter = threading.Thread(target=lambda: after(answered, 800, restart))
    restarter.start()
    with make_client(broker.frontend, timeout=RESULT_TIMEOUT_S) as client:
        outcomes = drive(client, plan, window=16, progress=answered)
        epoch_changes = client.stats.epoch_changes
        grouped = client.stats.grouped
    restarter.join(RESULT_TIMEOUT_S)
    assert restarted and restarted[0].epoch != broker.epoch
    assert epoch_changes >= 1  # the client noticed the new broker and re-sent
    assert grouped > 0  # groups were in flight across the restart (~90 % here)
    assert len(outcomes) == 3000
    assert_all_correct(outcomes)
