"""The callbacks benchmark (spec chapter 7.1): how fast a Session's anchor callbacks move data.

A model (files, or a generated ``noop`` of a chosen size) is bound to a simulated
device -- an attached IPU from the :class:`DeviceManager`, or an IPU Model -- and
every anchor without a data source gets a timed callback
(:mod:`~ipuserve.runtime.tools.anchor_taps`). The load programs run once, the
main programs run ``warmup`` times unmeasured, then until the budget is spent.

Reported: runs/s; GB/s through the callbacks (every byte an input callback
provided plus every byte an output callback took, over the measured wall time);
percentiles of the wall time of a run and of the time spent inside input and
output callbacks. The device's simulated time follows ``IPUSERVE_SIM_TIME_SCALE``
(0 = none; an IPU Model and the zero-time ``noop`` never take any), which the
report repeats so that figures from different settings are not compared blindly.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ipuserve.progress import Progress, ProgressCallback
from ipuserve.runtime.devices import Device, DeviceManager
from ipuserve.runtime.popef import examples
from ipuserve.runtime.popef.reader import load_model
from ipuserve.runtime.popef.types import Model
from ipuserve.runtime.session import Session
from ipuserve.runtime.simulator.config import SimulatorConfig
from ipuserve.runtime.tools.anchor_taps import Taps, connect_taps
from ipuserve.runtime.tools.stats import Budget, LatencyRecorder, gb_per_s, now_ns, rate


@dataclass(frozen=True, kw_only=True)
class CallbacksBenchConfig:
    """``popef``: model files (empty: a ``noop`` of ``batch_size`` x ``elements`` ``dtype``)."""

    popef: tuple[str, ...] = ()
    elements: int = 1024
    batch_size: int = 1
    dtype: str = "float32"
    ipu_model: bool = False
    zero_copy: bool = False
    budget: Budget = field(default_factory=lambda: Budget(warmup=10, count=1000))

    def model(self) -> Model:
        """The model to bind: read from ``popef`` (ModelFileError) or generated."""
        if self.popef:
            return load_model(list(self.popef))
        return examples.build(
            "noop", batch_size=self.batch_size, elements=self.elements, dtype=self.dtype
        )


def run_callbacks_benchmark(
    config: CallbacksBenchConfig, progress: ProgressCallback | None = None
) -> dict[str, Any]:
    """Run the benchmark; the device is released whatever happens (Ctrl-C included)."""
    model = config.model()
    with attached(model, ipu_model=config.ipu_model) as device:
        session = Session(model)
        session.bindToDevice(device)
        try:
            taps = connect_taps(session, zero_copy=config.zero_copy)
            session.runLoadPrograms()
            runs, interrupted = _measure(session, taps, config.budget, progress)
        finally:
            session.unloadFromDevice()  # waits for a run Ctrl-C left on the device thread
        return _report(config, model, device, taps, runs, interrupted)


@contextmanager
def attached(model: Model, *, ipu_model: bool) -> Iterator[Device]:
    """A device for ``model``, detached on exit: an IPU Model, or free IPUs (no waiting)."""
    manager = DeviceManager()
    device = manager.createIpuModelDevice(model) if ipu_model else manager.getDevice(model)
    try:
        yield device
    finally:
        device.detach()


@dataclass
class _Runs:
    """The measured runs: how many, their wall times, and the window they span."""

    times: LatencyRecorder = field(default_factory=LatencyRecorder)
    count: int = 0
    seconds: float = 0.0


def _measure(
    session: Session, taps: Taps, budget: Budget, progress: ProgressCallback | None
) -> tuple[_Runs, bool]:
    """Warm up, reset the counters, run until the budget is spent; (runs, interrupted)."""
    runs = _Runs()
    try:
        _warm_up(session, budget.warmup, progress)
        taps.reset()
        begin = now_ns()
        while not budget.done(runs.count, (now_ns() - begin) / 1e9):
            start = now_ns()
            session.runMainPrograms()
            end = now_ns()
            runs.times.add(end - start)
            runs.count, runs.seconds = runs.count + 1, (end - begin) / 1e9
            if progress is not None:
                progress(Progress("measuring", runs.seconds, runs.count, "runs"))
    except KeyboardInterrupt:
        return runs, True
    return runs, False


def _warm_up(session: Session, count: int, progress: ProgressCallback | None) -> None:
    begin = now_ns()
    for done in range(count):
        session.runMainPrograms()
        if progress is not None:
            progress(Progress("warm-up", (now_ns() - begin) / 1e9, done + 1, "runs"))


def _report(
    config: CallbacksBenchConfig,
    model: Model,
    device: Device,
    taps: Taps,
    runs: _Runs,
    interrupted: bool,
) -> dict[str, Any]:
    moved = {d: taps.bytes_moved(d) for d in ("input", "output")}
    total = moved["input"] + moved["output"]
    return {
        "tool": "callbacks-benchmark",
        "model": model.metadata.modelName(),
        "files": list(config.popef),
        "device": device.name(),
        "ipu_model": device.isIpuModel(),
        "time_scale": SimulatorConfig.from_env().time_scale,
        "effective_time_scale": device.cost.time_scale,
        "zero_time_model": model.executable.zeroTime(),
        "zero_copy": config.zero_copy,
        "warmup_runs": config.budget.warmup,
        "runs": runs.count,
        "duration_s": round(runs.seconds, 6),
        "anchors": taps.describe(),
        "bytes": {**moved, "total": total},
        "throughput": {
            "runs_per_s": rate(runs.count, runs.seconds),
            "gb_per_s": gb_per_s(total, runs.seconds),
            "input_gb_per_s": gb_per_s(moved["input"], runs.seconds),
            "output_gb_per_s": gb_per_s(moved["output"], runs.seconds),
        },
        "run_us": runs.times.summary_us(),
        "callback_us": {d: rec.summary_us() for d, rec in taps.times.items()},
        "interrupted": interrupted,
    }
