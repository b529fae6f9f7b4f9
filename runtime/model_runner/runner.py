"""ModelRunner: load a model on one device per replica and serve execute calls (spec 10.1.3).

Construction acquires the devices (``replica_to_device`` or the DeviceManager
with ``device_wait_config``), loads the model and starts each replica's device
loop. ``execute`` / ``executeAsync`` validate the tensors, then enqueue them by
reference on the chosen replica; requests from any number of callers share the
compiled batches. ``close()`` (also on ``with`` exit and on garbage collection)
stops every device thread, fails what is still in flight, optionally runs the
save programs, and releases the devices.
"""

from __future__ import annotations

import operator
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import numpy as np

from ipuserve.errors import ClosedError, ReplicaError, TensorError
from ipuserve.runtime.devices import Device, DeviceManager
from ipuserve.runtime.model_runner.batch_policy import BatchPolicy, BatchPolicyFactory
from ipuserve.runtime.model_runner.config import ModelRunnerConfig
from ipuserve.runtime.model_runner.futures import OutputFuture
from ipuserve.runtime.model_runner.io_plan import IoPlan
from ipuserve.runtime.model_runner.memory import DataDesc, OutputMemory
from ipuserve.runtime.model_runner.replica import Replica
from ipuserve.runtime.popef.reader import verify_package_hash
from ipuserve.runtime.popef.types import Model, TensorType
from ipuserve.runtime.session import as_model


class PopefPaths(list[str]):
    """The PopEF files one model is made of (``model_runtime.PopefPaths``)."""


class ModelRunner:
    def __init__(
        self,
        model: Model | PopefPaths | Sequence[str] | str,
        config: ModelRunnerConfig | None = None,
        *,
        batch_policy: BatchPolicyFactory | None = None,
    ) -> None:
        """``batch_policy`` (an ipuserve extension, docs/runtime.md): replica index ->
        the policy deciding how long a partial batch may wait; without it the spec's
        ``batch_size_timeout_ns`` semantics hold (eager at 0, else a fixed window)."""
        self._config = (config if config is not None else ModelRunnerConfig()).checked()
        self._batch_policy = batch_policy
        self._model = as_model(model)
        if self._config.check_package_hash:
            verify_package_hash(self._model)
        self._plan = IoPlan(self._model, self._config)
        self._call_lock = threading.Lock() if self._config.thread_safe else None
        self._closed = False
        self._replicas = self._start_replicas()
        self._finalizer = weakref.finalize(self, _close_all, self._replicas)

    # -- descriptions -------------------------------------------------------------
    def getExecuteInputs(self) -> list[DataDesc]:
        return self._plan.descs(self._plan.execute_inputs)

    def getExecuteOutputs(self) -> list[DataDesc]:
        return self._plan.descs(self._plan.execute_outputs)

    def getModelInputs(self) -> list[DataDesc]:
        return self._plan.descs(self._plan.all_of(TensorType.INPUT))

    def getModelOutputs(self) -> list[DataDesc]:
        return self._plan.descs(self._plan.all_of(TensorType.OUTPUT))

    def config(self) -> ModelRunnerConfig:
        return self._config

    @property
    def model(self) -> Model:
        return self._model

    # -- execution ----------------------------------------------------------------
    def execute(
        self,
        input_data: Mapping[str, Any],
        output_data: Mapping[str, Any] | int | None = None,
        replica_id: int = 0,
    ) -> OutputMemory | None:
        """Run synchronously. Returns the outputs, or None when written into ``output_data``."""
        future = self.executeAsync(input_data, output_data, replica_id)
        results = future.result()
        user_allocated = isinstance(output_data, Mapping)
        return None if user_allocated else OutputMemory(results)

    def executeAsync(
        self,
        input_data: Mapping[str, Any],
        output_data: Mapping[str, Any] | int | None = None,
        replica_id: int = 0,
    ) -> OutputFuture:
        t_submit = time.perf_counter()
        outputs_given: Mapping[str, Any] | None
        if output_data is None or isinstance(output_data, Mapping):
            outputs_given = output_data
        elif _replica_index(output_data) is not None:  # C++'s executeAsync(input, replica_id)
            outputs_given, replica_id = None, output_data
        else:
            raise TensorError(
                "output_data must be a mapping of output names to arrays (or a replica id), "
                f"got {type(output_data).__name__}"
            )
        replica = self._replica(replica_id)
        inputs, samples, names, outputs = self._prepare(input_data, outputs_given)
        with self._call_lock or nullcontext():
            return replica.submit(inputs, outputs, names, samples, t_submit)

    def _prepare(
        self, input_data: Mapping[str, Any], output_data: Mapping[str, Any] | None
    ) -> tuple[dict[str, np.ndarray], int, list[str], dict[str, np.ndarray] | None]:
        validator = self._plan.validator
        if self._config.validate_io_params:
            inputs, samples = validator.check_inputs(input_data)
            outputs = None if output_data is None else validator.check_outputs(output_data, samples)
            return inputs, samples, list(validator.outputs), outputs
        inputs = dict(input_data)
        validator.check_names_known(inputs, output_data)
        samples = _samples_unchecked(inputs, validator)
        names = (
            list(output_data)
            if output_data is not None
            else self._plan.reachable_outputs(set(inputs))
        )
        return inputs, samples, names, None if output_data is None else dict(output_data)

    def _replica(self, replica_id: int) -> Replica:
        if self._closed:
            raise ClosedError("the ModelRunner is closed")
        return self._replica_of(replica_id)

    # -- monitoring ----------------------------------------------------------------
    def getTimeTrace(
        self, time_info: dict[str, float], replica_id: int = 0, cur: int = -1
    ) -> dict[str, float]:
        return self._replica_of(replica_id).monitor.time_trace(time_info, cur)

    def getMonitoringStatisticsPercentile(
        self, monitoring_info: dict[str, float], quantile: float = 0.9, replica_id: int = 0
    ) -> dict[str, float]:
        return self._replica_of(replica_id).monitor.percentile(monitoring_info, quantile)

    def getMonitoringStatisticsMean(
        self, monitoring_info: dict[str, float], replica_id: int = 0
    ) -> dict[str, float]:
        return self._replica_of(replica_id).monitor.mean(monitoring_info)

    def getMonitoringStatisticsTotalCount(
        self, monitoring_info: dict[str, float], replica_id: int = 0
    ) -> dict[str, float]:
        return self._replica_of(replica_id).monitor.total_count(monitoring_info)

    def _replica_of(self, replica_id: int) -> Replica:
        index = _replica_index(replica_id)
        if index is None or not 0 <= index < len(self._replicas):
            raise ReplicaError(
                f"replica_id {replica_id!r} is out of range: replication_factor is "
                f"{len(self._replicas)} (replicas 0..{len(self._replicas) - 1})"
            )
        return self._replicas[index]

    # -- lifecycle ----------------------------------------------------------------
    def close(self) -> None:
        """Stop every replica's device thread and release the devices (idempotent)."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> ModelRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _policy_for(self, index: int) -> BatchPolicy | None:
        return self._batch_policy(index) if self._batch_policy is not None else None

    def _start_replicas(self) -> list[Replica]:
        replicas: list[Replica] = []
        try:
            for index in range(self._config.replication_factor):
                device, owned = self._device_for(index)
                try:
                    replicas.append(
                        Replica(
                            index,
                            self._model,
                            device,
                            owns_device=owned,
                            config=self._config,
                            plan=self._plan,
                            policy=self._policy_for(index),
                        )
                    )
                except BaseException:
                    if owned:
                        device.detach()
                    raise
        except BaseException:
            _close_all(replicas)
            raise
        return replicas

    def _device_for(self, index: int) -> tuple[Device, bool]:
        given = self._config.replica_to_device.get(index)
        if given is not None:
            return given, False
        device = DeviceManager().getDevice(self._model, wait_config=self._config.device_wait_config)
        return device, True


def _replica_index(value: object) -> int | None:
    """An integer replica id -- a Python or numpy integer, not a bool -- else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def _close_all(replicas: list[Replica]) -> None:
    """Close every replica (idempotent: a closed replica's close() returns at once)."""
    errors: list[BaseException] = []
    for replica in replicas:
        try:
            replica.close()
        except Exception as error:
            errors.append(error)
    if errors:
        raise errors[0]


def _samples_unchecked(inputs: dict[str, Any], validator: Any) -> int:
    """Without validation we still need the batch extent to size library outputs."""
    for name, value in inputs.items():
        slot = validator.inputs.get(name)
        if slot is not None and isinstance(value, np.ndarray) and value.ndim > slot.batch_dim:
            return int(value.shape[slot.batch_dim])
    raise TensorError(
        "validate_io_params is off but no input tensor of the model was given "
        f"(got {', '.join(inputs) or 'nothing'})"
    )
