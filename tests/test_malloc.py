"""The serving processes' malloc settings (ipuserve/malloc.py)."""

from __future__ import annotations

import ctypes
import ctypes.util
import subprocess
import sys

import pytest

from ipuserve.malloc import retain_freed_memory

GLIBC = ctypes.util.find_library("c") is not None and hasattr(
    ctypes.CDLL(ctypes.util.find_library("c")), "mallopt"
)


@pytest.mark.skipif(not GLIBC, reason="no glibc mallopt here")
def test_glibc_takes_the_settings() -> None:
    assert retain_freed_memory() is True


def test_a_process_with_the_settings_still_allocates_and_frees_big_buffers() -> None:
    """Freed 4 MiB buffers are reused, and memory still comes back as it should."""
    code = (
        "from ipuserve.malloc import retain_freed_memory; import numpy as np\n"
        "retain_freed_memory()\n"
        "for i in range(200):\n"
        "    a = np.full(1 << 20, i, np.float32); assert a.sum() == i * (1 << 20)\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
