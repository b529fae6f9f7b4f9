"""`ipuserve worker --batch-policy`: right answers, its decisions in /metrics (real processes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ipuserve.client import Client
from ipuserve.runtime.model_runner.batch_policy import POLICIES
from ipuserve.runtime.popef import examples
from ipuserve.runtime.popef.reader import load_model
from ipuserve.worker import cli as worker_cli
from tests.helpers import Processes, runner_worker_argv, scrape, start_broker, start_worker

BATCH = 16


def test_the_cli_offers_the_runtime_policies() -> None:
    """The CLI spells the names out (importing the runtime would slow every command)."""
    assert worker_cli.POLICIES == POLICIES


@pytest.mark.slow
@pytest.mark.parametrize(
    ("policy", "args"),
    [("adaptive", ()), ("eager", ()), ("fixed", ("--batch-timeout-ms", "1"))],
)
def test_each_policy_answers_right_and_shows_its_batches(
    processes: Processes, tmp_path: Path, policy: str, args: tuple[str, ...]
) -> None:
    """One request in flight, then one of 40 samples: every answer matches numpy, and the
    batch histograms count each device run's real samples -- a lone one-sample request is
    a batch of 1 (no policy makes it wait for company that is not coming), 40 samples
    are two full batches and one of 8."""
    [path] = examples.mlp(batch_size=BATCH, input_size=8, hidden_size=8).write(tmp_path / "m.popef")
    weights = examples.tensor_arrays(load_model([str(path)]))
    broker = start_broker(processes)
    options = ("--metrics-port", "0", "--metrics-host", "127.0.0.1", "--batch-policy", policy)
    worker = start_worker(processes, broker, runner_worker_argv(str(path), args=options + args))
    found = worker.wait_for(r"metrics on (http://127\.0\.0\.1:\d+/metrics)")
    rng = np.random.default_rng(0)
    with Client(broker.frontend, timeout=30) as client:
        for samples in (1, 1, 1, 1, 1, 40):
            x = rng.standard_normal((samples, 8)).astype(np.float32)
            got = client.infer("mlp", {"input": x})
            padded = np.concatenate([x, np.zeros((-samples % BATCH, 8), np.float32)])
            want = {
                name: np.concatenate(
                    [
                        examples.reference("mlp", {"input": chunk}, weights)[name]
                        for chunk in np.split(padded, len(padded) // BATCH)
                    ]
                )[:samples]
                for name in got
            }
            for name, array in got.items():
                np.testing.assert_allclose(array, want[name], rtol=1e-5, atol=1e-6)
    metrics = scrape(found[1])
    mlp = 'model="mlp",version="1"'
    chosen = f'model="mlp",policy="{policy}",version="1"'
    assert metrics[f"ipuserve_worker_batch_policy{{{chosen}}}"] == 1
    assert metrics[f"ipuserve_worker_batch_samples_count{{{mlp}}}"] == 5 + 3
    assert metrics[f"ipuserve_worker_batch_samples_sum{{{mlp}}}"] == 5 + 40
    assert metrics[f'ipuserve_worker_batch_samples_bucket{{le="1.0",{mlp}}}'] == 5
    assert metrics[f'ipuserve_worker_batch_samples_bucket{{le="8.0",{mlp}}}'] == 6
    assert metrics[f'ipuserve_worker_batch_samples_bucket{{le="16.0",{mlp}}}'] == 8
    assert metrics[f"ipuserve_worker_batch_wait_seconds_count{{{mlp}}}"] == 8


def test_a_fixed_window_needs_a_timeout() -> None:
    argv = [sys.executable, "-m", "ipuserve", "worker", "--broker", "tcp://127.0.0.1:1",
            "--model", "m.popef", "--batch-policy", "fixed"]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--batch-policy fixed needs --batch-timeout-ms > 0 (its window)" in result.stderr
    assert "Traceback" not in result.stderr


def test_an_unknown_policy_is_refused_with_the_choices() -> None:
    argv = [sys.executable, "-m", "ipuserve", "worker", "--broker", "tcp://127.0.0.1:1",
            "--model", "m.popef", "--batch-policy", "greedy"]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "'greedy' is not one of 'eager', 'fixed', 'adaptive'" in result.stderr
