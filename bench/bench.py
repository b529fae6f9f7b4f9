"""Benchmark one model of a running deployment through the ipuserve client.

:func:`bench` drives :class:`~ipuserve.client.client.Client` with a closed- or
open-loop generator (:mod:`ipuserve.bench.loadgen`) and returns the summary
of :mod:`ipuserve.bench.recording` plus what was run. Inputs are random tensors
that match the model's input specs (``batch`` samples along its batching
dimension) unless the caller passes its own.

The JSON summary (``ipuserve bench --json``)::

    {"model": str, "mode": "closed"|"open", "in_flight": int, "rate": float|null,
     "seed": int, "samples_per_request": int, "request_bytes": int,
     "requests": int, "ok": int, "errors": {code: int}, "error_messages": {code: str},
     "skipped": int, "interrupted": bool,
     "after_window": {"ok": int, "errors": {code: int}},
     "duration_s": float,
     "throughput": {"req_per_s", "samples_per_s", "mb_per_s"},
     "latency_us": {"count", "mean", "p50", "p90", "p99", "p99.9", "max"},
     "split_us": {"broker_queue", "worker_queue", "device", "worker_other", "wire", "total"},
     "client": {"sent", "resent", "dropped_replies", "expired"}}

``requests == ok + sum(errors)``; ``error_messages`` holds the first message of
each error code; ``after_window`` counts what was still in flight when the
measurement window closed (left out of the figures); ``mb_per_s`` counts input
plus output bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import numpy as np

from ipuserve import protocol as wire
from ipuserve.bench.loadgen import LoadConfig, OnDone, OnProgress, Outcome, Submit, run_load
from ipuserve.bench.recording import summarize
from ipuserve.client.client import Client
from ipuserve.client.pending import InferFuture
from ipuserve.errors import IpuserveError, UnknownModelError

Arrays = dict[str, np.ndarray[Any, Any]]


def model_spec(client: Client, model: str) -> wire.ModelSpec:
    """The spec the broker lists for ``model`` (UnknownModelError when nobody serves it)."""
    models = client.models()
    for info in models:
        if info.spec.name == model:
            return info.spec
    raise UnknownModelError.nobody_serves(model, ", ".join(i.spec.name for i in models))


def random_inputs(spec: wire.ModelSpec, batch: int | None = None, seed: int = 0) -> Arrays:
    """Tensors matching ``spec``'s inputs; ``batch`` resizes its batching dimension."""
    rng = np.random.default_rng(seed)
    return {t.name: _random(t, _shape(spec, t, batch), rng) for t in spec.inputs}


def _shape(spec: wire.ModelSpec, tensor: wire.TensorSpec, batch: int | None) -> tuple[int, ...]:
    if batch is None or spec.batching_dim is None:
        return tensor.shape
    shape = list(tensor.shape)
    shape[spec.batching_dim] = batch
    return tuple(shape)


def _random(tensor: wire.TensorSpec, shape: tuple[int, ...], rng: np.random.Generator) -> Any:
    dtype = np.dtype(tensor.dtype)
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(dtype)
    return rng.integers(0, min(np.iinfo(dtype).max, 127), shape, endpoint=True).astype(dtype)


def samples_in(spec: wire.ModelSpec | None, inputs: Mapping[str, Any]) -> int:
    """Samples one request carries: its size along the batching dimension, else the batch."""
    if spec is None or not inputs:
        return 1
    return spec.samples(np.shape(array) for array in inputs.values())


def client_submit(client: Client, model: str, inputs: Mapping[str, Any], samples: int) -> Submit:
    """A load-generator target: one ``infer_async`` per call, the outcome from its future."""
    sent = sum(np.asarray(a).nbytes for a in inputs.values())

    def submit(on_done: OnDone) -> None:
        # the same arrays for every request, never changed: no copy needed
        future = client.infer_async(model, inputs, copy=False)
        future.add_done_callback(lambda f: on_done(_outcome(f, samples, sent)))

    return submit


def _outcome(future: Future[Any], samples: int, sent: int) -> Outcome:
    error = future.exception()
    if error is not None:
        code = error.code if isinstance(error, IpuserveError) else type(error).__name__
        return Outcome(error=code, message=str(error))
    received = sum(a.nbytes for a in future.result().values())
    timing = future.timing if isinstance(future, InferFuture) else None
    return Outcome(None, timing, samples, sent + received)


def bench(
    client: Client,
    model: str,
    load: LoadConfig,
    *,
    inputs: Mapping[str, Any] | None = None,
    batch: int | None = None,
    progress: OnProgress | None = None,
) -> dict[str, Any]:
    """Run ``load`` against ``model`` and return the JSON-ready summary (schema above)."""
    spec = model_spec(client, model)
    chosen = dict(inputs) if inputs is not None else random_inputs(spec, batch, load.seed)
    samples = samples_in(spec, chosen)
    stats = client.stats
    before = stats.resent, stats.dropped_replies, stats.expired, stats.grouped
    recording = run_load(client_submit(client, model, chosen, samples), load, progress)
    summary = _head(model, load, samples, chosen) | summarize(recording)
    summary["client"] = {
        "sent": len(recording.samples),
        "resent": client.stats.resent - before[0],
        "dropped_replies": client.stats.dropped_replies - before[1],
        "expired": client.stats.expired - before[2],
        "grouped": client.stats.grouped - before[3],
    }
    return summary


def _head(model: str, load: LoadConfig, samples: int, inputs: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "model": model,
        "mode": load.mode,
        "in_flight": load.in_flight if load.rate is None else None,
        "rate": load.rate,
        "seed": load.seed,
        "samples_per_request": samples,
        "request_bytes": int(sum(np.asarray(a).nbytes for a in inputs.values())),
    }
