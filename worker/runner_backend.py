"""RunnerBackend: a ModelRunner behind the worker's Backend seam.

Every job from every client goes into the same runner, so requests share its
dynamic batches: the runner is configured for dynamic batching on the model's
batch dimension and runs a partial batch when its batch policy says so
(``batch_policy``, docs/architecture.md §1.5): ``adaptive`` by default (waits
only for samples on their way back, and only while that idles the device less than
what a run costs: its device time plus the host CPU it takes, both measured),
``eager`` (as soon as the device would otherwise wait) or ``fixed``
(``batch_timeout_ms`` after its first sample arrived); ``batch_timeout_ms`` bounds
any wait. It flushes only when a request is actually waiting
(``flush_on_waiting_outputs``), so an idle worker runs nothing.

Jobs go to the replica with the fewest samples outstanding. ``executeAsync``
blocks when a replica's queues are full, which would stall the worker's socket
thread; so the backend never holds more requests on a replica than its queues have
slots for, and announces that sum as its capacity (the broker's credit). Of those,
it starts only what keeps each device busy (``AHEAD_JOBS`` jobs' worth of samples,
:meth:`RunnerBackend.room_for`): a job in the runtime's queues cannot be recalled,
so the others wait in the worker, where one whose deadline passes is answered
DEADLINE_EXCEEDED instead of being run late.

Each job is one runtime request: a client's group arrives as one job (formed once, by
the client) and stays one request down to the runtime, whose queues pack it with
every other client's requests into the compiled batch. The broker checked the job's
tensors against the model (it owns that check), so the runner runs with
``validate_io_params`` off, and the job's sample count comes with it.
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
    DeviceUnavailableError,
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
from ipuserve.grouping import GroupSizer
from ipuserve.protocol import ModelSpec, TensorSpec
from ipuserve.runtime import (
    BATCHING_DIM_DISABLED,
    BatchPolicy,
    DataDesc,
    ModelRunner,
    ModelRunnerConfig,
    OutputFuture,
    make_policy,
    popef,
)
from ipuserve.worker.backend import Done, Refused, WorkItem, WorkResult, submit_each
from ipuserve.worker.metrics import WorkerFamilies, WorkerMetrics
from ipuserve.worker.model_checks import (
    advise_on_busy_ipus,
    check_inventory,
    check_unconditional,
    choose_batching_dim,
)

log = logging.getLogger(__name__)

#: Jobs a replica's queues should be able to hold at least, however small the
#: compiled batch: enough in flight to hide the broker round trip.
MIN_SLOTS_PER_REPLICA = 64
#: A replica takes new jobs while it holds less than this many jobs' worth of samples
#: (one job: one batch, or 1 ms of device time for a cheap model, see
#: ipuserve.grouping): enough to keep its device busy between two turns of the worker's
#: loop. Jobs beyond it wait in the worker, where they can still expire: once in the
#: runtime's queues a job runs, however late.
AHEAD_JOBS = 3


class RunnerBackend:
    def __init__(
        self,
        model_paths: Sequence[str],
        *,
        name: str | None = None,
        replicas: int = 1,
        batching_dim: int | None = None,
        batch_policy: str = "adaptive",
        batch_timeout_ms: float | None = None,
        look_ahead: str = "0",
        credit: int | None = None,
        version: str = "1",
        default_version: str | None = None,
        families: WorkerFamilies | None = None,
    ) -> None:
        """``version`` and ``default_version`` go into the announced spec (a model
        repository's ``NAME/VERSION/`` and its config's pin: docs/repository_layout.md);
        ``version`` labels its metrics too. ``families``: the worker process's job
        metrics, shared when it hosts several model versions (a series each)."""
        model = popef.load_model(list(model_paths))
        name = name or model.metadata.modelName()
        self.metrics = WorkerMetrics(name, batch_policy, version, families)
        limit_s = None if batch_timeout_ms is None else batch_timeout_ms / 1e3
        make_policy(batch_policy, limit_s)  # a bad name or a fixed window of 0: say so now

        def policy(_replica: int) -> BatchPolicy:
            return make_policy(batch_policy, limit_s, self.metrics.batch_closed)

        batch = model.metadata.batchSize()
        check_inventory(model, replicas)
        check_unconditional(model)
        multiplier = max(2, math.ceil(MIN_SLOTS_PER_REPLICA / batch))
        dim = choose_batching_dim(model, batching_dim)
        config = ModelRunnerConfig(
            replication_factor=replicas,
            batching_dim=BATCHING_DIM_DISABLED if dim is None else dim,
            is_batch_size_timeout_enabled=True,
            flush_on_waiting_outputs=True,
            # the broker checked every job against the model (docs/architecture.md §2)
            validate_io_params=False,
            ring_buffer_size_multiplier=multiplier,
            max_look_ahead=look_ahead,
        )
        try:
            self._runner = ModelRunner(model, config=config, batch_policy=policy)
        except DeviceUnavailableError as exc:
            raise advise_on_busy_ipus(model, replicas, exc) from exc
        #: None: no dynamic batching, each request is exactly one compiled batch
        self._batching_dim = dim
        # One slot per replica stays free for the flush's padding item.
        self._slots = multiplier * batch - 1
        self._jobs = [0] * replicas
        self._samples = [0] * replicas
        self._lock = threading.Lock()
        self._credit = credit if credit is not None else replicas * self._slots
        self._spec = ModelSpec(
            name=name,
            inputs=tuple(_spec(d) for d in self._runner.getExecuteInputs()),
            outputs=tuple(_spec(d) for d in self._runner.getExecuteOutputs()),
            batch_size=batch,
            batching_dim=self._batching_dim,
            version=version,
            default_version=default_version,
        )
        #: device time per sample, from this worker's runs: how much to start ahead
        self._sizer = GroupSizer()
        self.metrics.watch(self._runner)
        log.info(
            "serving %s: %d replica(s), batch %d, %d slots each, credit %d, %s batching",
            self._spec.name,
            replicas,
            batch,
            self._slots,
            self._credit,
            batch_policy,
        )

    def describe(self) -> list[ModelSpec]:
        return [self._spec]

    def capacity(self) -> int:
        return self._credit

    @property
    def runner(self) -> ModelRunner:
        return self._runner

    def room_for(self, jobs: Sequence[WorkItem]) -> int:
        """The jobs (a prefix) whose replica -- the one with the fewest samples, as
        :meth:`_claim` picks -- is below its window of samples; at least one job when a
        replica is empty, however big the job."""
        window = AHEAD_JOBS * self._sizer.samples_per_job(self._spec)
        with self._lock:
            samples, held = list(self._samples), list(self._jobs)
        for count, job in enumerate(jobs):
            replica = min(range(len(samples)), key=samples.__getitem__)
            if samples[replica] >= window or held[replica] >= self._slots:
                return count
            samples[replica] += job.samples
            held[replica] += 1
        return len(jobs)

    def submit(self, job: WorkItem, done: Done) -> None:
        """One runtime request for ``job`` on the replica with the fewest samples."""
        if job.model != self._spec.name:
            raise UnknownModelError(f"this worker serves {self._spec.name!r}, not {job.model!r}")
        replica = self._claim(job.samples)
        started = time.perf_counter()
        try:
            future = self._runner.executeAsync(job.inputs, replica_id=replica)
        except BaseException as error:
            self._release(replica, job.samples)
            raise _wire_error(error) from error
        self.metrics.submitted()
        future.add_done_callback(lambda f: self._finished(job, done, f, replica, started))

    def submit_all(self, jobs: Sequence[WorkItem], done: Done) -> list[Refused]:
        return submit_each(self.submit, jobs, done)

    def close(self) -> None:
        self._runner.close()
        self.metrics.close()

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
        self, job: WorkItem, done: Done, future: OutputFuture, replica: int, started: float
    ) -> None:
        self._release(replica, job.samples)
        seconds = time.perf_counter() - started
        error = future.exception()
        if error is not None:
            wire_error = _wire_error(error)
            self.metrics.finished(wire_error.code, seconds)
            done(job, wire_error)
            return
        outputs = {name: np.asarray(array) for name, array in future.result().items()}
        timing = _timing(future, started)
        if "device_us" in timing:
            self._sizer.observe(self._spec.name, timing["device_us"], job.samples)
        self.metrics.finished(
            "ok", seconds, timing.get("queue_us", 0.0), timing.get("device_us", 0.0)
        )
        done(job, WorkResult(outputs, timing))


def _spec(desc: DataDesc) -> TensorSpec:
    return TensorSpec(desc.name, desc.data_type.value, tuple(desc.shape))


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
