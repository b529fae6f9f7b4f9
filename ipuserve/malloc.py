"""Tell glibc's malloc to keep freed memory for reuse, in the broker and worker processes.

The broker holds a request's frames until its reply (to re-send them if a worker
dies), so tensors of megabytes are freed long after the next ones were allocated.
glibc then serves each such buffer (above its mmap threshold) with a fresh ``mmap``
-- a page fault per 4 KiB page as libzmq's I/O thread writes into it -- and returns
it with ``munmap``. Measured with 4 MiB tensors, 4 in flight, through a broker and
an echo worker: the broker's libzmq I/O thread spent 3.5-3.8 ms of CPU per request
(the bare pyzmq relay's: 2.7-3.0 ms), and 2.4 ms with freed memory kept; the round
trips per second went from 0.63-0.66 of the relay's to 0.79-0.92 (0.64-0.68 to
0.73-0.93 through the ``Client`` and a ``noop`` ModelRunner worker).

So the serving processes (never the client library, which lives in its user's
process) raise the mmap threshold to glibc's maximum and keep up to
``TRIM_THRESHOLD`` of freed memory instead of giving it back at once. The cost is
memory: the process's resident size stays near its peak. Elsewhere than glibc this
does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

#: mallopt parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: glibc's largest mmap threshold on 64-bit systems (DEFAULT_MMAP_THRESHOLD_MAX).
MMAP_THRESHOLD = 32 << 20
#: Freed memory at the top of the heap kept before it is returned to the system.
TRIM_THRESHOLD = 512 << 20


def retain_freed_memory() -> bool:
    """Apply the settings above; False where there is no glibc ``mallopt``."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        log.debug("no mallopt in this C library: malloc settings left as they are")
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    log.debug("malloc keeps freed memory (mmap threshold 32 MiB, trim 512 MiB): %s", ok)
    return ok
