"""Client against real processes: `ipuserve broker` and FunctionBackend workers."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from ipuserve import errors
from ipuserve.client.client import Client
from ipuserve.client.config import ClientConfig
from tests.client.faces import MakeClient
from tests.helpers import (
    BrokerProc,
    Processes,
    add_expected,
    add_inputs,
    fn_worker_argv,
    processes,  # noqa: F401  (a fixture)
    restart_broker,
    scrape,
    start_broker,
    start_worker,
    wait_until,
)

pytestmark = pytest.mark.slow
X = add_inputs()["x"]
FAST = ClientConfig(ping_interval_s=0.05, liveness_s=1.0)


@pytest.fixture
def broker(processes: Processes) -> BrokerProc:  # noqa: F811
    """A broker of its own; after a restart it queues requests until the worker is back."""
    return start_broker(processes, grace_ms=10_000)


@pytest.fixture(scope="module")
def served() -> Iterator[BrokerProc]:
    """One broker and worker for the tests that do not stop or slow them (saves seconds)."""
    procs = Processes()
    try:
        broker = start_broker(procs, "--max-payload-bytes", "65536")
        start_worker(procs, broker, fn_worker_argv("add", "--model", "fail"))
        yield broker
    finally:
        procs.close()


@pytest.fixture
def client(served: BrokerProc) -> Iterator[Client]:
    with Client(served.frontend, timeout=20, config=FAST) as c:
        yield c


def test_sync_and_async_results_equal_numpy(client: Client) -> None:
    given = add_inputs(rows=3, seed=1)
    np.testing.assert_allclose(client.infer("add", given)["z"], add_expected(given), rtol=1e-6)
    futures = [client.infer_async("add", add_inputs(rows=1 + i % 4, seed=i)) for i in range(20)]
    for i, future in enumerate(futures):
        expected = add_expected(add_inputs(rows=1 + i % 4, seed=i))
        np.testing.assert_allclose(future.result(20)["z"], expected, rtol=1e-6)
    timing = futures[-1].timing
    assert timing is not None and timing.worker_us > 0 and timing.total_us >= timing.worker_us


def test_threads_share_one_client_against_a_real_broker(client: Client) -> None:
    wrong: list[int] = []

    def caller(seed: int) -> None:
        for i in range(25):
            given = add_inputs(rows=2, seed=seed * 100 + i)
            if not np.allclose(client.infer("add", given)["z"], add_expected(given)):
                wrong.append(seed)

    threads = [threading.Thread(target=caller, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


def test_requests_sent_from_many_threads_each_get_their_one_reply(served: BrokerProc) -> None:
    """8 threads x 500 requests through one client, most sent from the callers' own
    threads (the short path), the rest handed to the I/O thread: each result is the
    numpy one for its own inputs, and each future settles once. The PING interval is
    long, so a reply the I/O thread missed would not be picked up by a periodic turn
    before ``result`` gives up."""
    threads, per_thread = 8, 500
    config = ClientConfig(ping_interval_s=30.0, liveness_s=60.0)
    settled: Counter[int] = Counter()
    wrong: list[int] = []

    def caller(client: Client, seed: int) -> None:
        for i in range(per_thread):
            key = seed * per_thread + i
            given = add_inputs(rows=1 + i % 3, seed=key)
            future = client.infer_async("add", given, copy=False)
            future.add_done_callback(lambda _f, key=key: settled.update([key]))
            if not np.allclose(future.result(20)["z"], add_expected(given), rtol=1e-6):
                wrong.append(key)

    with Client(served.frontend, timeout=120, config=config) as client:
        workers = [threading.Thread(target=caller, args=(client, s)) for s in range(threads)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        stats = client.stats
    total = threads * per_thread
    assert wrong == []
    assert len(settled) == total and set(settled.values()) == {1}
    assert (stats.sent, stats.replies, stats.expired) == (total, total, 0)
    assert 0 < stats.direct <= total  # the short path was taken


def test_models_lists_the_workers(client: Client) -> None:
    listed = {info.spec.name: info for info in client.models()}
    assert set(listed) == {"add", "fail"}
    assert len(listed["add"].workers) == 1 and listed["add"].workers[0].credit >= 1


@pytest.mark.parametrize(
    ("model", "inputs", "error", "match"),
    [
        ("nope", add_inputs(), errors.UnknownModelError, "nope"),
        (
            "add",
            {"x": add_inputs()["x"], "w": add_inputs()["y"]},
            errors.InvalidInputError,
            "missing: y",
        ),
        (
            "add",
            {k: v.astype(np.float64) for k, v in add_inputs().items()},
            errors.InvalidInputError,
            "float32",
        ),
        ("add", {k: v[:, :3] for k, v in add_inputs().items()}, errors.InvalidInputError, "shape"),
        ("add", add_inputs(rows=2000), errors.PayloadTooLargeError, "limit"),
        ("fail", {"x": add_inputs()["x"]}, errors.InferenceError, "fail"),
    ],
    ids=["unknown-model", "tensor-name", "dtype", "shape", "payload", "inference"],
)
def test_the_fabric_errors_are_raised_as_their_class(
    client: Client, model: str, inputs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match) as caught:
        client.infer(model, inputs)
    assert type(caught.value) is error


def test_a_slow_worker_makes_the_request_time_out(processes: Processes, broker: BrokerProc) -> None:  # noqa: F811
    start_worker(processes, broker, fn_worker_argv("add", "--delay-ms", "3000"))
    with (
        Client(broker.frontend, timeout=20, config=FAST) as client,
        pytest.raises(errors.DeadlineExceeded),
    ):
        client.infer("add", add_inputs(), timeout=0.3)


def test_pending_requests_survive_a_broker_restart_exactly_once(
    processes: Processes,  # noqa: F811
    broker: BrokerProc,
    make_client: MakeClient,
) -> None:
    start_worker(processes, broker, fn_worker_argv("add", "--delay-ms", "400"))
    given = [add_inputs(rows=1, seed=i) for i in range(6)]
    results: Counter[int] = Counter()
    with make_client(broker.frontend, timeout=30, config=FAST) as client:
        futures = [client.infer_async("add", g) for g in given]
        for i, future in enumerate(futures):
            future.add_done_callback(lambda _f, i=i: results.update([i]))
        client.models()  # ordered after the requests: the broker holds them all now
        # (counted per request: the six may travel as one group, one job)
        held = scrape(broker.metrics_url)
        assert held['ipuserve_broker_requests_total{model="add",version="1"}'] == 6
        restart_broker(processes, broker)
        for future, g in zip(futures, given, strict=True):
            np.testing.assert_allclose(future.result(30)["z"], add_expected(g), rtol=1e-6)
        assert client.stats.epoch_changes == 1 and client.stats.resent >= 6
    assert results == Counter(range(6))


def test_pending_requests_outlive_a_graceful_broker_restart(
    processes: Processes,  # noqa: F811
    broker: BrokerProc,
    make_client: MakeClient,
) -> None:
    """SIGTERM: the stopping broker answers what it holds BROKER_SHUTDOWN; the Client keeps
    those requests and the restarted broker serves them."""
    start_worker(processes, broker, fn_worker_argv("add", "--delay-ms", "400"))
    given = [add_inputs(rows=1, seed=i) for i in range(6)]
    with make_client(broker.frontend, timeout=30, config=FAST) as client:
        futures = [client.infer_async("add", g) for g in given]
        client.models()  # ordered after the requests: the broker holds them all now
        broker.proc.terminate()
        assert broker.proc.wait() == 0
        wait_until(lambda: client.stats.held_over_shutdown == 6)
        assert not any(future.done() for future in futures)
        restart_broker(processes, broker)
        for future, g in zip(futures, given, strict=True):
            np.testing.assert_allclose(future.result(30)["z"], add_expected(g), rtol=1e-6)
        assert client.stats.epoch_changes == 1


def test_a_request_held_over_a_shutdown_with_no_broker_back_fails_at_its_deadline(
    processes: Processes,  # noqa: F811
    broker: BrokerProc,
) -> None:
    start_worker(processes, broker, fn_worker_argv("add", "--delay-ms", "3000"))
    with Client(broker.frontend, timeout=30, config=FAST) as client:
        future = client.infer_async("add", add_inputs(), timeout=2.0)
        client.models()
        broker.proc.terminate()
        with pytest.raises(errors.DeadlineExceeded) as failed:
            future.result(30)
    assert str(failed.value).endswith(
        f": the broker at {broker.frontend} shut down and no broker has answered since"
    )


def test_close_fails_what_is_still_pending(processes: Processes, broker: BrokerProc) -> None:  # noqa: F811
    start_worker(processes, broker, fn_worker_argv("add", "--delay-ms", "3000"))
    client = Client(broker.frontend, timeout=None, config=FAST)
    futures = [client.infer_async("add", add_inputs(seed=i)) for i in range(3)]
    client.models()  # the broker has them
    client.close()
    for future in futures:
        with pytest.raises(errors.ClosedError):
            future.result(5)


def test_a_client_reusing_a_routing_id_gets_its_own_results_not_its_predecessors(
    broker: BrokerProc,
    processes: Processes,  # noqa: F811
) -> None:
    """Request ids once started at 1 in every Client; the broker takes (routing id,
    request id) for a re-send of a job it still holds, so a client restarted with a
    fixed routing_id got the dead one's result for the dead one's inputs."""
    worker = start_worker(processes, broker, fn_worker_argv("add", "--delay-ms", "1000"))
    config = ClientConfig(routing_id=b"svc-1", ping_interval_s=0.05, liveness_s=1.0)
    first, second = add_inputs(seed=1), add_inputs(seed=2)
    dead = Client(broker.frontend, timeout=20, config=config)
    dead.infer_async("add", first)
    worker.wait_for("running a job for 1000")  # the broker holds it: now it "dies"
    dead.close()
    with Client(broker.frontend, timeout=20, config=config) as reborn:
        got = reborn.infer("add", second)
    np.testing.assert_allclose(got["z"], add_expected(second), rtol=1e-6)
