"""ModelRunnerConfig: every option of spec section 10.1.3, with the spec's defaults.

Durations are nanoseconds (``int``) as in the C++ API, or ``datetime.timedelta``;
``NANOSECONDS_MAX`` stands for ``std::chrono::nanoseconds::max()`` ("never").
The object is a plain mutable dataclass because the spec's listings configure
it attribute by attribute; :meth:`ModelRunnerConfig.checked` validates it once,
when a ModelRunner is built, and says which field is wrong.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ipuserve.errors import ConfigError
from ipuserve.runtime.devices import Device, DeviceWaitConfig
from ipuserve.runtime.model_runner.memory import InputMemoryView, OutputMemoryView

BATCHING_DIM_DISABLED = 0xFFFFFFFF
NANOSECONDS_MAX = 2**63 - 1

#: ``flush_callback(tensor_id, inputs, outputs)``; may edit the views in place or
#: return a replacement ``(inputs, outputs)`` pair.
FlushCallback = Callable[
    [str, InputMemoryView, OutputMemoryView], "tuple[InputMemoryView, OutputMemoryView] | None"
]

Duration = int | timedelta


def to_ns(value: Duration, name: str) -> int:
    if isinstance(value, timedelta):
        if value == timedelta.max:
            return NANOSECONDS_MAX
        value = round(value.total_seconds() * 1e9)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(
            f"ModelRunnerConfig.{name}: expected nanoseconds >= 0 or a timedelta, got {value!r}"
        )
    return value


@dataclass
class ModelRunnerConfig:
    replication_factor: int = 1
    run_save_programs: bool = False
    thread_safe: bool = False
    frozen_inputs: InputMemoryView = field(default_factory=InputMemoryView)
    replica_to_save_programs_outputs: dict[int, OutputMemoryView] = field(default_factory=dict)
    replica_to_device: dict[int, Device] = field(default_factory=dict)
    device_wait_config: DeviceWaitConfig = field(default_factory=DeviceWaitConfig)
    check_package_hash: bool = True
    timeout_ns: Duration = 5_000_000_000
    validate_io_params: bool = True
    batching_dim: int = BATCHING_DIM_DISABLED
    auto_reset: bool = False
    max_look_ahead: str = "unlimited"
    ring_buffer_size_multiplier: int = 2
    flush_on_waiting_outputs: bool = False
    batch_size_timeout_ns: Duration = NANOSECONDS_MAX
    data_parallel_timeout_ns: Duration = NANOSECONDS_MAX
    is_batch_size_timeout_enabled: bool = False
    request_tracepoints_buffer_size: int = 1000
    flush_callback: FlushCallback | None = None

    def checked(self) -> ModelRunnerConfig:
        """A validated copy with durations normalised to int nanoseconds."""
        config = copy.copy(self)
        for name in ("timeout_ns", "batch_size_timeout_ns", "data_parallel_timeout_ns"):
            setattr(config, name, to_ns(getattr(self, name), name))
        _at_least(config, "replication_factor", 1)
        _at_least(config, "ring_buffer_size_multiplier", 1)
        _at_least(config, "request_tracepoints_buffer_size", 0, " (0 = unlimited)")
        _at_least(config, "batching_dim", 0, " (0xFFFFFFFF = dynamic batching off)")
        look_ahead_value(config.max_look_ahead)
        _check_replica_keys(config)
        if config.flush_callback is not None and not callable(config.flush_callback):
            raise ConfigError("ModelRunnerConfig.flush_callback must be callable")
        return config

    def durations_ns(self) -> tuple[int, int, int]:
        """(timeout_ns, batch_size_timeout_ns, data_parallel_timeout_ns) as integers."""
        return (
            to_ns(self.timeout_ns, "timeout_ns"),
            to_ns(self.batch_size_timeout_ns, "batch_size_timeout_ns"),
            to_ns(self.data_parallel_timeout_ns, "data_parallel_timeout_ns"),
        )

    @property
    def dynamic_batching(self) -> bool:
        return self.batching_dim != BATCHING_DIM_DISABLED


def look_ahead_value(text: str) -> int | None:
    """``"unlimited"`` -> None, ``"3"`` -> 3; anything else is a ConfigError."""
    if text == "unlimited":
        return None
    if isinstance(text, str) and text.isdigit():
        return int(text)
    raise ConfigError(
        f"ModelRunnerConfig.max_look_ahead: expected 'unlimited' or an unsigned "
        f"integer as a string, got {text!r}"
    )


def _at_least(config: ModelRunnerConfig, name: str, least: int, note: str = "") -> None:
    value: Any = getattr(config, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ConfigError(
            f"ModelRunnerConfig.{name} must be an integer >= {least}{note}, got {value!r}"
        )


def _check_replica_keys(config: ModelRunnerConfig) -> None:
    for name in ("replica_to_device", "replica_to_save_programs_outputs"):
        for replica in getattr(config, name):
            if not 0 <= replica < config.replication_factor:
                raise ConfigError(
                    f"ModelRunnerConfig.{name} names replica {replica}, but replication_factor "
                    f"is {config.replication_factor} (replicas 0..{config.replication_factor - 1})"
                )
