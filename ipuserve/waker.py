"""Wake a thread that sleeps in ``zmq.Poller.poll`` from other threads.

The one doorbell of every loop in ipuserve: callers hand work to the client's I/O
thread, backend threads hand outcomes to the worker's socket loop, and a stop request
(from another thread or a signal handler) reaches the broker's or the worker's loop.
Each loop polls this waker's file descriptor beside its sockets. An eventfd where the
OS has one (Linux), a non-blocking pipe elsewhere. Writers should only call
:meth:`wake` on their queue's empty -> non-empty transition: one write per burst
(:class:`ipuserve.inbox.Inbox` is that queue).
"""

from __future__ import annotations

import os
import threading


class Waker:
    """A readable file descriptor that :meth:`wake` makes ready and :meth:`clear` resets.

    :meth:`close` may race with :meth:`wake` from any thread: both hold one lock, and a
    wake after the close does nothing (it must not write into whatever file reuses
    the descriptor's number). The lock is re-entrant: a signal handler may call
    :meth:`wake` on the thread that holds it.
    """

    def __init__(self) -> None:
        if hasattr(os, "eventfd"):
            fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            self._read_fd, self._write_fd = fd, fd
        else:  # pragma: no cover - non-Linux
            self._read_fd, self._write_fd = os.pipe()
            os.set_blocking(self._read_fd, False)
            os.set_blocking(self._write_fd, False)
        self._closed = False
        self._lock = threading.RLock()

    def fileno(self) -> int:
        return self._read_fd

    def wake(self) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                os.write(self._write_fd, (1).to_bytes(8, "little"))
            except BlockingIOError:
                pass  # already signalled (full)

    def clear(self) -> None:
        """Consume pending wake-ups; call *before* draining the hand-off queue."""
        try:
            while os.read(self._read_fd, 4096):
                if self._read_fd == self._write_fd:
                    break
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self._read_fd)
            if self._write_fd != self._read_fd:
                os.close(self._write_fd)
