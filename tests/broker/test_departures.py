"""A worker that drains and says BYE is counted as a departure, a worker that vanishes
as lost: real broker and worker processes, the counts read from the broker's /metrics."""

from __future__ import annotations

import os
import signal

import pytest

from tests.helpers import Processes, metric, scrape, start_broker, start_worker, wait_until

pytestmark = pytest.mark.slow

DEPARTURES = "ipuserve_broker_worker_departures_total"
LOST = "ipuserve_broker_workers_lost_total"
TRIES = 8


def test_an_idle_worker_stopping_is_a_departure_even_when_its_bye_is_read_late(
    processes: Processes,
) -> None:
    # a long liveness window: the broker stopped below must not find anyone silent
    broker = start_broker(processes, liveness_ms=20_000)

    def counts() -> tuple[float, float]:
        samples = scrape(broker.metrics_url)
        return metric(samples, DEPARTURES), metric(samples, LOST)

    # the broker keeps up: it reads the last heartbeat and the BYE while connected
    worker = start_worker(processes, broker)
    worker.terminate()
    assert worker.wait() == 0
    wait_until(lambda: counts() == (1, 0))

    # the broker is stopped while the worker drains, says BYE and closes: once resumed
    # it may echo the worker's last heartbeat (credit 0) to a connection already gone
    # and only then read the BYE behind it; this was counted lost ("unreachable"). Whether
    # its I/O thread sees the connection close before its loop reads the heartbeat is a
    # race (most tries here): tried until it happened, every try counted a departure
    late = r"said BYE after its connection closed: it left"
    departed = 1
    for _ in range(TRIES):
        worker = start_worker(processes, broker)
        since = broker.proc.mark()
        os.kill(broker.proc.pid, signal.SIGSTOP)
        try:
            worker.terminate()
            assert worker.wait() == 0
        finally:
            os.kill(broker.proc.pid, signal.SIGCONT)
        departed += 1
        wait_until(lambda: counts() == (departed, 0))  # noqa: B023  (called in the loop)
        # logged as it was dropped, before it was counted
        dropped = broker.proc.wait_for(r"dropped \((left|unreachable)\)", since=since)
        if dropped[1] == "unreachable":
            broker.proc.wait_for(late, since=since)  # ...and the BYE read after
            break
    else:
        pytest.fail(f"the broker never read a BYE after the connection closed in {TRIES} tries")

    # a worker killed says nothing: lost, once its connection is found gone
    worker = start_worker(processes, broker)
    worker.kill()
    wait_until(lambda: counts() == (departed, 1))
    samples = scrape(broker.metrics_url)
    assert samples[f'{DEPARTURES}{{reason="bye"}}'] == departed
    assert samples[f'{LOST}{{reason="unreachable"}}'] == 1
