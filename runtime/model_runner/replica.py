"""One replica of a ModelRunner: a device, a session on it, its queues and its device loop.

The device thread runs the main programs back to back for as long as the
replica lives; each run pulls inputs from the queues (waiting, and flushing on
timeout as docs/architecture.md §1.3 describes) and pushes outputs back. User
threads only enqueue. The replica's lock makes "enqueue every tensor of a
request" atomic with respect to a flush, so all queues advance together and
padded rows never reach a caller.

A failed run fails every request the replica holds (their samples can no
longer be matched to outputs), resets the queues and, for a device fault,
either reloads the executable (``auto_reset``) or leaves the replica unusable.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from ipuserve.errors import ClosedError, DeviceFaultError, IpuserveError, RuntimeUsageError
from ipuserve.runtime.devices import Device
from ipuserve.runtime.model_runner.batch_policy import BatchAccount, BatchPolicy, policy_from_spec
from ipuserve.runtime.model_runner.config import (
    NANOSECONDS_MAX,
    ModelRunnerConfig,
    look_ahead_value,
)
from ipuserve.runtime.model_runner.direct import DirectJob, direct_path
from ipuserve.runtime.model_runner.futures import OutputFuture, Request
from ipuserve.runtime.model_runner.input_waits import InputWaits
from ipuserve.runtime.model_runner.io_plan import IoPlan
from ipuserve.runtime.model_runner.memory import InputMemoryView, OutputMemoryView
from ipuserve.runtime.model_runner.monitoring import Monitor
from ipuserve.runtime.model_runner.prefetch import PrefetchedInput, Prefetcher, prefetchable
from ipuserve.runtime.popef.types import Model, TensorType
from ipuserve.runtime.predicates import ringSizeMultForMainProgs
from ipuserve.runtime.queues import InputQueue, IQueue, OutputQueue
from ipuserve.runtime.session import Session, SessionConfig, constant_callback, empty_callback

log = logging.getLogger(__name__)

_LOCK_PATIENCE_S = 0.05  # a flush never waits long for a producer; the next timeout retries
_MIN_WAIT_NS = 50_000  # an overdue batch waits this long per retry, not a busy loop


class Replica:
    def __init__(
        self,
        index: int,
        model: Model,
        device: Device,
        *,
        owns_device: bool,
        config: ModelRunnerConfig,
        plan: IoPlan,
        policy: BatchPolicy | None = None,
    ) -> None:
        self.index = index
        self.device = device
        self._owns_device = owns_device
        self._config = config
        self._plan = plan
        self._timeout_ns, batch_timeout, parallel_timeout = config.durations_ns()
        replicated = config.replication_factor > 1 and parallel_timeout != NANOSECONDS_MAX
        partial_timeout_ns = parallel_timeout if replicated else batch_timeout
        # How long a partial batch may wait: the spec's fixed window or eager batching
        # (timeout 0: flush as soon as the device would otherwise wait, Triton's
        # default), or the ipuserve policy ModelRunner(batch_policy=...) plugged in.
        self._policy: BatchPolicy = policy or policy_from_spec(
            config.is_batch_size_timeout_enabled, partial_timeout_ns, NANOSECONDS_MAX
        )
        self._run_end = time.monotonic()  # when the device last finished a run
        self.lock = threading.Lock()
        self.monitor = Monitor(config.request_tracepoints_buffer_size)
        self._pending: set[Request] = set()
        self._error: BaseException | None = None
        self._stopping = False
        self.session = Session(model, SessionConfig(check_package_hash=False, device_loop=True))
        self._bind_constants()
        self.session.bindToDevice(device)
        # Load now (the spec only says "before the first Main program"): a runner that
        # has returned is ready, so its first request does not wait out the upload,
        # and a worker joins the broker only when it can serve at full speed.
        self.session.runLoadPrograms()
        self.queues = self.session.createQueueManager(
            ringSizeMultForMainProgs(model, config.ring_buffer_size_multiplier),
            batch_dim=plan.batch_dim,
            timeout_ns=self._timeout_ns,
            timeout_callback=self._on_read_timeout,
            read_timeout_policy=self._read_timeout,
        )
        # Samples per run, as the queues count them (the batching dimension's extent).
        self._batch = min((q.batchSize() for q in self.queues.inputs.values()), default=1)
        self._account = BatchAccount(self._batch, self._policy.on_batch)
        ordered = prefetchable(model, set(self.queues.inputs))  # read order; None: conditional
        self._conditional = ordered is None
        self._look_ahead_depth = look_ahead_value(config.max_look_ahead)
        usable = (
            self._look_ahead_depth == 0 and config.flush_on_waiting_outputs and plan.batch_dim == 0
        )
        self._direct = direct_path(self.queues.inputs, ordered) if usable else None
        first = ordered[0].name() if ordered else None
        self._waits = InputWaits(self.queues.inputs, first, self._direct)
        self._fetchers = self._track_waits()
        self._look_ahead = self._look_ahead_inputs(model)
        self.session.before_outputs = self.monitor.record_batch
        self.session.inputs_ready_at = self._inputs_ready_at
        self._prefetcher = self._start_prefetcher()
        self._loop = device.thread.submit(self._run_forever)

    # -- user side ----------------------------------------------------------------
    def submit(
        self,
        inputs: dict[str, np.ndarray],
        outputs: dict[str, np.ndarray] | None,
        output_names: list[str],
        samples: int,
        t_submit: float,
    ) -> OutputFuture:
        future = OutputFuture(output_names, self)
        request = Request(
            future,
            inputs=len(inputs),
            outputs=len(output_names),
            samples=samples,
            user_outputs=outputs is not None,
            monitor=self.monitor,
            t_submit=t_submit,
            finished=self._finished,
            computation_started=self.computation_started,
        )
        with self.lock:
            self._check_usable()
            request.t_enqueued = time.perf_counter()  # before the device can see it
            now = time.monotonic()
            # Before the reader can see the samples: it asks the policy about them at once.
            self._policy.arrived(samples, now)
            if self._lone(inputs, outputs, samples):
                self._run_direct(request, inputs, output_names, now)
                return future
            try:
                self._enqueue(request, inputs, outputs, output_names, samples)
            except ClosedError:
                self._check_usable()  # a failing run disconnected us: say why
                raise
            self._pending.add(request)
            self._account.add(samples, now)
        return future

    def _lone(self, inputs: dict[str, np.ndarray], outputs: object, samples: int) -> bool:
        """Whether this request may skip the queues (:mod:`.direct`): one whole batch,
        nothing else held, the device waiting for the first input of its next run."""
        direct = self._direct
        return (
            direct is not None
            and samples == self._batch
            and outputs is None
            and not self._pending
            and direct.idle(self._waits.waiting_for)
            and not self._account.filled
            and direct.fits(inputs)
        )

    def _run_direct(
        self, request: Request, inputs: dict[str, np.ndarray], names: list[str], now: float
    ) -> None:
        direct = self._direct
        assert direct is not None
        self._pending.add(request)
        self._account.add(request.samples, now)
        direct.job = DirectJob(request, inputs, frozenset(names))
        self.queues.inputs[direct.first].interrupt()

    def _finished(self, request: Request) -> None:
        self._pending.discard(request)
        self._policy.completed(request.samples, time.monotonic())

    def _enqueue(
        self,
        request: Request,
        inputs: dict[str, np.ndarray],
        outputs: dict[str, np.ndarray] | None,
        names: list[str],
        samples: int,
    ) -> None:
        """Every tensor of the request, by reference, already validated (the trusted path)."""
        for name, array in inputs.items():
            self.queues.inputs[name].enqueueTrusted(
                array, samples, request.read_started, request.read_completed, tag=request
            )
        for name in names:
            target = outputs.get(name) if outputs is not None else None
            self.queues.outputs[name].enqueueTrusted(
                target, samples, partial(request.output_written, name), tag=request
            )

    def waiting_for(self) -> str | None:
        return self._waits.waiting_for

    def _check_usable(self) -> None:
        if self._stopping:
            raise ClosedError("the ModelRunner is closed")
        if self._error is not None:
            raise RuntimeUsageError(
                f"replica {self.index} is unusable after a device error ({self._error}); "
                "set ModelRunnerConfig.auto_reset to recover automatically"
            ) from self._error

    # -- device side ----------------------------------------------------------------
    def _run_forever(self) -> None:
        while not self._stopping:
            try:
                cpu = time.thread_time()
                self.session.runMainPrograms()
                self._policy.hosted(time.thread_time() - cpu)
                self._ran()
            except Exception as error:  # every failure fails the held requests
                if self._stopping or not self._recover(error):
                    break

    def _recover(self, error: Exception) -> bool:
        """Fail what we hold; return False when the replica must stop for good."""
        log.warning("replica %d: run failed: %s", self.index, error)
        self.queues.disconnectAll()  # frees a producer blocked on a full ring
        if self._prefetcher is not None:
            self._prefetcher.stop()  # its fetched sets belong to the failed requests
        with self.lock:
            if self._direct is not None:
                self._direct.job = None
            failed = error if isinstance(error, IpuserveError) else _wrapped(error)
            for request in list(self._pending):
                request.future._fail(failed)
            self._pending.clear()
            self.queues.resetAll()
            self._account.reset()
            if isinstance(error, DeviceFaultError) and not self._config.auto_reset:
                self._error = error
                return False
            self._prefetcher = self._start_prefetcher()
        if isinstance(error, DeviceFaultError):
            log.info("replica %d: auto_reset -- reloading the executable", self.index)
            self.session.reload()
        return True

    def _read_timeout(self, _queue: IQueue, filled: int, first_time: float | None) -> int:
        """The next read's wait: as long as the policy lets a partial batch wait (a fixed
        window from its first sample's arrival, or, eagerly, only while the device is
        busy: the device thread flushes when it idles), else timeout_ns."""
        if not filled:
            return self._timeout_ns
        now = time.monotonic()
        hold = self._policy.hold_s(filled, self._batch, first_time or now, now, self._idle_since())
        if hold is None:
            return self._timeout_ns
        if hold <= 0:  # run it now: flush before waiting, not after a first timeout
            self._flush_partial()  # (this thread reads the batch: as safe as on timeout)
        return max(_MIN_WAIT_NS, int(hold * 1e9))

    def _idle_since(self) -> float | None:
        """When the device began waiting for its next batch; None while it computes."""
        prefetcher = self._prefetcher
        if prefetcher is None:
            return self._run_end  # the device thread itself assembles the batch
        return prefetcher.idle_since if prefetcher.device_waiting else None

    def _device_idle(self) -> float | None:
        """The device found no input set ready: flush a waiting partial batch now, or say
        how many seconds the policy lets it wait (the device thread asks again then).
        The flush callback is told the input it was expecting more of (spec 3.7)."""
        if not any(q.holdsPartialBatch() for q in self.queues.inputs.values()):
            return None
        now = time.monotonic()
        account = self._account
        first = account.first_time if account.filled else now
        hold = self._policy.hold_s(account.filled, self._batch, first, now, self._idle_since())
        if hold is not None and hold > 0:
            return hold
        self._flush_partial()
        return None

    def _flush_partial(self) -> None:
        """Flush the partial batch now, naming the input it was waiting for more of.

        The reader thread and the device thread may both decide to flush the same
        partial batch; the check is made again under the lock, so the loser of that
        race does nothing (rather than the spec's dummy run for an idle runner, which
        would call the flush callback a second time)."""
        if not self.lock.acquire(timeout=_LOCK_PATIENCE_S):
            return
        try:
            waited = next((n for n, q in self.queues.inputs.items() if q.holdsPartialBatch()), None)
            if waited is not None and not self._stopping:
                self._flush(waited)
        finally:
            self.lock.release()

    def _ran(self) -> None:
        """A run ended: its device time is the policy's measure: the simulated device's
        own account where it keeps one, else from taking its inputs to now."""
        if self._direct is not None:
            self._direct.job = None  # the run that served it has ended
        prefetcher = self._prefetcher
        started = prefetcher.taken_at if prefetcher is not None else self._waits.read_at
        device_s = self.session.last_run_device_seconds()
        if device_s is not None:
            self._policy.ran(device_s)
        elif started:
            self._policy.ran(time.perf_counter() - started)
        self._run_end = time.monotonic()

    def _inputs_ready_at(self) -> float | None:
        """When the input the device just took was ready: 0.0 if it was there when the
        device asked (the look-ahead knows for a set, the queues for an input)."""
        prefetcher = self._prefetcher
        return prefetcher.ready_at if prefetcher is not None else self._waits.ready_at

    def computation_started(self) -> float:
        """When the device took the input set it is running now (0: unknown, no look-ahead)."""
        prefetcher = self._prefetcher
        return prefetcher.taken_at if prefetcher is not None else 0.0

    def _on_read_timeout(self, ring: Any) -> None:
        self.monitor.record_read_timeout()
        self._on_read_timeout_named(ring.label())

    def _on_read_timeout_named(self, waited: str) -> None:
        if not self.lock.acquire(timeout=_LOCK_PATIENCE_S):
            return
        try:
            if not self._stopping:
                self._flush(waited)
        finally:
            self.lock.release()

    def _flush(self, waited: str) -> None:
        """Pad what cannot fill up on its own; never block (the device thread calls this).

        A flush pads exactly the input and output queues that hold a partial batch:
        for ordinary models that is every queue (requests carry every tensor), for
        conditional ones only the branch whose requests are waiting. With no partial
        batch anywhere the runner is idle: the spec's dummy run ("flush anyway")
        happens only with flush_on_waiting_outputs off, and never for conditional
        models, whose runs read only one branch's inputs and would strand the
        other branches' padding in their queues.
        """
        inputs: dict[str, InputQueue] = {
            n: q for n, q in self.queues.inputs.items() if q.holdsPartialBatch()
        }
        outputs: dict[str, OutputQueue] = {
            n: q for n, q in self.queues.outputs.items() if q.holdsPartialBatch()
        }
        if not inputs and not outputs:
            if self._config.flush_on_waiting_outputs or self._conditional:
                return
            inputs, outputs = dict(self.queues.inputs), dict(self.queues.outputs)
        flushed: list[InputQueue | OutputQueue] = [*inputs.values(), *outputs.values()]
        if not all(q.hasRoom() for q in flushed):
            log.debug("replica %d: no room to flush; retrying at the next timeout", self.index)
            return
        padding, discard = self._flush_views(waited, inputs, outputs)
        padded = 0
        for name, values in padding.items():
            padded = max(padded, self.queues.inputQueue(name).flush(values))
        for name in discard:
            self.queues.outputQueue(name).flush()
        self._account.flushed(time.monotonic())
        if padded:
            self.monitor.record_flush(padded)
        log.debug(
            "replica %d flushed %d padding samples (waited for %r)", self.index, padded, waited
        )

    def _flush_views(
        self, waited: str, inputs: dict[str, Any], outputs: dict[str, Any]
    ) -> tuple[InputMemoryView, OutputMemoryView]:
        """What the flush will enqueue, shown to (and editable by) the flush callback."""
        padding = InputMemoryView(
            {
                name: np.zeros(
                    self._plan.sample_shape(name, q.paddingSamples()), self._plan.dtype(name)
                )
                for name, q in inputs.items()
            }
        )
        discard = OutputMemoryView({name: None for name in outputs})
        callback = self._config.flush_callback
        if callback is not None:
            replaced = callback(waited, padding, discard)
            if replaced is not None:
                padding, discard = replaced
        return padding, discard

    # -- wiring -----------------------------------------------------------------------
    def _bind_constants(self) -> None:
        """Frozen inputs and save-program outputs never go through queues."""
        for name, array in self._plan.frozen.items():
            self.session.setCallbackForAnchor(self._plan.handle(name), constant_callback(array))
        saves: dict[str, Any] = self._config.replica_to_save_programs_outputs.get(self.index, {})
        for anchor in self._plan.save_outputs:
            target = saves.get(anchor.name()) if self._config.run_save_programs else None
            self.session.setCallbackForAnchor(
                anchor.handle(),
                _copy_into(target) if target is not None else empty_callback(anchor),
            )

    def _track_waits(self) -> dict[str, Callable[[np.ndarray], Any]]:
        """Remember which input the device is blocked on, for timeout messages; with the
        direct path, serve a parked lone job's inputs and outputs."""
        fetchers = {}
        for name, queue in self.queues.inputs.items():
            handle = self._plan.handle(name)
            if self._direct is not None:
                fetchers[handle] = self._direct.reader(
                    name, queue.device_callback(), self._waits.wait
                )
            else:
                fetchers[handle] = self._waits.tracked(name, queue.device_callback())
            self.session.setCallbackForAnchor(handle, fetchers[handle])
        if self._direct is not None:
            for name, out in self.queues.outputs.items():
                handle = self._plan.handle(name)
                self.session.setCallbackForAnchor(
                    handle, self._direct.writer(name, out.device_callback())
                )
        return fetchers

    def _look_ahead_inputs(self, model: Model) -> list[PrefetchedInput]:
        depth = self._look_ahead_depth
        anchors = prefetchable(model, set(self.queues.inputs)) if depth != 0 else None
        if not anchors:
            return []
        return [
            PrefetchedInput(
                a.handle(),
                tuple(a.tensorInfo().shape()),
                a.tensorInfo().numpyDType(),
                self._fetchers[a.handle()],
            )
            for a in anchors
        ]

    def _start_prefetcher(self) -> Prefetcher | None:
        if not self._look_ahead:
            return None
        depth = look_ahead_value(self._config.max_look_ahead)
        prefetcher = Prefetcher(
            self._look_ahead,
            depth or self._config.ring_buffer_size_multiplier,
            self.device.thread_name(),
            on_device_idle=self._device_idle if self._policy.reacts_to_idle else None,
        )
        for spec in self._look_ahead:
            self.session.setCallbackForAnchor(spec.handle, prefetcher.device_callback(spec.handle))
        prefetcher.start()
        return prefetcher

    # -- shutdown --------------------------------------------------------------------
    def close(self, timeout: float = 30.0) -> None:
        if self._stopping:
            return
        self._stopping = True
        self.queues.disconnectAll()  # the device finishes its current run on dummy data
        if self._prefetcher is not None:
            self._prefetcher.stop()
        self._loop.exception(timeout)
        closed = ClosedError("the ModelRunner was closed before this request completed")
        for request in list(self._pending):
            request.future._fail(closed)
        self._pending.clear()
        try:
            if self._config.run_save_programs and self._plan.flow_has_save:
                self.session.runSavePrograms()
        finally:
            self.session.unloadFromDevice()
            if self._owns_device:
                self.device.detach()


def _copy_into(target: np.ndarray) -> Callable[[np.ndarray], None]:
    def copy(data: np.ndarray) -> None:
        np.copyto(target, data.reshape(target.shape))

    return copy


def _wrapped(error: Exception) -> IpuserveError:
    from ipuserve.errors import InferenceError

    wrapped = InferenceError(f"the model failed while running: {error}")
    wrapped.__cause__ = error
    return wrapped


__all__ = ["Replica", "TensorType"]
