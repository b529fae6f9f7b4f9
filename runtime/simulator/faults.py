"""Injected device faults, for exercising ``auto_reset`` and error paths.

A fault behaves like a Poplar application runtime error: the run that hits it
fails, and the device stays unusable until it is reset (the executable reloaded).
"""

from __future__ import annotations

import threading

from ipuserve.errors import DeviceFaultError


class FaultState:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed = 0
        self._broken = False

    def arm(self, runs: int = 1) -> None:
        if runs < 1:
            raise ValueError(f"runs must be >= 1, got {runs}")
        with self._lock:
            self._armed += runs

    def check(self, device: object) -> None:
        """Called once per run; raises if it must fail. ``device`` names itself only then."""
        if not self._armed and not self._broken:  # the hot path: no lock, no formatting
            return
        device_name = device.name() if hasattr(device, "name") else str(device)
        with self._lock:
            if self._broken:
                raise DeviceFaultError(
                    f"{device_name} is in an error state after an application runtime error; "
                    "it must be reset (ModelRunnerConfig.auto_reset, or Session.reload())"
                )
            if self._armed:
                self._armed -= 1
                self._broken = True
                raise DeviceFaultError(f"application runtime error on {device_name} (injected)")

    @property
    def broken(self) -> bool:
        return self._broken

    def reset(self) -> None:
        with self._lock:
            self._broken = False
