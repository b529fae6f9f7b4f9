"""The host's IPUs, the device IDs Poplar gives them, and the locks that keep them apart.

Poplar numbers devices the way ``gc-info -l`` shows them: first every single
IPU (IDs ``0 .. N-1``), then aligned pairs, then aligned groups of 4, 8, ... up
to all N. On a 4-IPU host: 0-3 are single IPUs, 4 = {0,1}, 5 = {2,3}, 6 = {0..3}.

A device is held by an exclusive ``flock`` on one lock file per IPU it spans.
flock locks belong to an open file description, so they conflict between
processes *and* between two opens in one process, and the kernel releases them
when the holder dies -- a crashed worker never leaves an IPU stuck.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ipuserve.errors import DeviceError


@dataclass(frozen=True)
class DeviceSlot:
    """One attachable device: an ID and the IPUs it spans."""

    device_id: int
    ipus: tuple[int, ...]

    @property
    def num_ipus(self) -> int:
        return len(self.ipus)


def device_slots(num_ipus: int) -> list[DeviceSlot]:
    """Every device of a host with ``num_ipus`` IPUs, in Poplar's ID order."""
    slots: list[DeviceSlot] = []
    size = 1
    while size <= num_ipus:
        for first in range(0, num_ipus - size + 1, size):
            slots.append(DeviceSlot(len(slots), tuple(range(first, first + size))))
        size *= 2
    return slots


def valid_sizes(num_ipus: int) -> list[int]:
    return sorted({slot.num_ipus for slot in device_slots(num_ipus)})


class IpuLocks:
    """Exclusive locks on a set of IPUs, released together (or when the process dies)."""

    def __init__(self, lock_dir: Path, ipus: tuple[int, ...], *, sign: bool = True) -> None:
        """``sign``: write our pid in each lock file (a probe that lets go at once does
        not, or a holder's file could briefly name us)."""
        self._fds: list[int] = []
        lock_dir.mkdir(parents=True, exist_ok=True)
        try:
            for ipu in ipus:
                self._fds.append(_lock(lock_dir / f"ipu{ipu}.lock", sign=sign))
        except BlockingIOError:
            self.release()
            raise
        except OSError as error:
            self.release()
            raise DeviceError(f"cannot lock IPU files in {lock_dir}: {error}") from error

    def release(self) -> None:
        while self._fds:
            os.close(self._fds.pop())  # closing the descriptor drops its flock

    def __del__(self) -> None:
        self.release()


def _lock(path: Path, *, sign: bool) -> int:
    """Lock one IPU's file and write our pid in it: the lock is what holds the IPU;
    the pid only lets "in use" messages say by whom."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    if not sign:
        return fd
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        pass  # a read-only or full lock dir still locks; only the diagnostics lose
    return fd


def _holder_pid(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def try_lock(lock_dir: Path, slot: DeviceSlot, *, sign: bool = True) -> IpuLocks | None:
    """Lock every IPU of ``slot`` or none of them."""
    try:
        return IpuLocks(lock_dir, slot.ipus, sign=sign)
    except BlockingIOError:
        return None


def holders(lock_dir: Path, num_ipus: int) -> Iterator[int]:
    """IPUs currently locked by someone (for diagnostics; racy by nature)."""
    for ipu in range(num_ipus):
        locks = try_lock(lock_dir, DeviceSlot(-1, (ipu,)), sign=False)
        if locks is None:
            yield ipu
        else:
            locks.release()


def describe_holders(lock_dir: Path, num_ipus: int) -> str:
    """The IPUs in use and who holds them, e.g. ``0 (pid 4242), 1 (this process)``, so
    a worker short of IPUs does not seem to blame the ones its own replicas took."""
    me = os.getpid()
    parts = []
    for ipu in holders(lock_dir, num_ipus):
        pid = _holder_pid(lock_dir / f"ipu{ipu}.lock")
        who = "this process" if pid == me else (f"pid {pid}" if pid is not None else "unknown")
        parts.append(f"{ipu} ({who})")
    return ", ".join(parts) or "none"
