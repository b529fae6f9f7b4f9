"""The real-data tool (spec chapter 7.3): run a model file on inputs read from ``.npy`` files.

The model runs through a :class:`ModelRunner` -- the same path a served model
takes -- ``runs`` times, spread over ``replicas`` replicas with one request in
flight per replica. The outputs of the first run are written as
``DIR/NAME.npy``; every later run is compared with it, so a non-deterministic
result shows up as ``"identical_across_runs": false`` instead of going unnoticed.

Inputs whose batch is not a multiple of the compiled batch need ``batching_dim``
(the runner's dynamic batching). The runner checks every tensor; its
:class:`~ipuserve.errors.TensorError` is re-raised with the name of the file the
tensor came from.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ipuserve.errors import TensorError
from ipuserve.npy_io import NpyInput, output_paths, summarize, write_outputs
from ipuserve.progress import Progress, ProgressCallback
from ipuserve.runtime.devices import Device, DeviceManager
from ipuserve.runtime.model_runner.config import BATCHING_DIM_DISABLED, ModelRunnerConfig
from ipuserve.runtime.model_runner.futures import OutputFuture
from ipuserve.runtime.model_runner.runner import ModelRunner
from ipuserve.runtime.popef.reader import load_model
from ipuserve.runtime.popef.types import Model
from ipuserve.runtime.simulator.config import SimulatorConfig
from ipuserve.runtime.tools.stats import LatencyRecorder, now_ns, rate

Array = np.ndarray[Any, Any]


@dataclass(frozen=True, kw_only=True)
class RealDataConfig:
    popef: tuple[str, ...]
    output_dir: Path = Path(".")
    replicas: int = 1
    batching_dim: int | None = None
    runs: int = 1
    ipu_model: bool = False

    def runner_config(self, devices: Mapping[int, Device]) -> ModelRunnerConfig:
        """Dynamic batching if asked for, and a partial batch padded at once: no other
        request will ever come to fill it, so waiting for one would only add latency."""
        return ModelRunnerConfig(
            replication_factor=self.replicas,
            batching_dim=BATCHING_DIM_DISABLED if self.batching_dim is None else self.batching_dim,
            replica_to_device=dict(devices),
            is_batch_size_timeout_enabled=True,
            batch_size_timeout_ns=1,
            data_parallel_timeout_ns=1,
            flush_on_waiting_outputs=True,
        )


@dataclass
class _Outcome:
    """What the runs produced: the first run's outputs and how the others compared."""

    outputs: dict[str, Array] = field(default_factory=dict)
    identical: bool = True
    latency: LatencyRecorder = field(default_factory=LatencyRecorder)
    runs: int = 0
    seconds: float = 0.0
    interrupted: bool = False

    def add(self, results: Mapping[str, Any]) -> None:
        arrays = {name: np.array(value) for name, value in results.items()}
        if self.runs == 0:
            self.outputs = arrays
        else:
            self.identical = self.identical and _same(self.outputs, arrays)
        self.runs += 1


def run_real_data(
    config: RealDataConfig,
    inputs: Mapping[str, NpyInput],
    progress: ProgressCallback | None = None,
) -> dict[str, Any]:
    """Run, write the outputs, and return the JSON-ready summary."""
    model = load_model(list(config.popef))
    begin = now_ns()
    with (
        _ipu_models(model, config) as devices,
        ModelRunner(model, config.runner_config(devices)) as runner,
    ):
        load_s = (now_ns() - begin) / 1e9
        arrays = _checked_names(runner, inputs)
        outcome = _run_all(runner, config, arrays, inputs, progress)
    paths = output_paths(outcome.outputs, config.output_dir)
    write_outputs(outcome.outputs, paths)
    return _report(config, model, inputs, outcome, paths, load_s)


@contextmanager
def _ipu_models(model: Model, config: RealDataConfig) -> Iterator[dict[int, Device]]:
    """IPU Model devices for every replica when asked for (else none: the runner attaches
    hardware itself), detached on exit -- the runner does not own devices it was given."""
    manager = DeviceManager()
    devices: dict[int, Device] = {}
    try:
        if config.ipu_model:
            for replica in range(config.replicas):
                devices[replica] = manager.createIpuModelDevice(model)
        yield devices
    finally:
        for device in devices.values():
            device.detach()


def _checked_names(runner: ModelRunner, inputs: Mapping[str, NpyInput]) -> dict[str, Array]:
    """The inputs as the runner wants them; an unknown name is refused with its file."""
    expected = [desc.name for desc in runner.getExecuteInputs()]
    for name, given in inputs.items():
        if name not in expected:
            raise TensorError(
                f"{given.path}: the model has no input {name!r}; its inputs are: "
                f"{', '.join(expected) or 'none'}"
            )
    return {name: given.array for name, given in inputs.items()}


def _run_all(
    runner: ModelRunner,
    config: RealDataConfig,
    arrays: dict[str, Array],
    inputs: Mapping[str, NpyInput],
    progress: ProgressCallback | None,
) -> _Outcome:
    """``config.runs`` requests, round-robin over the replicas, one in flight per replica.

    Ctrl-C after the first run ends the runs early (what is still in flight fails
    when the runner closes); before it, there is nothing to write, so it propagates.
    """
    outcome = _Outcome()
    pending: deque[tuple[int, OutputFuture, list[int]]] = deque()
    begin = now_ns()
    try:
        for run in range(config.runs):
            if len(pending) == config.replicas:
                _collect(pending.popleft(), outcome)
                _report_progress(progress, outcome, begin)
            pending.append(_submit(runner, arrays, inputs, run % config.replicas))
        while pending:
            _collect(pending.popleft(), outcome)
            _report_progress(progress, outcome, begin)
    except KeyboardInterrupt:
        if outcome.runs == 0:
            raise
        outcome.interrupted = True
    outcome.seconds = (now_ns() - begin) / 1e9
    return outcome


def _submit(
    runner: ModelRunner, arrays: dict[str, Array], inputs: Mapping[str, NpyInput], replica: int
) -> tuple[int, OutputFuture, list[int]]:
    """Submit one request; the done-callback stamps its completion on the device thread."""
    start, finished = now_ns(), [0]
    try:
        future = runner.executeAsync(arrays, replica_id=replica)
    except TensorError as error:
        raise blame_file(error, inputs) from None
    future.add_done_callback(lambda _f: finished.__setitem__(0, now_ns()))
    return start, future, finished


def _collect(entry: tuple[int, OutputFuture, list[int]], outcome: _Outcome) -> None:
    start, future, finished = entry
    results = future.result()
    outcome.latency.add((finished[0] or now_ns()) - start)
    outcome.add(results)


def _report_progress(progress: ProgressCallback | None, outcome: _Outcome, begin: int) -> None:
    if progress is not None:
        progress(Progress("running", (now_ns() - begin) / 1e9, outcome.runs, "runs"))


def blame_file(error: TensorError, inputs: Mapping[str, NpyInput]) -> TensorError:
    """The runner's error, prefixed with the file of the one input it is about (if one)."""
    message = str(error)
    named = [given for name, given in inputs.items() if repr(name) in message]
    return TensorError(f"{named[0].path}: {message}") if len(named) == 1 else error


def _same(first: Mapping[str, Array], other: Mapping[str, Array]) -> bool:
    if first.keys() != other.keys():
        return False
    for name, array in first.items():
        nan_ok = array.dtype.kind in "fc"
        if not np.array_equal(array, other[name], equal_nan=nan_ok):
            return False
    return True


def _report(
    config: RealDataConfig,
    model: Model,
    inputs: Mapping[str, NpyInput],
    outcome: _Outcome,
    paths: Mapping[str, Path],
    load_s: float,
) -> dict[str, Any]:
    return {
        "tool": "real-data",
        "model": model.metadata.modelName(),
        "files": list(config.popef),
        "replicas": config.replicas,
        "batching_dim": config.batching_dim,
        "ipu_model": config.ipu_model,
        "time_scale": SimulatorConfig.from_env().time_scale,
        "inputs": {n: {"file": str(i.path), **summarize(i.array)} for n, i in inputs.items()},
        "outputs": {n: {"file": str(paths[n]), **summarize(a)} for n, a in outcome.outputs.items()},
        "identical_across_runs": outcome.identical,
        "runs": outcome.runs,
        "load_s": round(load_s, 6),
        "duration_s": round(outcome.seconds, 6),
        "runs_per_s": rate(outcome.runs, outcome.seconds),
        "run_us": outcome.latency.summary_us(),
        "interrupted": outcome.interrupted,
    }
