"""A hand-off queue from any thread to one loop that polls file descriptors.

The one inbox of ipuserve's loops: callers hand requests to the client's I/O thread
(:mod:`ipuserve.client.thread_loop`), backend threads hand outcomes to the worker's
socket loop (:mod:`ipuserve.worker.node`, its ``Mailbox``). A deque and a
:class:`~ipuserve.waker.Waker`: :meth:`Inbox.put` wakes only on the empty ->
non-empty transition (one write per burst), and the check, the append and the wake
share a lock with :meth:`Inbox.take`'s swap; ``take`` clears the waker *before* it
swaps, so a put racing with it at worst causes one spurious wake-up and a wake-up is
never lost.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Generic, TypeVar

from ipuserve.waker import Waker

T = TypeVar("T")


class Inbox(Generic[T]):
    """Items from any thread for the loop that polls :attr:`fd`."""

    def __init__(self) -> None:
        self.waker = Waker()
        self.fd = self.waker.fileno()
        self._items: deque[T] = deque()
        #: guards the items; an owner may hold it around :meth:`put_locked` to check
        #: its own state (closed?) in the same step
        self.lock = threading.Lock()

    def put(self, item: T) -> None:
        with self.lock:
            self.put_locked(item)

    def put_locked(self, item: T) -> None:
        """:meth:`put` with :attr:`lock` already held."""
        was_empty = not self._items
        self._items.append(item)
        if was_empty:
            self.waker.wake()

    @property
    def ready(self) -> bool:
        """Items wait (read without the lock: a racing put also wakes the loop)."""
        return bool(self._items)

    def wake(self) -> None:
        """Wake the loop with nothing to take (a stop request); safe in a signal handler."""
        self.waker.wake()

    def take(self) -> deque[T]:
        """Everything put so far, in order; clears the wake-up first."""
        self.waker.clear()
        with self.lock:
            return self.take_locked()

    def take_locked(self) -> deque[T]:
        """:meth:`take` with :attr:`lock` held and the waker left as it is."""
        items, self._items = self._items, deque()
        return items

    def peek_locked(self) -> list[T]:
        """What waits, left in place (:attr:`lock` held)."""
        return list(self._items)

    def close(self) -> None:
        self.waker.close()
