"""``SpscRingBuffer``: the fixed-size single-producer / single-consumer ring under every queue.

The ring holds ``num_buffers`` slot objects created once by ``factory`` and reused:
the producer fills a slot in place between :meth:`~SpscRingBuffer.writeLock` and
:meth:`~SpscRingBuffer.writeComplete`; the consumer reads it between
:meth:`~SpscRingBuffer.readLock` and :meth:`~SpscRingBuffer.readComplete`. Several
slots may be read-locked at once; they are released oldest first.

The C++ original is lock-free. Here one :class:`threading.Condition` guards four
integers; the fast paths take the lock once, touch no allocator, and notify only
when somebody is actually waiting.

Blocking calls return at once when the ring is invalidated (now and until
:meth:`~SpscRingBuffer.reset`); whatever they return then must not be used, so the
caller checks :meth:`~SpscRingBuffer.isValid` afterwards, as in the spec::

    dst = rb.writeLock()
    if not rb.isValid():
        return          # dst is not valid: don't touch it
    dst.data = ...
    rb.writeComplete()
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeAlias, TypeVar, cast

from ipuserve.errors import ConfigError, RuntimeUsageError

if TYPE_CHECKING:
    from ipuserve.runtime.queues import InputData, OutputData

__all__ = ["InputRingBuffer", "OutputRingBuffer", "ReadTimeoutCallback", "SpscRingBuffer"]

T = TypeVar("T")

#: Called (on the consumer's thread, without the ring's lock) each time a readLock()
#: wait outlasts its timeout.
ReadTimeoutCallback: TypeAlias = Callable[["SpscRingBuffer[Any]"], None]


class SpscRingBuffer(Generic[T]):
    """A fixed-size ring of reusable slots shared by one producer and one consumer thread.

    Positions are running counts, never wrapped: ``_written`` slots were completed by
    the producer, ``_released`` of them were freed by the consumer, and ``_read_locked``
    more are held by the consumer. A slot index is a count modulo ``num_buffers``.
    """

    def __init__(
        self,
        num_buffers: int,
        label: str,
        timeout_cb: Callable[[SpscRingBuffer[T]], None] | None = None,
        timeout_ns: int = 0,
        factory: Callable[[], T] | None = None,
    ) -> None:
        if num_buffers < 1:
            raise ConfigError(f"ring buffer {label!r} needs at least one buffer, got {num_buffers}")
        if timeout_ns < 0:
            raise ConfigError(f"ring buffer {label!r}: timeout_ns must be >= 0, got {timeout_ns}")
        self._size = num_buffers
        self._label = label
        self._timeout_cb = timeout_cb
        self._timeout_ns = timeout_ns
        self._factory = factory
        # One plain lock guards the ring; sleepers wait on a pre-locked lock of their
        # own that the waker releases. That is what threading.Condition does, minus its
        # Python-level ownership checks on every notify -- this is the hot path.
        self._lock = threading.Lock()
        self._waiters: list[Any] = []
        self._sleepers = 0
        #: readLock() calls that had to wait for a slot (ipuserve extension: the
        #: simulated device asks whether it waited for the host, :meth:`readWaits`).
        self._read_waits = 0
        self._reinitialise()

    def _reinitialise(self) -> None:
        """Fresh slots and counters; drops every reference the old slots held."""
        make = self._factory
        self._slots: list[T] = [make() if make else cast(T, None) for _ in range(self._size)]
        self._written = 0
        self._released = 0
        self._read_locked = 0
        self._write_locked = False
        self._valid = True
        self._interrupted = False

    # -- producer ------------------------------------------------------------------
    def write(self, obj: T) -> None:
        """Put ``obj`` in the next slot and publish it (blocks while the ring is full).

        Python has no copy-assignment: the slot *becomes* ``obj``, so a later
        writeLock() may hand ``obj`` back for reuse. Dropped if the ring is invalid.
        """
        with self._lock:
            if not self._lock_write_slot():
                return
            self._slots[self._written % self._size] = obj
            self._publish()

    def writeWith(self, fill: Callable[[T], None]) -> bool:
        """Lock the next slot, ``fill(slot)`` and publish it, in one critical section.

        ipuserve's fast path for enqueue (one lock round trip instead of two);
        ``fill`` must be quick and must not call into this ring. Blocks while the
        ring is full; False (nothing written) if the ring is invalid.
        """
        with self._lock:
            if self._write_locked or not self._lock_write_slot():
                if not self._valid:
                    return False
                raise RuntimeUsageError(
                    f"ring buffer {self._label!r}: writeWith() while a slot is write-locked"
                )
            fill(self._slots[self._written % self._size])
            self._publish()
            return True

    def writeLock(self) -> T:
        """The slot to fill next, blocking while the ring is full.

        Returns the same slot again while it is write-locked. Check isValid() after:
        on an invalidated ring the slot returned is not locked and must not be used.
        """
        with self._lock:
            self._lock_write_slot()
            return self._slots[self._written % self._size]

    def writeComplete(self) -> None:
        """Publish the write-locked slot to the consumer."""
        with self._lock:
            if not self._write_locked:
                if self._valid:
                    raise RuntimeUsageError(
                        f"ring buffer {self._label!r}: writeComplete() without writeLock()"
                    )
                return
            self._publish()

    def _lock_write_slot(self) -> bool:
        """Hold the lock. Write-lock the next slot, waiting for room; False if invalid."""
        if not self._write_locked:
            if self._written - self._released == self._size:
                self._sleep_until(self._can_write, None)
            if not self._valid:
                return False
            self._write_locked = True
        return self._valid

    def writeAvailable(self) -> bool:
        """True if writeLock() would not block (ipuserve extension: flushes must not wait)."""
        return self._valid and (self._write_locked or self._written - self._released < self._size)

    def _can_write(self) -> bool:
        return not self._valid or self._written - self._released < self._size

    def _publish(self) -> None:
        self._write_locked = False
        self._written += 1
        self._wake()

    # -- consumer ------------------------------------------------------------------
    def readLock(self, timeout_ns: int | None = None) -> T:
        """The oldest slot not yet read-locked, blocking until one is published.

        Returns early, with a slot that must not be used, once the ring is invalid.
        The wait's timeout is ``timeout_ns`` if given (ipuserve's extension), else the
        constructor's; when it is > 0 and a timeout callback is set, the callback is
        called each time the timeout elapses while still waiting. The callback runs
        without the ring's lock so that it may write to this ring (flush).
        """
        timeout = self._wait_seconds(timeout_ns)
        while True:
            with self._lock:
                if self._can_read() or self._waited_to_read(timeout):
                    if self._interrupted:
                        return self._slots[0]  # not locked: the reader asks takeInterrupt()
                    return self._lock_read_slot()
            if self._timeout_cb is not None:
                self._timeout_cb(self)

    def readComplete(self) -> None:
        """Release the oldest read-locked slot back to the producer."""
        with self._lock:
            if self._read_locked == 0:
                if self._valid:
                    raise RuntimeUsageError(
                        f"ring buffer {self._label!r}: readComplete() without readLock()"
                    )
                return
            self._read_locked -= 1
            self._released += 1
            self._wake()

    def readReset(self) -> None:
        """Un-read-lock every read-locked slot: the next readLock() returns the oldest again."""
        with self._lock:
            self._read_locked = 0
            self._wake()

    def readAvailable(self) -> bool:
        """True if a published slot is waiting to be read-locked."""
        return self._written - self._released > self._read_locked

    def _can_read(self) -> bool:
        return (
            not self._valid
            or self._interrupted
            or self._written - self._released > self._read_locked
        )

    def _waited_to_read(self, timeout: float | None) -> bool:
        self._read_waits += 1
        return self._sleep_until(self._can_read, timeout)

    def readWaits(self) -> int:
        """How many readLock() calls so far found nothing to read and waited."""
        return self._read_waits

    def interrupt(self) -> None:
        """ipuserve extension: the reader's current (or next) readLock() returns at once
        with a slot that must not be used, and :meth:`takeInterrupt` then says True once.

        The ModelRunner hands a lone job to a device blocked on its empty input queue
        this way, without the queue machinery (docs/architecture.md §2.1).
        """
        with self._lock:
            self._interrupted = True
            self._wake()

    def takeInterrupt(self) -> bool:
        """True (once) if the last readLock() returned because of :meth:`interrupt`."""
        if not self._interrupted:  # the hot path: no lock
            return False
        with self._lock:
            interrupted, self._interrupted = self._interrupted, False
            return interrupted

    def _lock_read_slot(self) -> T:
        """Hold the lock and be able to read. On an invalid ring: the slot, unlocked."""
        slot = self._slots[(self._released + self._read_locked) % self._size]
        if self._valid:
            self._read_locked += 1
        return slot

    def _wait_seconds(self, timeout_ns: int | None) -> float | None:
        ns = self._timeout_ns if timeout_ns is None else timeout_ns
        if ns <= 0 or self._timeout_cb is None:
            return None
        return ns / 1e9

    # -- lifetime ------------------------------------------------------------------
    def invalidate(self) -> None:
        """Make every blocking call return at once, now and until reset()."""
        with self._lock:
            self._valid = False
            self._wake()

    def reset(self) -> None:
        """Back to the initial state: empty, valid, fresh slots.

        Only while neither side is using the ring (e.g. after the session stopped).
        """
        with self._lock:
            self._reinitialise()
            self._wake()

    def isValid(self) -> bool:
        return self._valid

    # -- ipuserve extensions -------------------------------------------------------
    def forEachPending(self, visit: Callable[[T], None]) -> None:
        """Call ``visit(slot)`` for each published, not yet released slot, oldest first.

        Runs under the ring's lock, so no visited slot can be released and reused
        meanwhile (what makes marking items cancelled safe). ``visit`` must be quick
        and must not call into this ring.
        """
        with self._lock:
            for count in range(self._released, self._written):
                visit(self._slots[count % self._size])

    # -- introspection -------------------------------------------------------------
    def getState(self, prefix: str) -> str:
        """One line describing the ring, for debugging.

        "N waiting" counts threads blocked in writeLock()/readLock(): what to look at
        when a pipeline stalls.
        """
        with self._lock:
            readable = self._written - self._released - self._read_locked
            free = self._size - (self._written - self._released)
            return (
                f"{prefix}SpscRingBuffer {self._label!r}: "
                f"{'valid' if self._valid else 'invalid'}, {self._size} buffers, "
                f"{readable} readable, {self._read_locked} read-locked, {free} free, "
                f"write-locked={self._write_locked}, {self._sleepers} waiting, "
                f"written={self._written}, released={self._released}"
            )

    def numBuffers(self) -> int:
        """The maximum number of slots the ring can hold."""
        return self._size

    def label(self) -> str:
        return self._label

    def __repr__(self) -> str:
        return self.getState("<") + ">"

    # -- waiting -------------------------------------------------------------------
    def _sleep_until(self, ready: Callable[[], bool], timeout: float | None) -> bool:
        """Hold the lock. Wait for ``ready()``; False if ``timeout`` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not ready():
            waiter = threading.Lock()
            waiter.acquire()
            self._waiters.append(waiter)
            self._sleepers += 1
            self._lock.release()
            try:
                if deadline is None:
                    woken = waiter.acquire()
                else:
                    remaining = deadline - time.monotonic()
                    woken = remaining > 0 and waiter.acquire(True, remaining)
            finally:
                self._lock.acquire()
                self._sleepers -= 1
            if not woken:
                if waiter in self._waiters:  # nobody woke us: stop being wakeable
                    self._waiters.remove(waiter)
                return ready()
        return True

    def _wake(self) -> None:
        """Hold the lock. Wake every sleeper; they re-check their condition.

        Idempotent per waiter: a KeyboardInterrupt in the main thread can land between
        the releases and the clear(), leaving released waiters listed; releasing one
        twice would raise "release unlocked lock" from the next wake (seen when Ctrl-C
        stopped ``tools real-data``). Only wakers release waiters, under the lock, so
        ``locked()`` then ``release()`` cannot race."""
        if self._waiters:
            for waiter in self._waiters:
                if waiter.locked():
                    waiter.release()
            self._waiters.clear()


#: The rings behind InputQueue / OutputQueue; build them with ``factory=InputData``
#: (resp. ``OutputData``) so that every slot is a reusable item.
InputRingBuffer: TypeAlias = SpscRingBuffer["InputData"]
OutputRingBuffer: TypeAlias = SpscRingBuffer["OutputData"]
