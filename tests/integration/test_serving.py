"""The serving system end to end: real broker and `ipuserve worker` processes (ModelRunners on
simulated IPUs), the real Client shared by eight threads, every result against numpy."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from ipuserve.client import Client
from ipuserve.errors import IpuserveError
from ipuserve.runtime.popef import examples, load_model
from tests.helpers import (
    BrokerProc,
    Processes,
    metric,
    restart_broker,
    runner_worker_argv,
    scrape,
    start_broker,
    start_worker,
    wait_registered,
)

pytestmark = pytest.mark.slow

THREADS = 8
RESULT_TIMEOUT_S = 60.0


@dataclass
class Model:
    name: str
    path: str
    inputs: dict[str, tuple[tuple[int, ...], Any]]  # name -> (shape of one sample, dtype)
    weights: dict[str, np.ndarray]

    def request(self, rng: np.random.Generator, samples: int) -> dict[str, np.ndarray]:
        return {
            name: rng.standard_normal((samples, *shape)).astype(dtype)
            for name, (shape, dtype) in self.inputs.items()
        }

    def reference(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return examples.reference(self.name, inputs, self.weights)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Model]:
    directory = tmp_path_factory.mktemp("models")
    builders = {
        "mlp": examples.mlp(batch_size=16, input_size=64, hidden_size=96),
        "simple": examples.simple(batch_size=4),
    }
    found = {}
    for name, builder in builders.items():
        [path] = builder.write(directory / f"{name}.popef")
        model = load_model([str(path)])
        inputs = {
            n: (tuple(a.shape[1:]), a.dtype) for n, a in examples.sample_inputs(model).items()
        }
        found[name] = Model(name, str(path), inputs, examples.tensor_arrays(model))
    return found


@pytest.fixture
def procs() -> Iterator[Processes]:
    processes = Processes()
    try:
        yield processes
    finally:
        processes.close()


def serve(procs: Processes, broker: BrokerProc, model: Model, name: str) -> Any:
    return start_worker(procs, broker, runner_worker_argv(model.path), name=name)


@dataclass
class Outcome:
    model: Model
    inputs: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray] | None = None
    error: BaseException | None = None


def drive(
    client: Client,
    plan: list[tuple[Model, int]],
    window: int,
    progress: threading.Semaphore | None = None,
) -> list[Outcome]:
    """Eight threads share ``client``; each keeps ``window`` requests in flight."""
    outcomes: list[Outcome] = []
    lock = threading.Lock()

    def run(part: int) -> None:
        rng = np.random.default_rng(part)
        mine: list[Outcome] = []
        flying: list[tuple[Outcome, Any]] = []
        for model, samples in plan[part::THREADS]:
            outcome = Outcome(model, model.request(rng, samples))
            flying.append((outcome, client.infer_async(model.name, outcome.inputs)))
            if len(flying) >= window:
                mine.append(settle(*flying.pop(0), progress))
        mine.extend(settle(o, f, progress) for o, f in flying)
        with lock:
            outcomes.extend(mine)

    threads = [threading.Thread(target=run, args=(part,)) for part in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(RESULT_TIMEOUT_S * 4)
    assert not any(t.is_alive() for t in threads), "client threads did not finish"
    return outcomes


def settle(outcome: Outcome, future: Any, progress: threading.Semaphore | None) -> Outcome:
    try:
        outcome.outputs = dict(future.result(RESULT_TIMEOUT_S))
    except IpuserveError as error:
        outcome.error = error
    if progress is not None:
        progress.release()
    return outcome


def assert_all_correct(outcomes: list[Outcome]) -> None:
    errors = [o.error for o in outcomes if o.error is not None]
    assert not errors, f"{len(errors)} requests failed, e.g. {errors[0]!r}"
    by_model: dict[str, list[Outcome]] = {}
    for outcome in outcomes:
        by_model.setdefault(outcome.model.name, []).append(outcome)
    for group in by_model.values():  # one batched reference per model
        model = group[0].model
        stacked = {n: np.concatenate([o.inputs[n] for o in group]) for n in model.inputs}
        expected = model.reference(stacked)
        start = 0
        for outcome in group:
            rows = len(next(iter(outcome.inputs.values())))
            assert outcome.outputs is not None
            for name, want in expected.items():
                np.testing.assert_allclose(
                    outcome.outputs[name], want[start : start + rows], rtol=1e-4, atol=1e-5
                )
            start += rows


def mixed_plan(models: dict[str, Model], total: int, seed: int = 0) -> list[tuple[Model, int]]:
    pick = random.Random(seed)
    return [(models[pick.choice(["mlp", "simple"])], pick.randint(1, 8)) for _ in range(total)]


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


def test_kill_9_of_a_worker_under_load(procs: Processes, models: dict[str, Model]) -> None:
    broker = start_broker(procs, liveness_ms=400)
    victim = serve(procs, broker, models["mlp"], "victim")
    serve(procs, broker, models["mlp"], "survivor")
    plan = [(models["mlp"], 1 + i % 8) for i in range(3000)]
    answered = threading.Semaphore(0)
    killer = threading.Thread(target=lambda: _after(answered, 500, victim.kill))
    killer.start()
    with Client(broker.frontend, timeout=RESULT_TIMEOUT_S) as client:
        outcomes = drive(client, plan, window=16, progress=answered)
        stats = client.stats
    killer.join(RESULT_TIMEOUT_S)
    assert victim.wait() != 0  # it really died mid-load
    assert len(outcomes) == 3000
    assert_all_correct(outcomes)
    samples = scrape(broker.metrics_url)
    # The broker noticed the one loss and re-sent what the victim held to the survivor...
    assert metric(samples, "ipuserve_broker_workers_lost_total") == 1
    assert metric(samples, "ipuserve_broker_requeued_total") >= 1
    # ...and answered each request exactly once: one job and one reply per call, and
    # no reply reached the client that no caller was waiting for (a duplicate).
    assert metric(samples, "ipuserve_broker_requests_total") == 3000
    assert metric(samples, "ipuserve_broker_replies_total") == 3000
    assert metric(samples, "ipuserve_broker_errors_total") == 0
    assert (stats.sent, stats.replies, stats.dropped_replies) == (3000, 3000, 0)
    assert stats.grouped > 0  # groups were in flight when the worker died (~90 % here)


def test_broker_restart_under_load(procs: Processes, models: dict[str, Model]) -> None:
    broker = start_broker(procs, grace_ms=5000)
    worker = serve(procs, broker, models["simple"], "simple-1")
    plan = [(models["simple"], 1 + i % 8) for i in range(3000)]
    answered = threading.Semaphore(0)
    restarted: list[BrokerProc] = []

    def restart() -> None:
        mark = worker.mark()
        restarted.append(restart_broker(procs, broker))
        wait_registered(worker, restarted[0], since=mark)  # the worker came back by itself

    restarter = threading.Thread(target=lambda: _after(answered, 800, restart))
    restarter.start()
    with Client(broker.frontend, timeout=RESULT_TIMEOUT_S) as client:
        outcomes = drive(client, plan, window=16, progress=answered)
        epoch_changes = client.stats.epoch_changes
        grouped = client.stats.grouped
    restarter.join(RESULT_TIMEOUT_S)
    assert restarted and restarted[0].epoch != broker.epoch
    assert epoch_changes >= 1  # the client noticed the new broker and re-sent
    assert grouped > 0  # groups were in flight across the restart (~90 % here)
    assert len(outcomes) == 3000
    assert_all_correct(outcomes)


def _after(progress: threading.Semaphore, count: int, action: Any) -> None:
    for _ in range(count):
        assert progress.acquire(timeout=RESULT_TIMEOUT_S)
    action()
