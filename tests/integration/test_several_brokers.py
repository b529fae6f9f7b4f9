"""Two brokers, no single point of failure: three `ipuserve worker` processes registered
with both, one Client with both frontends shared by eight threads, kill -9 of a broker
under load and its restart (issue 17). Every result is checked against numpy."""

from __future__ import annotations

import re
import threading
import time

import pytest

from ipuserve.client.config import ClientConfig
from tests.client.faces import MakeClient
from tests.helpers import (
    BrokerProc,
    Proc,
    Processes,
    metric,
    restart_broker,
    runner_worker_argv,
    scrape,
    start_broker,
    start_worker,
    wait_registered,
    wait_until,
)
from tests.integration.fleet import (
    RESULT_TIMEOUT_S,
    Model,
    after,
    assert_all_correct,
    drive,
    longest_gap,
    mixed_plan,
)

pytestmark = pytest.mark.slow

_METRICS = r"ipuserve worker: metrics on (http://\S+/metrics)"


def serve_both(
    procs: Processes, brokers: list[BrokerProc], model: Model, name: str
) -> tuple[Proc, str]:
    """A worker registered with every broker; its metrics URL."""
    extra = [part for b in brokers[1:] for part in ("--broker", b.backend)]
    argv = runner_worker_argv(model.path, args=(*extra, "--metrics-port", "0"))
    proc = start_worker(procs, brokers[0], argv, name=name)
    for broker in brokers[1:]:
        wait_registered(proc, broker)
    found = re.search(_METRICS, proc.output())
    assert found, "the worker did not say where its metrics are"
    return proc, found[1]


def test_two_brokers_three_workers_kill_9_of_a_broker_and_its_restart(
    procs: Processes, models: dict[str, Model], make_client: MakeClient
) -> None:
    brokers = [start_broker(procs, liveness_ms=400), start_broker(procs, liveness_ms=400)]
    workers = [
        serve_both(procs, brokers, models["mlp"], "mlp-1"),
        serve_both(procs, brokers, models["mlp"], "mlp-2"),
        serve_both(procs, brokers, models["simple"], "simple-1"),
    ]
    liveness_s = ClientConfig().liveness_s
    answered = threading.Semaphore(0)
    killed_at: list[float] = []

    def kill_first() -> None:
        killed_at.append(time.monotonic())
        brokers[0].proc.kill()

    killer = threading.Thread(target=lambda: after(answered, 3000, kill_first))
    killer.start()
    frontends = [b.frontend for b in brokers]
    with make_client(frontends, timeout=RESULT_TIMEOUT_S) as client:
        listed = {info.spec.name: len(info.workers) for info in client.models()}
        assert listed == {"mlp": 2, "simple": 1}  # the fleet as one: each worker once
        first = drive(client, mixed_plan(models, 10_000), window=16, progress=answered)
        killer.join(RESULT_TIMEOUT_S)
        assert brokers[0].proc.wait() != 0 and killed_at  # it really died mid-load

        # nothing lost, nothing answered twice, every result right
        assert len(first) == 10_000
        assert_all_correct(first)
        gap = longest_gap(first, since=killed_at[0])
        assert gap < liveness_s, f"{gap:.2f} s without a result after the kill"

        # the broker comes back on the same ports: workers and the client find it
        marks = [proc.mark() for proc, _url in workers]
        restarted = restart_broker(procs, brokers[0])
        for (proc, _url), mark in zip(workers, marks, strict=True):
            wait_registered(proc, restarted, since=mark)
        wait_until(
            lambda: {(i.usable, i.epoch) for i in client.links()} >= {(True, restarted.epoch)}
        )
        second = drive(client, mixed_plan(models, 2000, seed=1), window=16)
        assert_all_correct(second)
    restarted_served = metric(scrape(restarted.metrics_url), "ipuserve_broker_requests_total")
    other_served = metric(scrape(brokers[1].metrics_url), "ipuserve_broker_requests_total")
    # the load spread back: the restarted broker took a fair part of the last 2,000
    assert restarted_served >= 400, (restarted_served, other_served)

    for _proc, url in workers:  # no worker ever held more than its capacity
        samples = scrape(url)
        capacity = metric(samples, "ipuserve_worker_capacity")
        assert 0 < metric(samples, "ipuserve_worker_jobs_held_max") <= capacity, url
