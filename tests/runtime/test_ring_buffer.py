"""SpscRingBuffer: ordering under concurrency, blocking, invalidation, timeouts, state."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from ipuserve.errors import ConfigError, RuntimeUsageError
from ipuserve.runtime.ring_buffer import SpscRingBuffer
from tests.helpers import wait_until


class Background:
    """Run ``fn`` on a daemon thread; ``result()`` re-raises what it raised."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._value = fn()
        except BaseException as exc:
            self._error = exc

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self, timeout: float = 10.0) -> Any:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "background call did not return"
        if self._error is not None:
            raise self._error
        return self._value


def waiting(rb: SpscRingBuffer[Any], count: int = 1) -> Callable[[], bool]:
    return lambda: f", {count} waiting," in rb.getState("")


class Box:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: Any = None


def test_100k_items_cross_threads_in_order_with_nothing_lost() -> None:
    n = 100_000
    rb: SpscRingBuffer[Box] = SpscRingBuffer(64, "stress", factory=Box)

    def produce() -> None:
        for i in range(n):
            slot = rb.writeLock()
            slot.value = i
            rb.writeComplete()

    def consume() -> list[int]:
        seen = []
        for _ in range(n):
            seen.append(rb.readLock().value)
            rb.readComplete()
        return seen

    consumer = Background(consume)
    producer = Background(produce)
    producer.result(30)
    assert consumer.result(30) == list(range(n))
    assert not rb.readAvailable()


def test_write_then_read_in_fifo_order_through_wraparound() -> None:
    rb: SpscRingBuffer[int] = SpscRingBuffer(3, "fifo")
    out = []
    for i in range(10):
        rb.write(i)
        out.append(rb.readLock())
        rb.readComplete()
    assert out == list(range(10))


def test_write_lock_returns_the_same_slot_until_completed() -> None:
    rb: SpscRingBuffer[Box] = SpscRingBuffer(2, "same", factory=Box)
    first = rb.writeLock()
    assert rb.writeLock() is first
    rb.writeComplete()
    assert rb.writeLock() is not first


def test_several_slots_read_locked_and_released_oldest_first() -> None:
    rb: SpscRingBuffer[str] = SpscRingBuffer(3, "multi")
    for word in "abc":
        rb.write(word)
    assert [rb.readLock(), rb.readLock()] == ["a", "b"]
    assert rb.readAvailable()
    rb.readComplete()  # frees "a": one slot for the producer again
    rb.write("d")
    assert [rb.readLock(), rb.readLock()] == ["c", "d"]
    assert not rb.readAvailable()


def test_read_reset_puts_read_locked_slots_back_in_front() -> None:
    rb: SpscRingBuffer[str] = SpscRingBuffer(4, "reset")
    for word in "abc":
        rb.write(word)
    assert [rb.readLock(), rb.readLock()] == ["a", "b"]
    rb.readReset()
    assert rb.readLock() == "a"
    rb.readComplete()
    assert [rb.readLock(), rb.readLock()] == ["b", "c"]


def test_read_reset_releases_a_blocked_reader() -> None:
    rb: SpscRingBuffer[str] = SpscRingBuffer(2, "reset-wake")
    rb.write("only")
    assert rb.readLock() == "only"
    second = Background(rb.readLock)  # nothing more to read: blocks
    wait_until(waiting(rb))
    rb.readReset()
    assert second.result() == "only"
    assert rb.isValid()


def test_read_lock_waits_for_the_producer() -> None:
    rb: SpscRingBuffer[int] = SpscRingBuffer(2, "wait")
    reader = Background(rb.readLock)
    wait_until(waiting(rb))
    assert not reader.done()
    rb.write(7)
    assert reader.result() == 7


def test_invalidate_releases_a_reader_blocked_on_empty() -> None:
    rb: SpscRingBuffer[int] = SpscRingBuffer(2, "empty")
    reader = Background(lambda: (rb.readLock(), rb.isValid()))
    wait_until(waiting(rb))
    rb.invalidate()
    _, valid = reader.result()
    assert valid is False


def test_invalidate_releases_a_writer_blocked_on_full() -> None:
    rb: SpscRingBuffer[int] = SpscRingBuffer(2, "full")
    rb.write(1)
    rb.write(2)
    writer = Background(lambda: (rb.writeLock(), rb.isValid()))
    wait_until(waiting(rb))
    assert not writer.done()
    rb.invalidate()
    _, valid = writer.result()
    assert valid is False


def test_invalid_ring_never_blocks_until_reset() -> None:
    rb: SpscRingBuffer[int] = SpscRingBuffer(1, "invalid")
    rb.write(1)
    rb.invalidate()
    rb.writeLock()  # full, but returns at once
    rb.write(2)  # dropped
    rb.readLock()
    rb.readLock()  # nothing more to read, still returns
    rb.readComplete()  # no-ops instead of precondition errors
    rb.writeComplete()
    assert not rb.isValid()
    rb.reset()
    assert rb.isValid()
    assert not rb.readAvailable()
    rb.write(3)
    assert rb.readLock() == 3


def test_reset_recreates_the_slots() -> None:
    made: list[Box] = []

    def factory() -> Box:
        made.append(Box())
        return made[-1]

    rb: SpscRingBuffer[Box] = SpscRingBuffer(2, "fresh", factory=factory)
    rb.writeLock().value = "user memory"
    rb.writeComplete()
    rb.reset()
    assert len(made) == 4
    assert rb.writeLock() is made[2]
    assert made[2].value is None


def test_timeout_callback_called_while_waiting_and_may_write() -> None:
    calls: list[int] = []

    def on_timeout(ring: SpscRingBuffer[str]) -> None:
        calls.append(1)
        if len(calls) == 3:
            ring.write("flushed")  # runs without the ring's lock held

    rb: SpscRingBuffer[str] = SpscRingBuffer(2, "timeout", on_timeout, timeout_ns=200_000)
    assert rb.readLock() == "flushed"
    assert len(calls) == 3


def test_per_call_timeout_overrides_the_ring_default() -> None:
    fired = threading.Event()

    def on_timeout(ring: SpscRingBuffer[int]) -> None:
        fired.set()
        ring.write(1)

    rb: SpscRingBuffer[int] = SpscRingBuffer(2, "per-call", on_timeout, timeout_ns=0)
    assert rb.readLock(timeout_ns=100_000) == 1
    assert fired.is_set()


def test_zero_timeout_waits_forever_without_calling_back() -> None:
    fired = threading.Event()
    rb: SpscRingBuffer[int] = SpscRingBuffer(
        2, "forever", lambda _: fired.set(), timeout_ns=100_000
    )
    reader = Background(lambda: rb.readLock(timeout_ns=0))
    wait_until(waiting(rb))
    rb.write(5)
    assert reader.result() == 5
    assert not fired.is_set()


def test_timeout_callback_stops_when_invalidated() -> None:
    calls = []

    def give_up(ring: SpscRingBuffer[int]) -> None:
        calls.append(1)
        ring.invalidate()

    rb: SpscRingBuffer[int] = SpscRingBuffer(2, "stop", give_up, timeout_ns=100_000)
    rb.readLock()
    assert not rb.isValid()
    assert calls == [1]


def test_get_state_describes_the_ring() -> None:
    rb: SpscRingBuffer[int] = SpscRingBuffer(4, "state")
    rb.write(1)
    rb.write(2)
    rb.readLock()
    rb.writeLock()
    state = rb.getState(">> ")
    assert state.startswith(">> ")
    for part in (
        "'state'",
        "valid",
        "4 buffers",
        "1 readable",
        "1 read-locked",
        "2 free",
        "write-locked=True",
        "0 waiting",
        "written=2",
        "released=0",
    ):
        assert part in state
    rb.invalidate()
    assert "invalid" in rb.getState("")


def test_precondition_violations_raise() -> None:
    rb: SpscRingBuffer[int] = SpscRingBuffer(2, "misuse")
    with pytest.raises(RuntimeUsageError, match="writeComplete"):
        rb.writeComplete()
    with pytest.raises(RuntimeUsageError, match="readComplete"):
        rb.readComplete()
    with pytest.raises(ConfigError, match="at least one"):
        SpscRingBuffer(0, "none")


def test_for_each_pending_visits_unreleased_slots_oldest_first() -> None:
    rb: SpscRingBuffer[str] = SpscRingBuffer(4, "pending")
    for word in "abcd":
        rb.write(word)
    rb.readLock()
    rb.readComplete()
    rb.readLock()  # "b" read-locked: still pending
    seen: list[str] = []
    rb.forEachPending(seen.append)
    assert seen == ["b", "c", "d"]


def test_introspection() -> None:
    rb: SpscRingBuffer[int] = SpscRingBuffer(5, "intro")
    assert rb.numBuffers() == 5
    assert rb.label() == "intro"
    assert rb.isValid()
    assert not rb.readAvailable()


def test_a_wake_cut_short_by_ctrl_c_does_not_break_the_next_one() -> None:
    """KeyboardInterrupt can land inside a wake, after it released its waiters and
    before it forgot them; the next wake (close's invalidate) must not release them a
    second time ("release unlocked lock" ended `tools real-data` on Ctrl-C)."""
    rb: SpscRingBuffer[int] = SpscRingBuffer(2, "interrupted")
    released = threading.Lock()  # what the cut-short wake left behind: listed, unlocked
    rb._waiters.append(released)
    rb.invalidate()
    assert rb._waiters == []
    rb.reset()
    rb.write(7)
    assert rb.readLock() == 7


def test_interrupt_releases_a_reader_blocked_on_empty_once() -> None:
    """The ModelRunner's lone-job path: the reader returns, knows why, and reads on."""
    rb: SpscRingBuffer[int] = SpscRingBuffer(2, "interrupted")
    reader = Background(lambda: (rb.readLock(), rb.takeInterrupt()))
    wait_until(waiting(rb))
    rb.interrupt()
    _, interrupted = reader.result()
    assert interrupted is True and rb.takeInterrupt() is False
    assert rb.readWaits() == 1
    rb.write(5)  # nothing was read-locked: the next item is read as usual
    assert rb.readLock() == 5 and rb.takeInterrupt() is False
    assert rb.readWaits() == 1  # it was there: no wait


def test_an_interrupt_before_the_read_returns_before_a_published_item() -> None:
    rb: SpscRingBuffer[int] = SpscRingBuffer(2, "early")
    rb.interrupt()
    rb.write(9)
    rb.readLock()
    assert rb.takeInterrupt() is True
    assert rb.readLock() == 9


def test_reset_forgets_an_interrupt() -> None:
    rb: SpscRingBuffer[int] = SpscRingBuffer(2, "forgotten")
    rb.interrupt()
    rb.reset()
    rb.write(3)
    assert rb.readLock() == 3 and rb.takeInterrupt() is False
