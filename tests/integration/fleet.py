"""What the end-to-end serving tests share: example models with their numpy references,
eight client threads driving a Client, and the check of every result.

Used by test_serving.py (one broker) and test_several_brokers.py (two).
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from ipuserve.errors import IpuserveError
from ipuserve.runtime.popef import examples, load_model
from tests.client.faces import Face
from tests.helpers import BrokerProc, Processes, runner_worker_argv, start_worker

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
    settled_at: float = 0.0  # time.monotonic() when the Client settled its future


def drive(
    client: Face,
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
            future = client.infer_async(model.name, outcome.inputs)
            future.add_done_callback(
                lambda _f, o=outcome: setattr(o, "settled_at", time.monotonic())
            )
            flying.append((outcome, future))
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


def after(progress: threading.Semaphore, count: int, action: Any) -> None:
    for _ in range(count):
        assert progress.acquire(timeout=RESULT_TIMEOUT_S)
    action()


def longest_gap(outcomes: list[Outcome], since: float = 0.0) -> float:
    """The longest time without any result settling, from ``since`` to the last result."""
    times = [since, *sorted(o.settled_at for o in outcomes if o.settled_at >= since)]
    return max((b - a for a, b in itertools.pairwise(times)), default=0.0)
