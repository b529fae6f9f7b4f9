"""A group formed once: the client groups requests as the broker listed the model
(``ModelInfo.group_samples``), and every group reaches the worker as one job,
unchanged -- a real broker, a real ``ipuserve worker`` with a ModelRunner, the real
Client; results against the example's numpy reference."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest

from ipuserve.client import Client, InferFuture
from ipuserve.runtime.popef import examples, load_model
from tests.helpers import (
    Processes,
    metric,
    runner_worker_argv,
    scrape,
    start_broker,
    start_worker,
    wait_until,
    write_example,
)

pytestmark = pytest.mark.slow

NAMES = ("tensor_A", "tensor_B")  # the `simple` example's inputs: float32 [batch, 4]


def test_a_clients_groups_reach_the_worker_as_it_formed_them(
    processes: Processes, tmp_path: Path
) -> None:
    model = write_example(tmp_path / "simple.popef", "simple", "--batch-size", "4")
    broker = start_broker(processes)
    argv = runner_worker_argv(model, args=("--metrics-port", "0", "--metrics-host", "127.0.0.1"))
    worker = start_worker(processes, broker, argv)
    worker_url = worker.wait_for(r"metrics on (http://127\.0\.0\.1:\d+/metrics)")[1]
    rng = np.random.default_rng(21)
    given = [{n: rng.standard_normal((1, 4)).astype(np.float32) for n in NAMES} for _ in range(41)]
    with Client(broker.frontend, timeout=60) as client:
        (info,) = client.models()  # what the client groups by (its own ask may come later)
        assert info.group_samples == 4  # one compiled batch: no device time known yet
        # sent from a done-callback, on the client's I/O thread: one turn, one REQUESTS
        fanned_out: Future[list[InferFuture]] = Future()
        first = client.infer_async("simple", given[0])
        first.add_done_callback(
            lambda _f: fanned_out.set_result([client.infer_async("simple", g) for g in given[1:]])
        )
        futures = [first, *fanned_out.result(60)]
        results = [future.result(60) for future in futures]
        stats = client.stats
    data = examples.tensor_arrays(load_model([model]))
    for inputs, result in zip(given, results, strict=True):
        want = examples.reference("simple", inputs, data)["output"]
        np.testing.assert_allclose(result["output"], want, rtol=1e-5)
    assert stats.groups >= 10 and stats.grouped >= 40  # 40 requests, at most 4 a group
    jobs = len(given) - stats.grouped + stats.groups  # what the client sent: a job each
    ok = 'ipuserve_worker_jobs_total{model="simple",outcome="ok",version="1"}'
    wait_until(lambda: scrape(worker_url).get(ok) == jobs, timeout=30)
    served = metric(scrape(broker.metrics_url), "ipuserve_broker_requests_total")
    assert served == len(given)
    errors = metric(scrape(broker.metrics_url), "ipuserve_broker_errors_total")
    assert errors == 0
