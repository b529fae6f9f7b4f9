"""RunnerBackend: a ModelRunner behind the worker's Backend seam.

Every job from every client goes into the same runner, so requests share its
dynamic batches: the runner is configured for dynamic batching on the model's
batch dimension and flushes a partial batch ``batch_timeout_ms`` after its first
sample arrived -- or, with the default 0, as soon as the device would otherwise
wait (eager batching: batches fill while the device is busy, a lone request runs
at once) -- and only when a request is actually waiting
(``flush_on_waiting_outputs``), so an idle worker runs nothing.

Jobs go to the replica with the fewest samples outstanding. ``executeAsync``
blocks when a replica's queues are full, which would stall the worker's socket
thread; so the backend never holds more jobs on a replica than its queues have
slots for, and announces that sum as its capacity (the broker's credit).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence

import numpy as np

from ipuserve.errors import (
    ClosedError,
    InferenceError,
    InvalidInputError,
    IpuserveError,
    OverloadedError,
    RequestError,
    ServingError,
    TensorError,
    UnavailableError,
    UnknownModelError,
)
from ipuserve.protocol import ModelSpec, TensorSpec
from ipuserve.runtime import ModelRunner, ModelRunnerConfig, OutputFuture
from ipuserve.runtime.model_runner.memory import DataDesc
from ipuserve.runtime.popef.reader import load_model
from ipuserve.worker.backend import Done, Job, Result
from ipuserve.worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)

#: Jobs a replica's queues should be able to hold at least, however small the
#: compiled batch: enough in flight to hide the broker round trip.
MIN_SLOTS_PER_REPLICA = 64


class RunnerBackend:
    def __init__(
        self,
        model_paths: Sequence[str],
        *,
        name: str | None = None,
        replicas: int = 1,
        batching_dim: int | None = None,
        batch_timeout_ms: float = 0.0,
        credit: int | None = None,
    ) -> None:
        model = load_model(list(model_paths))
        batch = model.metadata.batchSize()
        multiplier = max(2, math.ceil(MIN_SLOTS_PER_REPLICA / batch))
        config = ModelRunnerConfig(
            replication_factor=replicas,
            batching_dim=0 if batching_dim is None else batching_dim,
            is_batch_size_timeout_enabled=True,
            batch_size_timeout_ns=round(batch_timeout_ms * 1e6),
            flush_on_waiting_outputs=True,
            ring_buffer_size_multiplier=multiplier,
        )
        self._runner = ModelRunner(model, config=config)
        self._batching_dim = config.batching_dim
        # One slot per replica stays free for the flush's padding item.
        self._slots = multiplier * batch - 1
        self._jobs = [0] * replicas
        self._samples = [0] * replicas
        self._lock = threading.Lock()
        self._credit = credit if credit is not None else replicas * self._slots
        self._spec = ModelSpec(
            name=name or model.metadata.modelName(),
            inputs=tuple(_spec(d) for d in self._runner.getExecuteInputs()),
            outputs=tuple(_spec(d) for d in self._runner.getExecuteOutputs()),
            batch_size=batch,
            batching_dim=self._batching_dim,
        )
        self.metrics = WorkerMetrics(self._spec.name)
        self.metrics.watch(self._runner)
        log.info(
            "serving %s: %d replica(s), batch %d, %d slots each, credit %d",
            self._spec.name,
            replicas,
            batch,
            self._slots,
            self._credit,
        )

    def describe(self) -> list[ModelSpec]:
        return [self._spec]

    def capacity(self) -> int:
        return self._credit

    @property
    def runner(self) -> ModelRunner:
        return self._runner

    def submit(self, job: Job, done: Done) -> None:
        if job.model != self._spec.name:
            raise UnknownModelError(f"this worker serves {self._spec.name!r}, not {job.model!r}")
        samples = _samples(job, self._batching_dim)
        replica = self._claim(samples)
        started = time.perf_counter()
        try:
            future = self._runner.executeAsync(dict(job.inputs), replica_id=replica)
        except BaseException as error:
            self._release(replica, samples)
            raise _wire_error(error) from error
        self.metrics.submitted()
        future.add_done_callback(lambda f: self._finished(job, done, f, replica, samples, started))

    def close(self) -> None:
        self._runner.close()

    def _claim(self, samples: int) -> int:
        with self._lock:
            open_replicas = [r for r, jobs in enumerate(self._jobs) if jobs < self._slots]
            if not open_replicas:
                raise OverloadedError(
                    f"all replicas of {self._spec.name!r} are full "
                    f"({self._slots} jobs each); more than the credit was sent"
                )
            replica = min(open_replicas, key=self._samples.__getitem__)
            self._jobs[replica] += 1
            self._samples[replica] += samples
            return replica

    def _release(self, replica: int, samples: int) -> None:
        with self._lock:
            self._jobs[replica] -= 1
            self._samples[replica] -= samples

    def _finished(
        self, job: Job, done: Done, future: OutputFuture, replica: int, samples: int, started: float
    ) -> None:
        self._release(replica, samples)
        seconds = time.perf_counter() - started
        error = future.exception()
        if error is not None:
            wire_error = _wire_error(error)
            self.metrics.finished(wire_error.code, seconds)
            done(job, wire_error)
            return
        outputs = {name: np.asarray(array) for name, array in future.result().items()}
        timing = _timing(future, started)
        self.metrics.finished(
            "ok", seconds, timing.get("queue_us", 0.0), timing.get("device_us", 0.0)
        )
        done(job, Result(outputs, timing))


def _spec(desc: DataDesc) -> TensorSpec:
    return TensorSpec(desc.name, desc.data_type.value, tuple(desc.shape))


def _samples(job: Job, batching_dim: int) -> int:
    for array in job.inputs.values():
        if array.ndim > batching_dim:
            return int(array.shape[batching_dim])
    return 1


def _timing(future: OutputFuture, started: float) -> dict[str, float]:
    trace = future.trace
    if trace is None:
        return {"device_us": (time.perf_counter() - started) * 1e6}
    queued = trace.read_preparation_duration_us + trace.read_queue_duration_us
    return {"queue_us": queued, "device_us": trace.computation_duration_us}


def _wire_error(error: BaseException) -> IpuserveError:
    """Runtime errors as the wire knows them: a bad tensor is the client's INVALID_INPUT,
    anything else the runtime raised while running is INFERENCE_FAILED."""
    if isinstance(error, TensorError):
        return InvalidInputError(str(error))
    if isinstance(error, ClosedError):
        return UnavailableError(f"the worker is shutting down: {error}")
    if isinstance(error, RequestError | ServingError):
        return error
    return InferenceError(f"the model failed: {error}")
