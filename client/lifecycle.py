"""The life of the I/O thread of :class:`~ipuserve.client.Client`
(:mod:`ipuserve.client.thread_loop`): how it ends, how :meth:`close` stops it, and
how what was still pending fails.

* The thread fails what is pending as it ends, with why: closed, or the error that
  killed it (never leaving callers waiting on a dead thread).
* ``close()`` from another thread waits up to ``CLOSE_WAIT_S`` for it; a done-callback
  that blocks the thread for good cannot hang ``close()`` or the interpreter's exit:
  what it strands is failed here (a future settles once, so the thread's own attempt
  later is a no-op).
* A child that inherited the client through ``os.fork()`` has neither the thread nor
  the sockets: its ``close()`` only fails what it inherited.
"""

from __future__ import annotations

import logging
import os
import threading

from ipuserve.client.pending import Pending
from ipuserve.errors import ClosedError, IpuserveError, UnavailableError
from ipuserve.waker import Waker

log = logging.getLogger(__name__)

#: how long ``close()`` waits for the I/O thread to stop
CLOSE_WAIT_S = 5.0


class IoThread:
    """The lifecycle half of a client loop. A loop sets, in its constructor:
    ``thread`` (running :meth:`_run`), ``_lock`` (the inbox and ``_closed``),
    ``_work_lock`` (held for each turn of the loop), ``_waker``, ``_pid``, and
    implements :meth:`_loop`, :meth:`_outstanding`, :meth:`_take_outstanding` and
    :meth:`_release` (closing its sockets)."""

    thread: threading.Thread
    _lock: threading.Lock
    _work_lock: threading.Lock
    _waker: Waker
    _pid: int
    _closed: bool = False
    _crash: Exception | None = None

    def _loop(self) -> None:
        raise NotImplementedError

    def _outstanding(self) -> list[Pending]:
        """Hold ``_lock``. Every request not settled yet."""
        raise NotImplementedError

    def _take_outstanding(self) -> list[Pending]:
        """Hold ``_lock``. :meth:`_outstanding`, now no longer this loop's."""
        raise NotImplementedError

    def _release(self) -> None:
        """Close the loop's sockets (the work lock held, or the thread never ran)."""
        raise NotImplementedError

    def close(self) -> None:
        if os.getpid() != self._pid:  # a child's copy: the sockets and thread are the
            self._close_forked()  # parent's, so there is nothing to stop, only to fail
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._waker.wake()
        if threading.current_thread() is not self.thread and self.thread.is_alive():
            self.thread.join(CLOSE_WAIT_S)  # the thread closes the waker as it ends
            if self.thread.is_alive():
                log.warning(
                    "the client's I/O thread did not stop within %g s: a done-callback "
                    "is blocking it (one that waits for another request never returns)",
                    CLOSE_WAIT_S,
                )
                # Callbacks run without the work lock, so it is free but for a moment.
                locked = self._work_lock.acquire(timeout=CLOSE_WAIT_S)
                try:
                    with self._lock:
                        stranded = self._outstanding()
                finally:
                    if locked:
                        self._work_lock.release()
                fail_all(stranded, ClosedError("the client is closed"))
        if self.thread.ident is None:  # never started: nobody else will
            self._release()
            self._waker.close()

    def _close_forked(self) -> None:
        """close() in a child of ``os.fork()``: without the locks, which a thread of
        the parent may have held at the fork (it took the inbox's as the child's first
        request woke it), and which no thread of the child will ever release."""
        if self._closed:
            return
        self._closed = True
        fail_all(self._take_outstanding(), ClosedError("the client is closed"))

    def _run(self) -> None:
        error: IpuserveError = ClosedError("the client is closed")
        try:
            self._loop()
        except Exception as exc:  # never leave callers waiting on a dead thread
            log.exception("client I/O thread failed")
            self._crash = exc
            error = UnavailableError(f"the client's I/O thread failed: {exc!r}")
        finally:
            with self._work_lock:  # a caller may be sending: let it finish first
                with self._lock:
                    self._closed = True
                    leftovers = self._take_outstanding()
                self._release()
                self._waker.close()  # here, not in close(): that may run on this very thread
            fail_all(leftovers, error)


def fail_all(leftovers: list[Pending], error: IpuserveError) -> None:
    """Fail each of ``leftovers`` with its own copy of ``error``."""
    for pending in leftovers:
        pending.fail(type(error)(str(error)))
