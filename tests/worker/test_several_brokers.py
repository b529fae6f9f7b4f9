"""One worker process serving two brokers (real processes on loopback): it registers
with both, serves both, never holds more jobs than its capacity in all (from its
metrics), moves credit to the broker that has the traffic, and outlives one of them."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from ipuserve import protocol as wire
from tests.helpers import (
    BrokerProc,
    Load,
    Proc,
    Processes,
    RawClient,
    add_inputs,
    assert_add_reply,
    fn_worker_argv,
    metric,
    restart_broker,
    scrape,
    start_broker,
    wait_registered,
    write_example,
)

pytestmark = pytest.mark.slow

CAPACITY = 4


def start_two_broker_worker(
    processes: Processes, first: BrokerProc, second: BrokerProc, *args: str
) -> tuple[Proc, str]:
    """A FunctionBackend worker registered with both brokers; its metrics URL."""
    argv = fn_worker_argv("add", "--broker", second.backend, "--metrics-port", "0", *args)
    worker = processes.start("worker", argv(first.backend))
    url = worker.wait_for(r"metrics on (\S+)")[1]
    wait_registered(worker, first)
    wait_registered(worker, second)
    return worker, url


def worker_credit(client: RawClient, worker_id: str) -> int | None:
    """The credit ``worker_id`` has at the broker ``client`` talks to (MODELS)."""
    for info in client.models():
        for load in info.workers:
            if load.worker_id == worker_id:
                return load.credit
    return None


def held_within_capacity(url: str) -> dict[str, float]:
    samples = scrape(url)
    assert metric(samples, "ipuserve_worker_capacity") == CAPACITY
    assert metric(samples, "ipuserve_worker_jobs_held") <= CAPACITY
    assert metric(samples, "ipuserve_worker_jobs_held_max") <= CAPACITY
    return samples


def test_a_worker_serves_two_brokers_and_never_holds_more_than_its_capacity(
    processes: Processes,
) -> None:
    first, second = start_broker(processes), start_broker(processes)
    _worker, url = start_two_broker_worker(
        processes, first, second, "--credit", str(CAPACITY), "--threads", "4",
        "--delay-ms", "2", "--worker-id", "both",
    )  # fmt: skip
    loads: list[Load] = []
    errors: list[BaseException] = []

    def drive(broker: BrokerProc, prefix: bytes) -> None:
        try:
            with RawClient(broker.frontend) as client:
                load = Load(client, total=300, window=8, prefix=prefix)
                loads.append(load)
                load.run()
        except BaseException as error:  # reported below, on the test's thread
            errors.append(error)

    threads = [
        threading.Thread(target=drive, args=(first, b"A")),
        threading.Thread(target=drive, args=(second, b"B")),
    ]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        held_within_capacity(url)  # scraped under load from both brokers
        threads[0].join(0.05)
    for thread in threads:
        thread.join()
    assert not errors, errors
    for load in loads:
        load.check()  # every request answered once, equal to numpy's x + 2y
    samples = held_within_capacity(url)
    assert metric(samples, "ipuserve_worker_jobs_held_max") >= 2  # both brokers' jobs at once
    credits = {
        broker.backend: samples[f'ipuserve_worker_broker_credit{{broker="{broker.backend}"}}']
        for broker in (first, second)
    }
    assert sum(credits.values()) <= CAPACITY and min(credits.values()) >= 1
    for broker in (first, second):
        with RawClient(broker.frontend) as client:
            assert worker_credit(client, "both") == credits[broker.backend]


def test_credit_moves_to_the_broker_with_the_traffic(processes: Processes) -> None:
    busy, idle = start_broker(processes), start_broker(processes)
    _worker, url = start_two_broker_worker(
        processes, busy, idle, "--credit", str(CAPACITY), "--threads", str(CAPACITY),
        "--delay-ms", "20", "--worker-id", "shifting",
    )  # fmt: skip
    with RawClient(busy.frontend) as client, RawClient(idle.frontend) as other:
        load = Load(client, total=2000, window=3 * CAPACITY)
        # the busy broker ends with all but the idle one's 1 (the split starts even)
        load.run(until=20)
        while worker_credit(client, "shifting") != CAPACITY - 1:
            load.run(until=min(load.total, load.answered + 10))
            assert load.answered < load.total, "the credit never moved to the busy broker"
        assert worker_credit(other, "shifting") == 1
        samples = held_within_capacity(url)
        assert samples[f'ipuserve_worker_broker_credit{{broker="{busy.backend}"}}'] == 3
        load.total = load.sent  # what is in flight, then no more
        load.run()
        for request_id in load.order[: load.sent]:
            (reply,) = load.replies[request_id]  # answered once, equal to x + 2y
            assert_add_reply(reply, load.inputs[request_id])
        # the idle broker still serves at once with its one credit
        inputs = add_inputs(3, seed=7)
        assert_add_reply(other.call("add", inputs), inputs)


def test_kill_9_of_one_broker_the_worker_serves_the_other_and_rejoins_the_restarted(
    processes: Processes,
) -> None:
    doomed, steady = start_broker(processes), start_broker(processes)
    worker, url = start_two_broker_worker(
        processes, doomed, steady, "--credit", str(CAPACITY), "--delay-ms", "2"
    )
    with RawClient(steady.frontend) as client:
        load = Load(client, total=400, window=8)
        load.run(until=100)
        mark = worker.mark()
        doomed.proc.kill()  # kill -9: the worker's jobs of it are lost with it
        load.run(until=250)  # the other broker is served meanwhile
        restarted = restart_broker(processes, doomed)
        wait_registered(worker, restarted, since=mark)
        load.run()
        load.check()
    with RawClient(restarted.frontend) as client:
        inputs = add_inputs(2, seed=3)
        assert_add_reply(client.call("add", inputs), inputs)
    held_within_capacity(url)


def test_the_broker_env_var_takes_a_space_separated_list(
    processes: Processes, tmp_path: Path
) -> None:
    """`ipuserve worker` (a ModelRunner) from IPUSERVE_WORKER_BROKER alone: one "joined"
    line per broker, requests answered through each."""
    model = write_example(tmp_path / "noop.popef", "noop", "--elements", "8")
    first, second = start_broker(processes), start_broker(processes)
    argv = [sys.executable, "-m", "ipuserve", "--log-level", "INFO", "worker", "--model", model]
    env = {
        "IPUSERVE_WORKER_BROKER": f" {first.backend}  {second.backend} ",
        "IPUSERVE_WORKER_HEARTBEAT_MS": "50",
    }
    worker = processes.start("worker", argv, env)
    for broker in (first, second):
        worker.wait_for(rf"worker \S+ joined the broker at {broker.backend}, serving noop")
        wait_registered(worker, broker)
    for broker in (first, second):
        with RawClient(broker.frontend) as client:
            inputs = {"input": np.arange(16, dtype=np.float32).reshape(2, 8)}
            reply = client.call("noop", inputs)
            assert isinstance(reply, wire.Reply), reply
            np.testing.assert_array_equal(reply.tensors.arrays()["output"], inputs["input"])
    worker.terminate()
    assert worker.wait() == 0
    joined = [line for line in worker.lines if "joined the broker at" in line]
    assert len(joined) == 2
    drained = [line for line in worker.lines if "drained: finished" in line]
    assert len(drained) == 2  # SIGTERM drained the connection to each broker
