"""InputQueue / OutputQueue: packing, splitting, flushing, memory, cancellation, errors.

The device is stood in for by calling the queues' real stream callbacks, on a
background thread wherever a callback may block.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from ipuserve.errors import ClosedError, RuntimeUsageError, TensorError
from ipuserve.runtime.popef.types import TensorInfo
from ipuserve.runtime.queues import (
    InputData,
    InputQueue,
    IQueue,
    OutputData,
    OutputQueue,
)
from ipuserve.runtime.ring_buffer import SpscRingBuffer
from tests.runtime.test_ring_buffer import Background, wait_until, waiting

Array = NDArray[Any]


def input_queue(
    shape: list[int],
    *,
    dtype: str = "float32",
    buffers: int = 16,
    batch_dim: int = 0,
    name: str = "x",
    timeout_cb: Callable[[Any], None] | None = None,
) -> InputQueue:
    ring = SpscRingBuffer(buffers, name, timeout_cb, factory=InputData)
    return InputQueue(ring, TensorInfo(dtype, shape), name=name, batch_dim=batch_dim)


def output_queue(
    shape: list[int],
    *,
    dtype: str = "float32",
    buffers: int = 16,
    batch_dim: int = 0,
    name: str = "y",
) -> OutputQueue:
    ring = SpscRingBuffer(buffers, name, factory=OutputData)
    return OutputQueue(ring, TensorInfo(dtype, shape), name=name, batch_dim=batch_dim)


def read_batch(queue: InputQueue) -> Array:
    """One run's worth of input, as the device would see it."""
    info = queue.tensorInfo()
    offered = np.full(info.shape(), -7, dtype=info.numpyDType())
    replacement = queue.device_callback()(offered)
    return offered if replacement is None else replacement


def write_batch(queue: OutputQueue, result: Array) -> None:
    result = result.copy()
    result.flags.writeable = False  # the device hands outputs read-only
    queue.device_callback()(result)


def samples(first: int, count: int, width: int = 3) -> Array:
    """``count`` distinct samples of ``width`` float32 values, numbered from ``first``."""
    return np.arange(first * width, (first + count) * width, dtype=np.float32).reshape(count, width)


def model(batch: Array) -> Array:
    return batch * 2 + 1  # padding rows (zeros) become ones: visible if leaked


def run_device(inq: InputQueue, outq: OutputQueue, runs: int) -> list[Array]:
    """Stand-in device thread body: ``runs`` runs of read -> model -> write."""
    seen = []
    for _ in range(runs):
        batch = read_batch(inq).copy()
        seen.append(batch)
        write_batch(outq, model(batch))
    return seen


# -- packing and splitting --------------------------------------------------------------


def test_many_small_enqueues_pack_into_batches_while_the_device_runs() -> None:
    rng = np.random.default_rng(1)
    sizes = [int(s) for s in rng.integers(1, 4, size=30)]
    total = sum(sizes)
    batch = 8
    inq = input_queue([batch, 3], buffers=4)  # small ring: the producer must wait
    runs = -(-total // batch)
    device = Background(lambda: [read_batch(inq).copy() for _ in range(runs)])
    items, first = [], 0
    for size in sizes:
        items.append(samples(first, size))
        inq.enqueue(items[-1])
        first += size
    inq.flush()
    expected = np.concatenate([*items, np.zeros(((-total) % batch, 3), np.float32)])
    np.testing.assert_array_equal(np.concatenate(device.result()), expected)


def test_large_enqueue_splits_across_runs() -> None:
    inq = input_queue([4, 3])
    item = samples(0, 10)
    inq.enqueue(item)
    inq.flush()
    got = [read_batch(inq) for _ in range(3)]
    np.testing.assert_array_equal(got[0], item[0:4])
    np.testing.assert_array_equal(got[1], item[4:8])
    np.testing.assert_array_equal(got[2], np.concatenate([item[8:], np.zeros((2, 3))]))


def test_batch_dim_one_packs_along_dim_one() -> None:
    inq = input_queue([2, 4, 3], batch_dim=1)
    parts = [np.arange(n * 6, dtype=np.float32).reshape(2, n, 3) + 100 * n for n in (1, 2, 3, 2)]
    for part in parts:
        inq.enqueue(part)
    whole = np.concatenate(parts, axis=1)
    got = [read_batch(inq) for _ in range(2)]
    np.testing.assert_array_equal(got[0], whole[:, 0:4])
    np.testing.assert_array_equal(got[1], whole[:, 4:8])
    assert inq.batchSize() == 4 and inq.sampleBytes() == 2 * 3 * 4


def test_data_size_uses_only_the_first_samples() -> None:
    inq = input_queue([2, 3])
    item = samples(0, 5)
    inq.enqueue(item, data_size=2 * 12)
    np.testing.assert_array_equal(read_batch(inq), item[:2])


def test_flat_buffers_are_viewed_as_the_tensor_dtype() -> None:
    inq = input_queue([4, 3])
    item = samples(0, 4)
    inq.enqueue(item.tobytes()[:24])  # bytes: 2 samples
    inq.enqueue(bytearray(item.tobytes()[24:]))  # bytearray: 2 more
    np.testing.assert_array_equal(read_batch(inq), item)


def test_flat_array_of_whole_samples_is_accepted() -> None:
    inq = input_queue([2, 3])
    inq.enqueue(np.arange(6, dtype=np.float32))
    np.testing.assert_array_equal(read_batch(inq), np.arange(6).reshape(2, 3))


def test_scalar_tensor_is_one_sample_per_run() -> None:
    inq = input_queue([])
    inq.enqueue(np.array(3.5, dtype=np.float32))
    inq.enqueue(np.array([4.5, 5.5], dtype=np.float32))
    got = [read_batch(inq) for _ in range(3)]
    assert [float(g) for g in got] == [3.5, 4.5, 5.5]
    assert all(g.shape == () for g in got) and inq.batchSize() == 1


# -- zero copy versus copy ----------------------------------------------------------


def test_an_item_covering_the_batch_is_handed_over_without_copying() -> None:
    inq = input_queue([4, 3])
    exact, double = samples(0, 4), samples(10, 8)
    inq.enqueue(exact)
    inq.enqueue(double)
    got = [read_batch(inq) for _ in range(3)]
    assert np.shares_memory(got[0], exact)
    assert np.shares_memory(got[1], double[:4]) and np.shares_memory(got[2], double[4:])
    np.testing.assert_array_equal(np.concatenate(got), np.concatenate([exact, double]))
    assert all(g.flags.c_contiguous and g.shape == (4, 3) for g in got)


def test_zero_copy_resumes_mid_item_at_a_batch_boundary() -> None:
    inq = input_queue([4, 3])
    small, big = samples(0, 2), samples(2, 10)
    inq.enqueue(small)
    inq.enqueue(big)
    first, second, third = (read_batch(inq) for _ in range(3))
    assert not np.shares_memory(first, big)  # mixes two items: copied
    assert np.shares_memory(second, big) and np.shares_memory(third, big)
    np.testing.assert_array_equal(
        np.concatenate([first, second, third]), np.concatenate([small, big])
    )


@pytest.mark.parametrize("layout", ["strided", "fortran"])
def test_non_contiguous_items_are_copied(layout: str) -> None:
    inq = input_queue([4, 3])
    base = samples(0, 8)
    item = base[::2] if layout == "strided" else np.asfortranarray(base[:4])
    inq.enqueue(item)
    offered = np.zeros((4, 3), np.float32)
    assert inq.device_callback()(offered) is None
    np.testing.assert_array_equal(offered, item)
    assert not np.shares_memory(offered, item)


def test_padding_and_split_items_are_copied_into_the_offered_buffer() -> None:
    inq = input_queue([4, 3])
    inq.enqueue(samples(0, 3))
    inq.flush()
    offered = np.full((4, 3), -1, np.float32)
    assert inq.device_callback()(offered) is None
    np.testing.assert_array_equal(offered, np.concatenate([samples(0, 3), np.zeros((1, 3))]))


# -- callbacks, timing, bookkeeping ------------------------------------------------------


def test_read_callbacks_fire_on_first_touch_and_last_sample() -> None:
    inq = input_queue([4, 3])
    events: list[str] = []
    inq.enqueue(
        samples(0, 6),
        None,
        lambda: events.append("start"),
        lambda: events.append("complete"),
        tag="req",
    )
    read_batch(inq)
    assert events == ["start"]
    inq.flush()
    read_batch(inq)
    assert events == ["start", "complete"]


def test_read_complete_callback_also_fires_on_the_zero_copy_path() -> None:
    inq = input_queue([2, 3])
    events: list[str] = []
    inq.enqueue(
        samples(0, 2), None, lambda: events.append("start"), lambda: events.append("complete")
    )
    read_batch(inq)
    assert events == ["start", "complete"]


def test_pending_samples_and_run_tags() -> None:
    inq = input_queue([4, 3])
    inq.enqueue(samples(0, 3), tag="a")
    inq.enqueue(samples(3, 2), tag="b")
    assert inq.pendingSamples() == 5
    read_batch(inq)
    assert inq.lastRunTags() == ("a", "b")
    assert inq.pendingSamples() == 1
    assert inq.paddingSamples() == 3
    assert inq.flush() == 3
    assert inq.pendingSamples() == 4
    read_batch(inq)
    assert inq.lastRunTags() == ("b",)
    assert inq.pendingSamples() == 0


def test_timeout_policy_sees_the_batch_so_far_and_its_first_arrival() -> None:
    calls: list[tuple[int, float | None]] = []

    def policy(queue: IQueue, in_batch: int, first_arrival: float | None) -> int:
        assert queue is inq
        calls.append((in_batch, first_arrival))
        return 100_000

    def flush_on_timeout(_ring: object) -> None:
        inq.flush()

    inq = input_queue([4, 3], timeout_cb=flush_on_timeout)
    inq.setReadTimeoutPolicy(policy)
    before = time.monotonic()
    inq.enqueue(samples(0, 2))
    after = time.monotonic()
    batch = read_batch(inq)  # waits for 2 more samples, times out, flushes
    np.testing.assert_array_equal(batch, np.concatenate([samples(0, 2), np.zeros((2, 3))]))
    assert [c[0] for c in calls] == [0, 2]
    assert calls[0][1] is None
    assert calls[1][1] is not None and before <= calls[1][1] <= after


# -- flushing keeps inputs and outputs in step ------------------------------------------


def test_flush_padding_outputs_never_reach_an_item() -> None:
    inq, outq = input_queue([4, 3]), output_queue([4, 3])
    a, b, c = samples(0, 3), samples(3, 4), samples(7, 2)
    got: dict[str, Array] = {}

    def request(name: str, data: Array) -> None:
        inq.enqueue(data, tag=name)
        outq.enqueue(
            None, data.nbytes, lambda out, n=name: got.__setitem__(n, out.copy()), tag=name
        )

    request("a", a)  # mid-batch flush: pads one sample
    inq.flush()
    outq.flush()
    request("b", b)  # exactly one batch, then a boundary flush:
    inq.flush()  # a whole dummy batch
    outq.flush()
    request("c", c)
    inq.flush()
    outq.flush()
    seen = run_device(inq, outq, runs=4)
    assert set(got) == {"a", "b", "c"}
    for name, data in (("a", a), ("b", b), ("c", c)):
        np.testing.assert_array_equal(got[name], model(data))
    np.testing.assert_array_equal(seen[2], np.zeros((4, 3)))  # the dummy batch
    assert inq.pendingSamples() == 0 and outq.pendingSamples() == 0


def test_flush_with_given_padding_values() -> None:
    inq = input_queue([4, 3])
    inq.enqueue(samples(0, 1))
    pad = np.full((3, 3), 9, np.float32)
    assert inq.flush(pad) == 3
    np.testing.assert_array_equal(read_batch(inq), np.concatenate([samples(0, 1), pad]))
    inq.enqueue(samples(0, 1))
    with pytest.raises(TensorError, match=r"tensor 'x'.*expected 3 padding samples, given 2"):
        inq.flush(np.zeros((2, 3), np.float32))


def test_output_flush_counts_the_samples_its_handler_discards() -> None:
    outq = output_queue([4, 3])
    outq.enqueue(None, 3 * 12)
    assert outq.paddingSamples() == 1
    outq.flush()
    assert outq.pendingSamples() == 4 and outq.paddingSamples() == 4
    write_batch(outq, samples(0, 4))
    assert outq.pendingSamples() == 0


def test_output_dummy_at_a_boundary_discards_a_whole_batch() -> None:
    outq = output_queue([2, 3])
    got: list[Array] = []
    outq.flush()
    outq.enqueue(None, 2 * 12, got.append)
    write_batch(outq, samples(0, 2))  # discarded by the dummy
    write_batch(outq, samples(2, 2))
    assert len(got) == 1
    np.testing.assert_array_equal(got[0], samples(2, 2))


# -- output memory -------------------------------------------------------------------


def test_outputs_split_across_items_into_user_memory() -> None:
    outq = output_queue([4, 3])
    sizes = [3, 7, 6]
    targets = [np.zeros((n, 3), np.float32) for n in sizes]
    filled: list[Array] = []
    for target in targets:
        outq.enqueue(target, None, filled.append)
    produced = samples(0, 16)
    for run in range(4):
        write_batch(outq, produced[4 * run : 4 * run + 4])
    np.testing.assert_array_equal(np.concatenate(targets), produced)
    assert all(f is t for f, t in zip(filled, targets, strict=True))


def test_user_output_memory_as_a_writable_buffer() -> None:
    outq = output_queue([2, 3])
    target = bytearray(2 * 12)
    outq.enqueue(target)
    write_batch(outq, samples(0, 2))
    np.testing.assert_array_equal(np.frombuffer(target, np.float32).reshape(2, 3), samples(0, 2))


def test_queue_provided_output_is_a_view_within_one_run() -> None:
    outq = output_queue([4, 3])
    got: list[Array] = []
    outq.enqueue(None, 1 * 12, got.append)
    outq.enqueue(None, 3 * 12, got.append)
    result = samples(0, 4)
    result.flags.writeable = False
    outq.device_callback()(result)
    assert np.shares_memory(got[0], result) and np.shares_memory(got[1], result)
    assert not got[0].flags.writeable
    np.testing.assert_array_equal(np.concatenate(got), result)


def test_queue_provided_output_spanning_runs_is_assembled() -> None:
    outq = output_queue([4, 3])
    got: list[Array] = []
    outq.enqueue(None, 2 * 12)
    outq.enqueue(None, 5 * 12, got.append)
    outq.enqueue(None, 1 * 12)
    runs = [samples(0, 4), samples(4, 4)]
    for run in runs:
        outq.device_callback()(run)
    assert got[0].shape == (5, 3) and got[0].flags.writeable
    assert not any(np.shares_memory(got[0], run) for run in runs)
    np.testing.assert_array_equal(got[0], samples(2, 5))


def test_queue_provided_output_along_batch_dim_one() -> None:
    outq = output_queue([2, 4, 3], batch_dim=1)
    got: list[Array] = []
    outq.enqueue(None, 3 * 24, got.append)
    outq.enqueue(None, 3 * 24, got.append)
    outq.flush()
    runs = [np.arange(24, dtype=np.float32).reshape(2, 4, 3) + 100 * r for r in range(2)]
    for run in runs:
        outq.device_callback()(run)
    whole = np.concatenate(runs, axis=1)
    np.testing.assert_array_equal(got[0], whole[:, 0:3])
    np.testing.assert_array_equal(got[1], whole[:, 3:6])


# -- cancellation --------------------------------------------------------------------


def test_cancelled_items_are_skipped_but_keep_their_place() -> None:
    inq, outq = input_queue([4, 3]), output_queue([4, 3])
    events: list[str] = []
    outputs = {name: np.full((2, 3), -1, np.float32) for name in "abc"}
    for first, name in enumerate("abc"):
        inq.enqueue(
            samples(2 * first, 2),
            None,
            lambda n=name: events.append(f"start {n}"),
            lambda n=name: events.append(f"read {n}"),
            tag=name,
        )
        outq.enqueue(
            outputs[name], None, lambda _out, n=name: events.append(f"wrote {n}"), tag=name
        )
    assert inq.cancel("b") == 1 and outq.cancel("b") == 1
    inq.flush()
    outq.flush()
    seen = run_device(inq, outq, runs=2)
    np.testing.assert_array_equal(seen[0], np.concatenate([samples(0, 2), np.zeros((2, 3))]))
    np.testing.assert_array_equal(outputs["a"], model(samples(0, 2)))
    np.testing.assert_array_equal(outputs["c"], model(samples(4, 2)))
    assert np.all(outputs["b"] == -1)
    assert not any(event.endswith(" b") for event in events)


def test_cancelling_an_item_split_across_runs_zeros_its_rest() -> None:
    inq = input_queue([4, 3])
    events: list[str] = []
    inq.enqueue(samples(0, 6), None, None, lambda: events.append("read"), tag=7)
    read_batch(inq)
    assert inq.cancel(7) == 1
    inq.flush()
    np.testing.assert_array_equal(read_batch(inq), np.zeros((4, 3)))
    assert events == []
    with pytest.raises(RuntimeUsageError, match="needs a tag"):
        inq.cancel(None)


# -- disconnect and reset --------------------------------------------------------------


def test_disconnect_lets_a_blocked_input_callback_finish_with_zeros() -> None:
    inq = input_queue([4, 3], name="blocked")
    inq.enqueue(samples(0, 1))
    device = Background(lambda: read_batch(inq))
    wait_until(waiting(inq._ring))  # the device waits for 3 more samples
    inq.disconnect()
    np.testing.assert_array_equal(
        device.result(), np.concatenate([samples(0, 1), np.zeros((3, 3))])
    )
    np.testing.assert_array_equal(read_batch(inq), np.zeros((4, 3)))  # and never blocks


def test_disconnect_lets_a_blocked_output_callback_finish() -> None:
    outq = output_queue([4, 3])
    device = Background(lambda: write_batch(outq, samples(0, 4)))
    wait_until(waiting(outq._ring))
    outq.disconnect()
    device.result()
    write_batch(outq, samples(0, 4))


def test_disconnected_queues_refuse_enqueues_and_ignore_flushes() -> None:
    inq, outq = input_queue([4, 3]), output_queue([4, 3])
    inq.disconnect()
    outq.disconnect()
    with pytest.raises(ClosedError, match="'x' is disconnected"):
        inq.enqueue(samples(0, 1))
    with pytest.raises(ClosedError, match="'y' is disconnected"):
        outq.enqueue(None, 12)
    assert inq.flush() == 0
    outq.flush()


def test_disconnect_releases_a_producer_blocked_on_a_full_queue() -> None:
    inq = input_queue([4, 3], buffers=1)
    inq.enqueue(samples(0, 1))
    producer = Background(lambda: inq.enqueue(samples(1, 1)))
    wait_until(waiting(inq._ring))
    inq.disconnect()
    with pytest.raises(ClosedError):
        producer.result()


def test_reset_makes_a_disconnected_queue_usable_again() -> None:
    inq = input_queue([2, 3])
    inq.enqueue(samples(0, 1))
    inq.disconnect()
    inq.reset()
    assert inq.pendingSamples() == 0 and inq.paddingSamples() == 2
    inq.enqueue(samples(5, 2))
    np.testing.assert_array_equal(read_batch(inq), samples(5, 2))


# -- the spec's low-level producer API -------------------------------------------------


def test_enqueue_lock_and_complete() -> None:
    inq = input_queue([2, 3])
    item = inq.enqueueLock()
    assert inq.enqueueLock() is item
    item.data = samples(0, 2)
    item.data_size = 24
    inq.enqueueComplete()
    np.testing.assert_array_equal(read_batch(inq), samples(0, 2))
    with pytest.raises(RuntimeUsageError, match="without enqueueLock"):
        inq.enqueueComplete()


def test_flush_completes_an_item_held_from_enqueue_lock_then_pads() -> None:
    """Spec: flush() flushes "any partial input still being created". It once wrote
    the padding over the held item: its samples never reached the device, and the
    producer's enqueueComplete() then raised."""
    inq, outq = input_queue([4, 3]), output_queue([4, 3])
    item = inq.enqueueLock()
    item.data, item.data_size = samples(0, 3), 36
    assert inq.flush() == 1  # the held item's 3 samples, then 1 of padding
    out, result = outq.enqueueLock(), np.zeros((3, 3), np.float32)
    out.data, out.data_size = result, 36
    outq.flush()  # completes the held output item, then discards the padding
    (seen,) = run_device(inq, outq, runs=1)
    np.testing.assert_array_equal(seen, np.vstack([samples(0, 3), np.zeros((1, 3), np.float32)]))
    np.testing.assert_array_equal(result, model(samples(0, 3)))
    with pytest.raises(RuntimeUsageError, match="without enqueueLock"):
        inq.enqueueComplete()


def test_a_flushed_held_item_that_ends_a_batch_needs_no_padding() -> None:
    inq = input_queue([2, 3])
    item = inq.enqueueLock()
    item.data, item.data_size = samples(4, 2), 24
    assert inq.flush() == 0
    assert inq.pendingSamples() == 2
    np.testing.assert_array_equal(read_batch(inq), samples(4, 2))


def test_enqueue_complete_checks_what_was_filled_in() -> None:
    inq = input_queue([2, 3], name="low")
    item = inq.enqueueLock()
    item.data = np.zeros((2, 4), np.float32)
    with pytest.raises(TensorError, match="tensor 'low'"):
        inq.enqueueComplete()
    item.data = np.zeros((2, 3), np.float32)
    inq.enqueueComplete()


# -- bad inputs ----------------------------------------------------------------------


def _enqueue_read_only_output() -> None:
    array = np.zeros((1, 3), np.float32)
    array.flags.writeable = False
    output_queue([4, 3], name="img").enqueue(array)


def _bad_batch_dim() -> None:
    input_queue([4, 3], name="img", batch_dim=2)


def _enqueue(data: object, data_size: int | None = None) -> Callable[[], None]:
    return lambda: input_queue([4, 3], name="img").enqueue(data, data_size)


BAD_INPUTS: list[tuple[str, Callable[[], None], str]] = [
    ("dtype", _enqueue(np.zeros((2, 3), np.int64)), r"expected dtype float32, given int64"),
    ("shape", _enqueue(np.zeros((2, 5), np.float32)), r"expected shape \[N, 3\].*given \[2, 5\]"),
    (
        "ndim",
        _enqueue(np.zeros((1, 2, 3), np.float32)),
        r"expected shape \[N, 3\].*given \[1, 2, 3\]",
    ),
    (
        "bytes",
        _enqueue(b"\0" * 20),
        r"expected a whole, non-zero number of samples \(12 bytes each\), given 20 bytes",
    ),
    ("flat", _enqueue(np.zeros(4, np.float32)), r"samples \(12 bytes each\), given 16 bytes"),
    ("data_size", _enqueue(samples(0, 2), 13), r"samples \(12 bytes each\), given 13 bytes"),
    (
        "too_much",
        _enqueue(samples(0, 2), 36),
        r"expected data_size <= 24 bytes \(the 2 samples given\), given 36 bytes",
    ),
    (
        "empty",
        _enqueue(np.zeros((0, 3), np.float32)),
        r"expected at least one sample, given shape \[0, 3\]",
    ),
    (
        "type",
        _enqueue([1.0, 2.0, 3.0]),
        r"expected a numpy array of float32 or a buffer, given list",
    ),
    (
        "read_only",
        _enqueue_read_only_output,
        r"expected writable memory for outputs, given read-only memory",
    ),
    (
        "no_size",
        lambda: output_queue([4, 3], name="img").enqueue(None),
        r"expected data_size in bytes when no memory is given",
    ),
    ("batch_dim", _bad_batch_dim, r"expected batch_dim in \[0, 2\), given 2 for shape \[4, 3\]"),
]


@pytest.mark.parametrize(
    ("case", "action", "message"), BAD_INPUTS, ids=[case for case, _, _ in BAD_INPUTS]
)
def test_bad_input_errors_name_the_tensor_and_say_expected_versus_given(
    case: str, action: Callable[[], None], message: str
) -> None:
    with pytest.raises(TensorError, match=message) as caught:
        action()
    text = str(caught.value)
    assert text.startswith("tensor 'img': ")
    assert "expected" in text and "given" in text


# -- end to end through both queues ---------------------------------------------------


def test_random_requests_round_trip_through_a_device_thread() -> None:
    rng = np.random.default_rng(7)
    inq, outq = input_queue([8, 3], buffers=4), output_queue([8, 3], buffers=4)
    sizes = [int(s) for s in rng.integers(1, 12, size=200)]
    runs = -(-sum(sizes) // 8)
    device = Background(lambda: run_device(inq, outq, runs))
    results: dict[int, Array] = {}
    requests, first = [], 0
    for number, size in enumerate(sizes):
        data = samples(first, size)
        first += size
        requests.append(data)
        inq.enqueue(data, tag=number)
        outq.enqueue(
            None,
            data.nbytes,
            lambda out, n=number: results.__setitem__(n, np.array(out)),
            tag=number,
        )
    inq.flush()
    outq.flush()
    device.result(30)
    assert len(results) == len(sizes)
    for number, data in enumerate(requests):
        np.testing.assert_array_equal(results[number], model(data))
