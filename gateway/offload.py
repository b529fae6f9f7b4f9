"""Large request bodies are decoded off the event loop, in two threads of their own.

A 60 MiB JSON body or gRPC message takes a second or more to decode; on the event loop
it would stall both doors and every other client. Above :data:`OFFLOAD_BYTES` the
decode runs in :data:`EXECUTOR` instead (the GIL is switched every few milliseconds,
so the loop keeps answering); two threads at most, so a flood of large bodies queues
instead of decoding all at once (each costs about its size). Small bodies, the common
case, are decoded in place: a thread hand-off costs more than they do.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

#: bodies above this many bytes are decoded off the event loop
OFFLOAD_BYTES = 256 * 1024
EXECUTOR = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ipuserve-decode")


async def off_loop(size: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``: in :data:`EXECUTOR` when ``size`` is above :data:`OFFLOAD_BYTES`,
    else here."""
    if size <= OFFLOAD_BYTES:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(EXECUTOR, fn, *args)
