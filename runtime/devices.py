"""Device management: finding, waiting for and holding simulated IPUs.

Mirrors ``model_runtime::DeviceManager`` (spec section 10.1.1). Hardware
devices come from the host inventory (:mod:`~ipuserve.runtime.simulator.config`)
and are held through per-IPU lock files, so two worker processes on one host can
never attach the same IPU and the wait strategies mean something. IPU Model
devices (``createIpuModelDevice``) are CPU emulations: they need no lock and
take no simulated time.

Requests that can never succeed on this host (more IPUs than it has, a size
Poplar does not offer, another IPU architecture, remote buffers on Mk1) fail at
once with :class:`~ipuserve.errors.DeviceRequestError` whatever the wait
strategy -- waiting forever for the impossible is a hang, not a strategy.
"""

from __future__ import annotations

import enum
import logging
import time
import weakref
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ipuserve.errors import ConfigError, DeviceRequestError, DeviceUnavailableError
from ipuserve.runtime.popef.types import Model
from ipuserve.runtime.simulator.blas import limit_blas_threads
from ipuserve.runtime.simulator.config import SimulatorConfig
from ipuserve.runtime.simulator.cost import SMALL_MODEL_TILES, CostModel, IpuSpec, ipu_spec
from ipuserve.runtime.simulator.executor import DeviceThread
from ipuserve.runtime.simulator.faults import FaultState
from ipuserve.runtime.simulator.inventory import (
    DeviceSlot,
    IpuLocks,
    describe_holders,
    device_slots,
    try_lock,
    valid_sizes,
)

if TYPE_CHECKING:
    from ipuserve.runtime.session import Session

log = logging.getLogger(__name__)


class DeviceWaitStrategy(enum.Enum):
    NO_WAIT = 0
    WAIT_WITH_TIMEOUT = 1
    WAIT_FOREVER = 2


#: The spec's default time between attach attempts.
_DEFAULT_SLEEP = timedelta(seconds=15)
#: A sleepTime of 0 retries at once; the lock files are still polled no faster than this.
_MIN_RETRY_S = 0.001


def _seconds(value: timedelta | float | int) -> float:
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


class DeviceWaitConfig:
    """How long to wait for a device, and how often to retry.

    ``DeviceWaitConfig(strategy, timeout=..., sleepTime=...)`` as in the spec's
    Python listings, or ``DeviceWaitConfig(timeout, sleepTime)`` (the C++
    shorthand for WAIT_WITH_TIMEOUT). Durations are ``timedelta`` or seconds.
    """

    def __init__(
        self,
        strategy: DeviceWaitStrategy | timedelta | float = DeviceWaitStrategy.NO_WAIT,
        timeout: timedelta | float | None = None,
        sleepTime: timedelta | float = _DEFAULT_SLEEP,
    ) -> None:
        if isinstance(strategy, DeviceWaitStrategy):
            self.strategy = strategy
        else:  # C++'s DeviceWaitConfig(timeout, sleepTime = 15 s) shorthand
            self.strategy = DeviceWaitStrategy.WAIT_WITH_TIMEOUT
            if timeout is not None:  # DeviceWaitConfig(timeout, sleepTime) positionally
                sleepTime = timeout
            timeout = strategy
        self.timeout = timedelta(seconds=_seconds(timedelta(0) if timeout is None else timeout))
        self.sleepTime = timedelta(seconds=_seconds(sleepTime))
        if self.timeout < timedelta(0) or self.sleepTime < timedelta(0):
            raise ConfigError(
                f"DeviceWaitConfig: timeout and sleepTime must be >= 0, got "
                f"{self.timeout.total_seconds():g} s and {self.sleepTime.total_seconds():g} s"
            )

    def __repr__(self) -> str:
        return (
            f"DeviceWaitConfig({self.strategy.name}, timeout={self.timeout.total_seconds()}s, "
            f"sleepTime={self.sleepTime.total_seconds()}s)"
        )


class DeviceConstraints:
    def __init__(self, requiresRemoteBuffersSupport: bool = False) -> None:
        self.requiresRemoteBuffersSupport = requiresRemoteBuffersSupport

    def __bool__(self) -> bool:
        return self.requiresRemoteBuffersSupport

    def __repr__(self) -> str:
        return (
            f"DeviceConstraints(requiresRemoteBuffersSupport={self.requiresRemoteBuffersSupport})"
        )


class Device:
    """An attached device: one or more IPUs (or an IPU Model) with its own thread."""

    def __init__(
        self,
        slot: DeviceSlot,
        spec: IpuSpec,
        *,
        time_scale: float,
        locks: IpuLocks | None = None,
        ipu_model_tiles: int | None = None,
    ) -> None:
        limit_blas_threads()
        self._slot = slot
        self._spec = spec
        self._locks = locks
        self._model_tiles = ipu_model_tiles
        scale = 0.0 if ipu_model_tiles is not None else time_scale
        self.cost = CostModel(spec, slot.num_ipus, scale)
        self.faults = FaultState()
        self.thread = DeviceThread(self.thread_name())
        self._active: Session | None = None
        self._finalizer = weakref.finalize(self, _release, self.thread, locks)

    # spec API ----------------------------------------------------------------
    def ipuVersion(self) -> int:
        return self._spec.version

    # ipuserve extensions ------------------------------------------------------
    def getId(self) -> int:
        return self._slot.device_id

    def numIpus(self) -> int:
        return self._slot.num_ipus

    def ipus(self) -> tuple[int, ...]:
        return self._slot.ipus

    def isIpuModel(self) -> bool:
        return self._model_tiles is not None

    def tilesPerIpu(self) -> int:
        return self._model_tiles if self._model_tiles is not None else self._spec.tiles

    def memoryBytes(self) -> int:
        return self.tilesPerIpu() * self._spec.bytes_per_tile * self.numIpus()

    def name(self) -> str:
        if self.isIpuModel():
            return f"IPU Model ({self.numIpus()} x {self._spec.name}, {self.tilesPerIpu()} tiles)"
        ipus = list(self.ipus())
        return f"device {self.getId()} ({self.numIpus()} x IPU {self._spec.name}, IPUs {ipus})"

    def thread_name(self) -> str:
        return f"ipu-model-{id(self):x}" if self.isIpuModel() else f"ipu-device-{self.getId()}"

    def injectFault(self, runs: int = 1) -> None:
        """Make the next ``runs`` program runs fail with an application runtime error."""
        self.faults.arm(runs)

    def detach(self) -> None:
        """Unbind the active session, stop the device thread and release the IPUs."""
        if self._active is not None:
            self._active._device_released()
            self._active = None
        self._finalizer()

    def isAttached(self) -> bool:
        return self._finalizer.alive

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def __repr__(self) -> str:
        return f"<Device {self.name()}>"

    # the Session's side of binding (protected in the C++ API) ------------------
    def isActiveSession(self, session: Session) -> bool:
        return self._active is session

    def bindToSession(self, session: Session) -> None:
        """Make ``session`` the one whose executable is loaded; the previous one is unbound."""
        if self._active is session:
            return
        if self._active is not None:
            self.unbindSession()
        self._active = session

    def unbindSession(self) -> None:
        previous, self._active = self._active, None
        if previous is not None:
            previous._device_unbound()

    def forgetSession(self, session: Session) -> None:
        """Drop ``session`` as the active one without its implicit save (an unload)."""
        if self._active is session:
            self._active = None


def _num_ipus(num_ipus_or_model: int | Model) -> int:
    """The IPU count a request asks for: given directly, or the model's compiled count."""
    if isinstance(num_ipus_or_model, Model):
        return num_ipus_or_model.metadata.numIpus()
    return int(num_ipus_or_model)


def _release(thread: DeviceThread, locks: IpuLocks | None) -> None:
    thread.close()
    if locks is not None:
        locks.release()


class DeviceManager:
    """Selects and attaches devices of the simulated host (spec 10.1.1)."""

    def __init__(self, config: SimulatorConfig | None = None) -> None:
        self.config = config if config is not None else SimulatorConfig.from_env()
        self._spec = ipu_spec(self.config.ipu_version)

    def ipuHardwareVersion(self) -> int:
        return self._spec.version if self.config.num_ipus > 0 else 0

    def getDevice(
        self,
        num_ipus_or_model: int | Model,
        device_options: Mapping[str, Any] | None = None,
        wait_config: DeviceWaitConfig | None = None,
        constrains: DeviceConstraints | None = None,
    ) -> Device:
        num_ipus, wait_config = self._request(num_ipus_or_model, device_options, wait_config)
        self._check_possible(num_ipus, num_ipus_or_model, constrains)
        return self._required(
            self._acquire(self._slots_of(num_ipus), wait_config),
            f"device with {num_ipus} IPU(s)",
            wait_config,
        )

    def tryGetDevice(
        self,
        num_ipus_or_model: int | Model,
        device_options: Mapping[str, Any] | None = None,
        wait_config: DeviceWaitConfig | None = None,
        constrains: DeviceConstraints | None = None,
    ) -> Device | None:
        """None, as the spec says, also for a request this host can never meet (which
        ``getDevice`` explains); waiting for the impossible would be a hang."""
        num_ipus, wait_config = self._request(num_ipus_or_model, device_options, wait_config)
        try:
            self._check_possible(num_ipus, num_ipus_or_model, constrains)
        except DeviceRequestError as impossible:
            log.debug("tryGetDevice: %s", impossible)
            return None
        return self._acquire(self._slots_of(num_ipus), wait_config)

    def getSpecificDevice(
        self,
        device_id: int,
        options_or_model: Mapping[str, Any] | Model | None = None,
        wait_config: DeviceWaitConfig | None = None,
    ) -> Device:
        wait_config = wait_config or DeviceWaitConfig()
        slot = self._specific_slot(device_id, options_or_model)
        return self._required(
            self._acquire([slot], wait_config), f"device {device_id}", wait_config
        )

    def tryGetSpecificDevice(
        self,
        device_id: int,
        options_or_model: Mapping[str, Any] | Model | None = None,
        wait_config: DeviceWaitConfig | None = None,
    ) -> Device | None:
        """None, as the spec says, also for a device this host does not have or that
        cannot run the model (``getSpecificDevice`` explains)."""
        try:
            slot = self._specific_slot(device_id, options_or_model)
        except DeviceRequestError as impossible:
            log.debug("tryGetSpecificDevice: %s", impossible)
            return None
        return self._acquire([slot], wait_config or DeviceWaitConfig())

    def _specific_slot(
        self, device_id: int, options_or_model: Mapping[str, Any] | Model | None
    ) -> DeviceSlot:
        slots = device_slots(self.config.num_ipus)
        if not 0 <= device_id < len(slots):
            raise DeviceRequestError(
                f"no device {device_id} on this host: it has {self.config.num_ipus} "
                f"{self._spec.name} IPU(s), device IDs 0..{len(slots) - 1}"
            )
        slot = slots[device_id]
        if isinstance(options_or_model, Model):
            self._check_possible(options_or_model.metadata.numIpus(), options_or_model, None)
            if options_or_model.metadata.numIpus() != slot.num_ipus:
                raise DeviceRequestError(
                    f"device {device_id} has {slot.num_ipus} IPU(s) but model "
                    f"{options_or_model.metadata.modelName()!r} needs "
                    f"{options_or_model.metadata.numIpus()}"
                )
        return slot

    def createIpuModelDevice(
        self, num_ipus_or_model: int | Model, ipu_version: int = 2, tiles_per_ipu: int = 0
    ) -> Device:
        if isinstance(num_ipus_or_model, Model):
            meta = num_ipus_or_model.metadata
            num_ipus, ipu_version = meta.numIpus(), meta.ipuVersion()
        else:
            num_ipus = num_ipus_or_model
        spec = ipu_spec(ipu_version)
        if num_ipus < 1:
            raise DeviceRequestError(f"an IPU Model needs at least one IPU, got {num_ipus}")
        tiles = tiles_per_ipu or spec.tiles
        return Device(
            DeviceSlot(-1, tuple(range(num_ipus))), spec, time_scale=0.0, ipu_model_tiles=tiles
        )

    def createSmallIpuModelDevice(
        self, num_ipus_or_model: int | Model, ipu_version: int = 2
    ) -> Device:
        return self.createIpuModelDevice(num_ipus_or_model, ipu_version, SMALL_MODEL_TILES)

    # helpers -------------------------------------------------------------------
    def _request(
        self,
        num_ipus_or_model: int | Model,
        options: Mapping[str, Any] | None,
        wait_config: DeviceWaitConfig | None,
    ) -> tuple[int, DeviceWaitConfig]:
        if options:
            log.debug("device options %s have no effect on simulated IPUs", dict(options))
        return _num_ipus(num_ipus_or_model), wait_config or DeviceWaitConfig()

    def _slots_of(self, num_ipus: int) -> list[DeviceSlot]:
        return [s for s in device_slots(self.config.num_ipus) if s.num_ipus == num_ipus]

    def _check_possible(
        self, num_ipus: int, num_ipus_or_model: int | Model, constrains: DeviceConstraints | None
    ) -> None:
        host = f"this host has {self.config.num_ipus} {self._spec.name} IPU(s)"
        sizes = valid_sizes(self.config.num_ipus)
        if num_ipus not in sizes:
            offered = ", ".join(map(str, sizes)) or "none"
            raise DeviceRequestError(
                f"a device with {num_ipus} IPU(s) can never be attached: {host}; "
                f"device sizes offered: {offered}"
            )
        if isinstance(num_ipus_or_model, Model):
            wanted = num_ipus_or_model.metadata.ipuVersion()
            if wanted != self._spec.version:
                raise DeviceRequestError(
                    f"model {num_ipus_or_model.metadata.modelName()!r} was compiled for IPU "
                    f"version {wanted} but {host} (version {self._spec.version})"
                )
        if constrains and constrains.requiresRemoteBuffersSupport and self._spec.version < 2:
            raise DeviceRequestError(f"remote buffers were required but {host}, which has none")

    def _acquire(self, slots: list[DeviceSlot], wait: DeviceWaitConfig) -> Device | None:
        deadline = time.monotonic() + wait.timeout.total_seconds()
        waiting = False
        while True:
            for slot in slots:
                locks = try_lock(self.config.locks, slot)
                if locks is not None:
                    return Device(slot, self._spec, time_scale=self.config.time_scale, locks=locks)
            if wait.strategy is DeviceWaitStrategy.NO_WAIT:
                return None
            if not waiting:
                waiting = True
                log.info(
                    "waiting for a free device among %s (%r)", [s.device_id for s in slots], wait
                )
            pause = max(wait.sleepTime.total_seconds(), _MIN_RETRY_S)
            if wait.strategy is DeviceWaitStrategy.WAIT_WITH_TIMEOUT:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                pause = min(pause, remaining)
            time.sleep(pause)  # polling the lock files is the wait strategy itself

    def _required(self, device: Device | None, what: str, wait: DeviceWaitConfig) -> Device:
        if device is not None:
            return device
        busy = describe_holders(self.config.locks, self.config.num_ipus)
        waited = (
            "without waiting"
            if wait.strategy is DeviceWaitStrategy.NO_WAIT
            else f"after waiting {wait.timeout.total_seconds():g} s"
        )
        raise DeviceUnavailableError(
            f"no free {what} {waited} ({wait.strategy.name}); IPUs in use on this host "
            f"(of {self.config.num_ipus}): {busy}; lock dir {self.config.locks}"
        )
