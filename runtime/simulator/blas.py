"""Keep numpy's BLAS to one thread per simulated device.

Each simulated IPU runs its numpy work on its own thread. OpenBLAS would add a
thread pool of its own per matmul, and on a small host the pools of two devices
fight each other: two replicas of the example MLP went from 0.07 s to 25 s for
the same work. Like ``threadpoolctl``, we call OpenBLAS's setter on the library
numpy actually loaded, so it works even when numpy was imported first (as the
spec's listings do). ``IPUSERVE_SIM_BLAS_THREADS`` overrides the count.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

from ipuserve.runtime.simulator.config import BLAS_THREADS_ENV, parse_blas_threads

log = logging.getLogger(__name__)

_SETTERS = (
    "scipy_openblas_set_num_threads64_",
    "openblas_set_num_threads64_",
    "openblas_set_num_threads",
)
_done = threading.Lock()
_applied = False


def limit_blas_threads() -> None:
    """Apply the limit once per process (cheap to call again)."""
    global _applied
    threads = parse_blas_threads(os.environ.get(BLAS_THREADS_ENV) or "1")
    with _done:
        if _applied:
            return
        _applied = True
    import numpy  # noqa: F401 -- make sure its BLAS is loaded before we look for it

    for path in _loaded_blas_libraries():
        _set_threads(path, threads)


def _loaded_blas_libraries() -> list[str]:
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower()}
    except OSError:  # not Linux: leave BLAS alone
        return []
    return sorted(p for p in paths if p.startswith("/"))


def _set_threads(path: str, threads: int) -> None:
    try:
        library = ctypes.CDLL(path)
    except OSError:
        return
    for name in _SETTERS:
        setter = getattr(library, name, None)
        if setter is not None:
            setter(threads)
            log.debug("BLAS threads set to %d via %s in %s", threads, name, path)
            return
