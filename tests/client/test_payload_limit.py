"""Requests beyond the broker's payload limit fail with PayloadTooLargeError, never hang.

A frame far beyond the limit would make the broker's ZeroMQ drop the connection
(ZMQ_MAXMSGSIZE), and then nobody could answer: the client learns the limit from
PONG and refuses such a request itself -- even as its very first request.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest

from ipuserve import errors, transport
from ipuserve.client.client import Client
from ipuserve.client.config import ClientConfig
from tests.helpers import (
    BrokerProc,
    Processes,
    add_expected,
    add_inputs,
    fn_worker_argv,
    restart_broker,
    scrape,
    start_broker,
    start_worker,
    wait_until,
)

pytestmark = pytest.mark.slow
LIMIT = 65536


@pytest.fixture(scope="module")
def served() -> Iterator[BrokerProc]:
    procs = Processes()
    try:
        broker = start_broker(procs, "--max-payload-bytes", str(LIMIT))
        start_worker(procs, broker, fn_worker_argv("add"))
        yield broker
    finally:
        procs.close()


def huge_inputs(frame_bytes: int) -> dict[str, np.ndarray]:
    """The add model's x and y, each a frame of about ``frame_bytes`` (whole rows)."""
    rows = frame_bytes // (8 * 4)
    return {"x": np.zeros((rows, 8), np.float32), "y": np.zeros((rows, 8), np.float32)}


@pytest.mark.parametrize(
    "frame_bytes",
    [LIMIT + 4096, transport.max_frame_bytes(LIMIT) + 4096],
    ids=["over-the-limit", "over-what-zeromq-accepts"],
)
def test_an_oversized_first_request_is_refused_and_the_client_goes_on(
    served: BrokerProc, frame_bytes: int
) -> None:
    with Client(served.frontend, timeout=30) as client:
        with pytest.raises(errors.PayloadTooLargeError, match=str(LIMIT)):
            client.infer("add", huge_inputs(frame_bytes))
        assert client.stats.max_payload_bytes == LIMIT
        given = add_inputs(rows=3, seed=7)
        np.testing.assert_allclose(client.infer("add", given)["z"], add_expected(given), rtol=1e-6)


def test_without_a_timeout_an_oversized_request_still_fails(served: BrokerProc) -> None:
    with Client(served.frontend, timeout=None) as client:
        future = client.infer_async("add", huge_inputs(transport.max_frame_bytes(LIMIT) * 2))
        error = future.exception(timeout=30)  # a backstop: the failure comes at the first PONG
        assert isinstance(error, errors.PayloadTooLargeError)


def test_a_group_of_requests_stays_within_the_limit(served: BrokerProc) -> None:
    """64 requests of 60 KiB made in one turn: together they would make frames of
    about 2 MiB, which the broker's ZeroMQ would refuse (and drop the client); the
    client groups at most the limit's worth of them."""
    rows = 960  # x and y: 30 KiB each, 60 KiB a request (within the limit, batched)
    given = [
        {k: np.full((rows, 8), seed + i, np.float32) for i, k in enumerate("xy")}
        for seed in range(64)
    ]
    config = ClientConfig(batch_requests=64)
    with Client(served.frontend, timeout=30, config=config) as client:
        client.infer("add", add_inputs(rows=1))  # the limit is known from here on
        fanned_out: Future[list[Future[Any]]] = Future()
        first = client.infer_async("add", add_inputs(rows=1))
        first.add_done_callback(  # on the I/O thread: all 64 in one turn, one batch
            lambda _f: fanned_out.set_result([client.infer_async("add", g) for g in given])
        )
        for future, inputs in zip(fanned_out.result(30), given, strict=True):
            np.testing.assert_allclose(future.result(30)["z"], add_expected(inputs), rtol=1e-6)
        assert client.stats.batched >= 64 and client.stats.resent == 0


def test_a_broker_back_with_a_smaller_limit_refuses_what_exceeds_it_once(
    processes: Processes,
) -> None:
    """The client re-sent its pending requests on reconnecting, under the limit it had
    learned from the old broker: a 3 MiB frame broke each new connection at once
    (beyond the new broker's limit + slack, ZeroMQ drops it), 819 reconnections in 40 s,
    and neither that request nor a small one beside it ever completed."""
    procs = processes
    old = start_broker(procs, grace_ms=60_000)  # no worker: requests wait in the grace
    with Client(old.frontend, timeout=None) as client:
        client.models()  # learns the old broker's limit, 64 MiB
        small, big = add_inputs(rows=2, seed=1), huge_inputs(3 << 20)
        answers = [client.infer_async("add", small), client.infer_async("add", big)]
        wait_until(lambda: _received(old) >= 2)
        old.proc.kill()
        wait_until(lambda: not any(k.liveness.connected for k in client._io.core.links.values()))
        # sent while no broker is there: it must not wait in ZeroMQ's pipe for the next
        answers.append(client.infer_async("add", huge_inputs(6 << 20)))
        new = restart_broker(procs, old, "--max-payload-bytes", str(1 << 20))
        start_worker(procs, new, fn_worker_argv("add"))
        np.testing.assert_allclose(answers[0].result(30)["z"], add_expected(small), rtol=1e-6)
        for oversized in answers[1:]:
            with pytest.raises(errors.PayloadTooLargeError, match=str(1 << 20)):
                oversized.result(30)
        assert client.stats.reconnects == 1, client.stats


def _received(broker: BrokerProc) -> float:
    assert broker.metrics_url
    metrics = scrape(broker.metrics_url)
    return sum(v for k, v in metrics.items() if k.startswith("ipuserve_broker_requests_total"))
