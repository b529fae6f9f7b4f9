"""Threads for the producer/consumer benchmarks, and the main thread's watch over them.

The main thread does no measuring: it waits for the benchmark to finish while
reporting progress, and it is where Ctrl-C lands. :func:`supervise` turns that
KeyboardInterrupt into an orderly stop (the caller's ``stop`` disconnects the
rings, which wakes every blocked thread), joins the workers and re-raises the
first exception a worker died of, so nothing is left running either way.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ipuserve.errors import RuntimeUsageError

#: How often the main thread wakes to redraw the progress line. Not a
#: synchronisation: completion is signalled by an Event, this only bounds the wait.
TICK_S = 0.1
#: How long to wait for a worker to notice a stop before calling it stuck.
JOIN_TIMEOUT_S = 30.0


class Worker(threading.Thread):
    """A daemon thread that keeps the exception its target died of, for the main thread."""

    def __init__(self, name: str, target: Callable[[], None], on_error: Callable[[], None]) -> None:
        super().__init__(name=name, daemon=True)
        self._work = target
        self._on_error = on_error
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._work()
        except BaseException as error:  # reported by supervise(), on the main thread
            self.error = error
            self._on_error()


def supervise(
    workers: list[Worker],
    finished: threading.Event,
    stop: Callable[[], None],
    tick: Callable[[], None],
) -> bool:
    """Start ``workers``, wait for ``finished`` (calling ``tick`` meanwhile), then stop.

    Returns True if the wait was interrupted (Ctrl-C). ``stop`` must make every
    worker return; it is called in every case, as the benchmark's teardown.
    """
    interrupted = False
    try:
        for worker in workers:
            worker.start()
        while not finished.wait(TICK_S):
            tick()
    except KeyboardInterrupt:
        interrupted = True
    finally:
        stop()
        _join(workers)
    for worker in workers:
        if worker.error is not None:
            raise worker.error
    return interrupted


def _join(workers: list[Worker]) -> None:
    for worker in workers:
        if worker.ident is None:  # never started (start() of an earlier one failed)
            continue
        worker.join(JOIN_TIMEOUT_S)
        if worker.is_alive():
            raise RuntimeUsageError(
                f"benchmark thread {worker.name!r} did not stop within {JOIN_TIMEOUT_S:g} s"
            )
