"""Dynamic batching: many callers' requests of any size share the compiled batch."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest

import ipuserve.runtime as model_runtime
from ipuserve.runtime.popef.types import Model

from .conftest import WAIT_S, assert_matches, counts, reference, rows

MS = 1_000_000


def test_1000_concurrent_requests_pack_into_the_fewest_batches(make_runner, mlp: Model) -> None:
    """1,000 executeAsync calls of 1-7 samples on a model compiled for 16, from 4 threads.

    Every result must equal the numpy reference, and the device may run no more
    batches than the packed minimum plus the batches a flush padded.
    """
    runner = make_runner(
        mlp,
        batching_dim=0,
        flush_on_waiting_outputs=True,
        is_batch_size_timeout_enabled=True,
        batch_size_timeout_ns=20 * MS,
    )
    rng = np.random.default_rng(7)
    requests = [rows(int(n), 32, seed) for seed, n in enumerate(rng.integers(1, 8, 1000))]
    futures: list[model_runtime.OutputFuture | None] = [None] * len(requests)

    def submit(part: int) -> None:
        for index in range(part, len(requests), 4):
            futures[index] = runner.executeAsync({"input": requests[index]})

    threads = [threading.Thread(target=submit, args=(part,)) for part in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    for data, future in zip(requests, futures, strict=True):
        assert future is not None
        got = future.result(WAIT_S)
        assert got["logits"].shape == (len(data), 10)
        assert_matches(got, reference("mlp", mlp, {"input": data}))

    stats = counts(runner)
    samples = sum(len(r) for r in requests)
    packed_minimum = math.ceil(samples / 16)
    assert stats["request"] == 1000
    assert stats["batches"] >= packed_minimum
    assert stats["batches"] <= packed_minimum + stats["flushed_batches"]
    assert (stats["batches"] * 16 - stats["padded_samples"]) == samples  # nothing lost


def test_a_lone_request_completes_after_its_flush_timeout(make_runner, mlp: Model) -> None:
    calls: list[str] = []
    runner = make_runner(
        mlp,
        batching_dim=0,
        flush_on_waiting_outputs=True,
        is_batch_size_timeout_enabled=True,
        batch_size_timeout_ns=10 * MS,
        flush_callback=lambda tensor, _i, _o: calls.append(tensor),
    )
    inputs = {"input": rows(3, 32, 1)}
    got = runner.execute(inputs)
    assert got["logits"].shape == (3, 10) and got["probs"].shape == (3, 10)
    assert_matches(got, reference("mlp", mlp, inputs))
    assert calls == ["input"]
    stats = counts(runner)
    assert (stats["batches"], stats["flushed_batches"], stats["padded_samples"]) == (1, 1, 13)


def test_requests_larger_than_the_batch_are_split_and_reassembled(make_runner, mlp: Model) -> None:
    runner = make_runner(mlp, batching_dim=0, timeout_ns=5 * MS)
    inputs = [{"input": rows(n, 32, n)} for n in (37, 3, 16, 29)]
    futures = [runner.executeAsync(x) for x in inputs]
    for data, future in zip(inputs, futures, strict=True):
        assert_matches(future.result(WAIT_S), reference("mlp", mlp, data))


def test_user_allocated_outputs_with_dynamic_batches(make_runner, mlp: Model) -> None:
    runner = make_runner(mlp, batching_dim=0, timeout_ns=5 * MS)
    jobs = []
    for n in (5, 11, 9):
        outputs = {"logits": np.zeros((n, 10), np.float32), "probs": np.zeros((n, 10), np.float32)}
        data = {"input": rows(n, 32, 100 + n)}
        jobs.append((data, outputs, runner.executeAsync(data, outputs)))
    for data, outputs, future in jobs:
        future.wait(WAIT_S)
        assert_matches(outputs, reference("mlp", mlp, data))
        assert np.shares_memory(future["logits"].numpy(), outputs["logits"])


def test_padding_never_reaches_a_caller(make_runner, mlp: Model) -> None:
    """Flushes interleaved with real requests: every caller sees exactly its own rows."""
    runner = make_runner(
        mlp,
        batching_dim=0,
        flush_on_waiting_outputs=True,
        is_batch_size_timeout_enabled=True,
        batch_size_timeout_ns=1 * MS,
    )
    for round_ in range(20):
        data = {"input": rows(1 + round_ % 7, 32, 500 + round_)}
        assert_matches(runner.execute(data), reference("mlp", mlp, data))
    assert counts(runner)["flushed_batches"] == 20


@pytest.mark.parametrize("look_ahead", ["unlimited", "0"])
def test_eager_batching_flushes_when_the_device_would_idle(
    make_runner, mlp: Model, look_ahead: str
) -> None:
    """batch_size_timeout_ns=0: a lone partial batch runs at once, not after a timeout
    (timeout_ns is an hour here, so only the eager path can flush it)."""
    runner = make_runner(
        mlp,
        batching_dim=0,
        timeout_ns=3600 * 10**9,
        max_look_ahead=look_ahead,
        is_batch_size_timeout_enabled=True,
        batch_size_timeout_ns=0,
        flush_on_waiting_outputs=True,
    )
    for n in (3, 1, 15):
        inputs = {"input": rows(n, 32, n)}
        assert_matches(runner.execute(inputs), reference("mlp", mlp, inputs))
    assert counts(runner)["flushed_batches"] == 3


def test_eager_batching_fills_batches_while_the_device_is_busy(
    make_runner, mlp: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the device runs a batch, new requests pile into the next one instead of
    being flushed one by one: eager flushing happens only when the device would idle."""
    monkeypatch.setenv("IPUSERVE_SIM_TIME_SCALE", "50000")  # ~0.4 s per MLP batch
    runner = make_runner(
        mlp,
        batching_dim=0,
        timeout_ns=3600 * 10**9,
        is_batch_size_timeout_enabled=True,
        batch_size_timeout_ns=0,
        flush_on_waiting_outputs=True,
        ring_buffer_size_multiplier=4,
    )
    first = runner.executeAsync({"input": rows(16, 32, 0)})  # a full batch: the device is busy
    singles = [{"input": rows(1, 32, 100 + i)} for i in range(16)]
    futures = [runner.executeAsync(x) for x in singles]
    first.wait(WAIT_S)
    for data, future in zip(singles, futures, strict=True):
        assert_matches(future.result(WAIT_S), reference("mlp", mlp, data))
    stats = counts(runner)
    assert (stats["batches"], stats["padded_samples"]) == (2, 0)
