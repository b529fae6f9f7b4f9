"""Session: links a model to a device and runs its programs (spec 10.2.4).

A Session owns the model's anchor callbacks (the host side of every data
stream) and its binding to a :class:`~ipuserve.runtime.Device`. Programs run on
the device's thread; the calling thread waits for them, as ``engine.run``
blocks in Poplar. Tensor data stored in the model file is bound automatically
unless ``SessionConfig.pred_tensor_data`` says otherwise.

Sessions may share a device. Only one is *active* (its executable loaded) at a
time: running a program of another session swaps it in, running the previous
session's save programs and then the new one's load programs, as the spec's
note on Session says. ``unloadFromDevice()`` does *not* run save programs --
``ModelRunnerConfig.run_save_programs`` decides that explicitly.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ipuserve.errors import ClosedError, DeviceRequestError, RuntimeUsageError, TensorError
from ipuserve.runtime.devices import Device, DeviceManager, DeviceWaitConfig
from ipuserve.runtime.popef.reader import load_model, verify_package_hash
from ipuserve.runtime.popef.types import Anchor, Model, TensorType
from ipuserve.runtime.predicates import (
    AnchorCallbackPolicy,
    AnchorCallbackPredicate,
    PopefDataUsagePolicy,
    PopefDataUsagePredicate,
)
from ipuserve.runtime.simulator.engine import Engine

if TYPE_CHECKING:
    from ipuserve.runtime.queue_manager import QueueManager

log = logging.getLogger(__name__)

CallbackHandle = Callable[[np.ndarray], "np.ndarray | None"]


class LaunchPolicy(enum.Enum):
    Immediate = 0  # acquire a device (SessionConfig.wait_config) and load in the constructor
    Deferred = 1  # wait for bindToDevice()


@dataclass
class SessionConfig:
    policy: LaunchPolicy = LaunchPolicy.Deferred
    pred_tensor_data: PopefDataUsagePredicate | None = None
    check_package_hash: bool = True
    wait_config: DeviceWaitConfig = field(default_factory=DeviceWaitConfig)
    max_look_ahead: str = "unlimited"
    #: ipuserve extension: the main programs run back to back from a device loop (the
    #: ModelRunner's), so the simulated device counts each run from the previous one's
    #: end, not from when the host thread got round to it (docs/runtime.md).
    device_loop: bool = False


@dataclass(frozen=True)
class CallbackInfo:
    """What a CallbackFactory is told about the anchor it makes a callback for."""

    anchor: Anchor
    session: Session


CallbackFactory = Callable[[CallbackInfo], "CallbackHandle | None"]
ProgramsAndAnchorsMap = dict[int, list[Anchor]]


def as_model(model_or_paths: Model | str | Sequence[str]) -> Model:
    if isinstance(model_or_paths, Model):
        return model_or_paths
    paths = [model_or_paths] if isinstance(model_or_paths, str) else list(model_or_paths)
    return load_model(paths)


class Session:
    def __init__(
        self, model_or_paths: Model | str | Sequence[str], config: SessionConfig | None = None
    ) -> None:
        self.config = config if config is not None else SessionConfig()
        self.model = as_model(model_or_paths)
        if self.config.check_package_hash:
            verify_package_hash(self.model)
        anchors = self.model.metadata.anchors()
        self._anchors = {a.handle(): a for a in anchors}
        self._callbacks: dict[str, CallbackHandle] = {}
        self._checked_programs: set[int] = set()
        self._device: Device | None = None
        self._owns_device = False
        self._engine: Engine | None = None
        self._needs_load = True
        self._stopped = False
        self._queue_managers: list[QueueManager] = []
        #: ipuserve extension: called once per main-program run, after the run has
        #: computed and before its outputs reach the host (the ModelRunner counts
        #: device batches with it, so counts never lag behind results).
        self.before_outputs: Callable[[], None] | None = None
        #: ipuserve extension: after an input callback, when the host had that input
        #: ready (perf_counter; None: when the callback returned). The ModelRunner's
        #: look-ahead knows, so the simulated device is not charged for a device
        #: thread that is late to take a ready batch (docs/runtime.md).
        self.inputs_ready_at: Callable[[], float | None] | None = None
        self._bind_tensor_data(self.config.pred_tensor_data)
        if self.config.policy is LaunchPolicy.Immediate:
            device = DeviceManager().getDevice(self.model, wait_config=self.config.wait_config)
            self._owns_device = True
            self.bindToDevice(device)

    # -- binding --------------------------------------------------------------
    def bindToDevice(self, device: Device) -> None:
        """Bind to ``device`` and load the executable onto it."""
        if self._device is device:
            return
        if self._device is not None:
            self.unloadFromDevice()
        meta = self.model.metadata
        if meta.numIpus() != device.numIpus() or meta.ipuVersion() != device.ipuVersion():
            raise DeviceRequestError(
                f"model {meta.modelName()!r} was compiled for {meta.numIpus()} IPU(s) of version "
                f"{meta.ipuVersion()}; {device.name()} has {device.numIpus()} of version "
                f"{device.ipuVersion()}"
            )
        self._device = device
        device.thread.call(lambda: self._activate(device))

    def unloadFromDevice(self) -> None:
        device = self._require_device()
        if device.isActiveSession(self):
            device.thread.call(self._unload_silently)
        if self._owns_device:
            device.detach()
        self._device = None
        self._owns_device = False

    def device(self) -> Device | None:
        return self._device

    # -- programs -------------------------------------------------------------
    def runLoadPrograms(self) -> None:
        self._run(self.model.metadata.programFlow().load(), then_loaded=True)

    def runMainPrograms(self) -> None:
        """Run the main programs; load first if the device was (re)bound since the last load."""
        self._run(self.model.metadata.programFlow().main(), load_first=True)

    def runSavePrograms(self) -> None:
        self._run(self.model.metadata.programFlow().save())

    def runPrograms(self, progs: Sequence[int]) -> None:
        """Run the given programs once each, in order (no implicit load)."""
        self._run(list(progs))

    def _run(
        self, programs: list[int], *, load_first: bool = False, then_loaded: bool = False
    ) -> None:
        device = self._require_device()
        if self._stopped:
            raise ClosedError("the session was stopped; call reload() before running programs")
        device.thread.call(lambda: self._run_on_device(device, programs, load_first, then_loaded))

    def _run_on_device(
        self, device: Device, programs: list[int], load_first: bool, then_loaded: bool
    ) -> None:
        self._activate(device)
        if load_first and self._needs_load:
            self._run_now(device, self.model.metadata.programFlow().load())
            self._needs_load = False
        self._run_now(device, programs, self.before_outputs if load_first else None)
        if then_loaded:
            self._needs_load = False

    def _run_now(
        self, device: Device, programs: list[int], observer: Callable[[], None] | None = None
    ) -> None:
        engine = self._engine
        assert engine is not None  # _activate guarantees it

        def before_outputs() -> None:
            device.faults.check(device)
            if observer is not None:
                observer()

        for index in programs:
            if index not in self._checked_programs:
                self.errorIfAnchorsAreNotConnectedToCallbacks([index])
                self._checked_programs.add(index)
            engine.run(index, self._callbacks, before_outputs, self.inputs_ready_at)

    def last_run_device_seconds(self) -> float | None:
        """ipuserve extension: how long the last run held the simulated device (from its
        simulated start, back to back or from its inputs' arrival, to its end); None
        when the device simulates no time (time scale 0) or nothing ran yet."""
        engine = self._engine
        if engine is None or not engine.simulates_time or not engine.last_run_seconds:
            return None
        return engine.last_run_seconds

    # -- callbacks --------------------------------------------------------------
    def setCallbackForAnchor(self, anchor_handle: str, callback: CallbackHandle) -> None:
        self._anchor(anchor_handle)
        self._callbacks[anchor_handle] = callback
        self._checked_programs.clear()

    def setUserInputHandler(
        self,
        factory: CallbackFactory,
        anchor_callback_predicate: AnchorCallbackPredicate | None = None,
        skip_connected: bool = False,
    ) -> None:
        self._set_handlers(TensorType.INPUT, factory, anchor_callback_predicate, skip_connected)

    def setUserOutputHandler(
        self,
        factory: CallbackFactory,
        anchor_callback_predicate: AnchorCallbackPredicate | None = None,
        skip_connected: bool = False,
    ) -> None:
        self._set_handlers(TensorType.OUTPUT, factory, anchor_callback_predicate, skip_connected)

    def _set_handlers(
        self,
        direction: TensorType,
        factory: CallbackFactory,
        predicate: AnchorCallbackPredicate | None,
        skip_connected: bool,
    ) -> None:
        for anchor in self._anchors.values():
            if anchor.type() is not direction or not anchor.programs():
                continue
            if skip_connected and anchor.handle() in self._callbacks:
                continue
            policy = predicate(anchor) if predicate else AnchorCallbackPolicy.BIND_USER_CB
            if policy is AnchorCallbackPolicy.BIND_EMPTY_CB:
                self.setCallbackForAnchor(anchor.handle(), empty_callback(anchor))
            elif policy is AnchorCallbackPolicy.BIND_USER_CB:
                callback = factory(CallbackInfo(anchor, self))
                if callback is not None:
                    self.setCallbackForAnchor(anchor.handle(), callback)

    def isConnected(self, anchor_handle: str) -> bool:
        return anchor_handle in self._callbacks

    def anchorsNotConnectedToCallbacks(self, progs: Sequence[int]) -> ProgramsAndAnchorsMap:
        missing: ProgramsAndAnchorsMap = {}
        for index in progs:
            unconnected = [
                a
                for a in self._anchors.values()
                if index in a.programs() and a.handle() not in self._callbacks
            ]
            if unconnected:
                missing[index] = unconnected
        return missing

    def errorIfAnchorsAreNotConnectedToCallbacks(self, progs: Sequence[int]) -> None:
        missing = self.anchorsNotConnectedToCallbacks(progs)
        if missing:
            details = "; ".join(
                f"program {p}: {', '.join(a.name() for a in anchors)}"
                for p, anchors in sorted(missing.items())
            )
            raise RuntimeUsageError(
                f"model {self.model.metadata.modelName()!r}: anchors without a callback -- "
                f"{details}. Connect them with setCallbackForAnchor, a user handler or a "
                "QueueManager"
            )

    def getInputAnchors(self) -> list[Anchor]:
        return [a for a in self._anchors.values() if a.type() is TensorType.INPUT]

    # -- lifecycle ----------------------------------------------------------------
    def stop(self) -> None:
        """Stop: disconnect queues so a running program finishes on dummy data."""
        self._stopped = True
        for manager in self._queue_managers:
            manager.disconnectAll()

    def reload(self) -> None:
        """Load the executable again (fresh device memory, faults cleared); load programs rerun."""
        device = self._require_device()
        device.faults.reset()
        device.thread.call(lambda: self._fresh_engine(device))
        self._stopped = False

    def isStopped(self) -> bool:
        return self._stopped

    def createQueueManager(self, *args: Any, **kwargs: Any) -> QueueManager:
        from ipuserve.runtime.queue_manager import QueueManager

        manager = QueueManager(self, *args, **kwargs)
        self._queue_managers.append(manager)
        return manager

    # -- internals ----------------------------------------------------------------
    def _bind_tensor_data(self, predicate: PopefDataUsagePredicate | None) -> None:
        for name, data in self.model.tensorData.items():
            anchor = self.model.metadata.anchor(name)
            policy = predicate(anchor) if predicate else PopefDataUsagePolicy.USE_POPEF_DATA_IF_ANY
            if policy is PopefDataUsagePolicy.USE_POPEF_DATA_IF_ANY:
                self._callbacks[anchor.handle()] = constant_callback(data.array())

    def _activate(self, device: Device) -> None:
        """On the device thread: make this session's executable the loaded one."""
        if not device.isActiveSession(self) or self._engine is None:
            device.bindToSession(self)
            self._fresh_engine(device)

    def _fresh_engine(self, device: Device) -> None:
        self._engine = Engine(
            self.model.executable,
            self.model.metadata.anchors(),
            device.cost,
            device.memoryBytes(),
            device.name(),
            device_loop=self.config.device_loop,
        )
        self._needs_load = True

    def _device_unbound(self) -> None:
        """Another session takes the device: save our state first, as the spec says."""
        save = self.model.metadata.programFlow().save()
        if save and self._engine is not None and not self._needs_load:
            if self.anchorsNotConnectedToCallbacks(save):
                log.debug(
                    "implicit save skipped: save anchors of %r are not connected",
                    self.model.metadata.modelName(),
                )
            else:
                assert self._device is not None
                self._run_now(self._device, save)
        self._engine = None

    def _unload_silently(self) -> None:
        assert self._device is not None
        self._device.forgetSession(self)
        self._engine = None

    def _device_released(self) -> None:
        self._engine = None
        self._device = None

    def _require_device(self) -> Device:
        if self._device is None:
            raise RuntimeUsageError(
                f"session for model {self.model.metadata.modelName()!r} is not bound to a "
                "device; call bindToDevice() or use LaunchPolicy.Immediate"
            )
        return self._device

    def _anchor(self, handle: str) -> Anchor:
        try:
            return self._anchors[handle]
        except KeyError:
            known = ", ".join(sorted(self._anchors))
            raise TensorError(
                f"model {self.model.metadata.modelName()!r} has no anchor "
                f"{handle!r}; its anchors are: {known}"
            ) from None

    def __del__(self) -> None:
        if getattr(self, "_owns_device", False) and self._device is not None:
            self._device.detach()


def constant_callback(array: np.ndarray) -> CallbackHandle:
    """Feed the same array every run, without copying (tensor data, frozen inputs)."""
    return lambda _offered: array


def empty_callback(anchor: Anchor) -> CallbackHandle:
    """BIND_EMPTY_CB: inputs read zeros, outputs go nowhere."""
    if anchor.type() is TensorType.INPUT:
        info = anchor.tensorInfo()
        zeros = np.zeros(info.shape(), dtype=info.numpyDType())
        return lambda _offered: zeros
    return lambda _data: None
