"""Client against a real ROUTER peer (tests/client/fake_broker.py): results, errors, liveness."""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest
import zmq

from ipuserve import errors
from ipuserve import protocol as wire
from ipuserve.client import lifecycle
from ipuserve.client.client import Client
from ipuserve.client.config import ClientConfig
from ipuserve.client.core import Core
from ipuserve.client.link import Link
from ipuserve.client.pending import InferFuture
from ipuserve.client.sockets import LinkSocket
from tests.client.faces import MakeClient
from tests.client.fake_broker import ADD, FakeBroker, add_handler, inputs
from tests.helpers import wait_until

FAST = ClientConfig(ping_interval_s=0.05, liveness_s=0.3)


@pytest.fixture
def broker() -> Iterator[FakeBroker]:
    fake = FakeBroker().start()
    yield fake
    fake.stop()


@pytest.fixture
def client(broker: FakeBroker) -> Iterator[Client]:
    with Client(broker.address, timeout=10, config=FAST) as c:
        yield c


def only_link(client: Client) -> Link:
    (link,) = client._io.core.links.values()
    return link


def expected(arrays: dict[str, np.ndarray[Any, Any]]) -> np.ndarray[Any, Any]:
    return arrays["a"] + arrays["b"]


class Counter:
    """Fires ``reached`` when ``add`` was called ``target`` times (no sleeps needed)."""

    def __init__(self, target: int) -> None:
        self.target, self.count = target, 0
        self.reached = threading.Event()
        self._lock = threading.Lock()

    def add(self) -> None:
        with self._lock:
            self.count += 1
            if self.count >= self.target:
                self.reached.set()


def counting(handler: Any, counter: Counter) -> Any:
    def wrapped(request: wire.Request) -> Any:
        counter.add()
        return handler(request)

    return wrapped


# ---------------------------------------------------------------- results


def test_infer_returns_the_numpy_result_as_a_read_only_view(client: Client) -> None:
    given = inputs(1)
    out = client.infer("add", given)
    assert list(out) == ["y"]
    np.testing.assert_array_equal(out["y"], expected(given))
    assert not out["y"].flags.writeable


def test_infer_async_returns_a_future_with_timing(client: Client) -> None:
    given = inputs(2)
    future = client.infer_async("add", given)
    np.testing.assert_array_equal(future.result(10)["y"], expected(given))
    assert future.timing is not None
    assert (future.timing.broker_queue_us, future.timing.device_us) == (5.0, 11.0)
    assert future.timing.total_us > 0


def test_requests_carry_their_timeout_and_unique_ids(client: Client, broker: FakeBroker) -> None:
    for seed in range(3):
        client.infer("add", inputs(seed), timeout=2.5)
    ids = [r.request_id for r in broker.requests]
    assert len(set(ids)) == 3
    assert all(r.timeout_ms is not None and 0 < r.timeout_ms <= 2500 for r in broker.requests)


def test_many_threads_share_one_client(client: Client) -> None:
    failures: list[str] = []

    def caller(seed: int) -> None:
        for i in range(40):
            given = inputs(seed * 1000 + i)
            out = client.infer("add", given)
            if not np.array_equal(out["y"], expected(given)):
                failures.append(f"thread {seed} request {i}")

    threads = [threading.Thread(target=caller, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    assert client.stats.replies == 8 * 40


def test_requests_made_in_one_turn_leave_together_and_are_answered_one_by_one(
    client: Client, broker: FakeBroker
) -> None:
    gate = gated(broker)
    given = [inputs(100 + i) for i in range(10)]
    fanned_out: Future[list[InferFuture]] = Future()

    def fan_out(_first: Future[Any]) -> None:  # on the I/O thread: all in one turn
        fanned_out.set_result([client.infer_async("add", g) for g in given])

    first = client.infer_async("add", inputs(99))
    first.add_done_callback(fan_out)
    gate.set()
    for future, g in zip(fanned_out.result(10), given, strict=True):
        np.testing.assert_array_equal(future.result(10)["y"], expected(g))
    assert (broker.batches, client.stats.batched) == (1, 10)  # one REQUESTS of ten
    sent = [f.request_id for f in fanned_out.result()]
    assert [r.request_id for r in broker.requests[1:]] == sent  # in the order they were made


def test_a_batch_leaves_once_it_holds_batch_requests(broker: FakeBroker) -> None:
    gate = gated(broker)
    config = ClientConfig(batch_requests=8)
    with Client(broker.address, timeout=10, config=config) as client:
        given = [inputs(300 + i) for i in range(20)]
        fanned_out: Future[list[InferFuture]] = Future()
        first = client.infer_async("add", inputs(299))
        first.add_done_callback(
            lambda _f: fanned_out.set_result([client.infer_async("add", g) for g in given])
        )
        gate.set()
        for future, g in zip(fanned_out.result(10), given, strict=True):
            np.testing.assert_array_equal(future.result(10)["y"], expected(g))
        assert (broker.batches, client.stats.batched) == (3, 20)  # 8, 8, then 4 at the turn's end


def gated(broker: FakeBroker) -> threading.Event:
    """Hold the first reply until the event is set: its callback is attached by then."""
    gate = threading.Event()

    def handler(request: wire.Request) -> Any:
        gate.wait(10)
        return add_handler(request)

    broker.handler = handler
    return gate


def test_done_callbacks_can_chain_requests_on_the_io_thread(
    client: Client, broker: FakeBroker
) -> None:
    done: Future[list[bool]] = Future()
    checks: list[bool] = []
    threads: set[str] = set()
    gate = gated(broker)

    def next_request(n: int) -> None:
        given = inputs(n)
        future = client.infer_async("add", given)
        future.add_done_callback(lambda f: on_done(f, n, given))

    def on_done(future: Any, n: int, given: dict[str, np.ndarray[Any, Any]]) -> None:
        checks.append(bool(np.array_equal(future.result()["y"], expected(given))))
        threads.add(threading.current_thread().name)
        if n < 20:
            next_request(n + 1)
        else:
            done.set_result(checks)

    next_request(0)
    gate.set()
    assert done.result(10) == [True] * 21
    assert threads == {"ipuserve-client-io"}


def test_blocking_calls_from_a_callback_are_refused_instead_of_deadlocking(
    client: Client, broker: FakeBroker
) -> None:
    refused: Future[BaseException | None] = Future()
    gate = gated(broker)

    def on_done(_f: Any) -> None:
        try:
            client.infer("add", inputs())
        except errors.RuntimeUsageError as exc:
            refused.set_result(exc)
        else:
            refused.set_result(None)

    client.infer_async("add", inputs()).add_done_callback(on_done)
    gate.set()
    assert isinstance(refused.result(10), errors.RuntimeUsageError)


def test_models_lists_the_brokers_models(client: Client) -> None:
    [info] = client.models()
    assert info.spec == ADD
    assert [(w.worker_id, w.credit, w.in_flight) for w in info.workers] == [("w1", 8, 1)]


# ---------------------------------------------------------------- errors


ERROR_CLASSES = [
    errors.UnknownModelError,
    errors.InvalidInputError,
    errors.PayloadTooLargeError,
    errors.OverloadedError,
    errors.DeadlineExceeded,
    errors.WorkerFailedError,
    errors.InferenceError,
    errors.UnavailableError,
    errors.ProtocolError,
    errors.UnsupportedVersionError,
]


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.code)
def test_reported_errors_are_raised_as_their_class(
    broker: FakeBroker, cls: type[errors.IpuserveError]
) -> None:
    broker.handler = lambda r: wire.ErrorReply(r.request_id, cls.code, f"told {cls.__name__}")
    with (
        Client(broker.address, timeout=10, config=FAST) as client,
        pytest.raises(cls, match=f"told {cls.__name__}") as caught,
    ):
        client.infer("add", inputs())
    assert type(caught.value) is cls


def test_a_malformed_reply_fails_its_request_with_protocol_error(broker: FakeBroker) -> None:
    broker.handler = lambda r: [wire.envelope(wire.Command.REPLY, r.request_id), b"{oops"]
    with Client(broker.address, timeout=10, config=FAST) as client:
        with pytest.raises(errors.ProtocolError, match="JSON"):
            client.infer("add", inputs())
        assert client.stats.malformed == 1


def test_replies_batched_by_the_broker_answer_each_request(broker: FakeBroker) -> None:
    """REPLIES: results and errors for several requests in one message; a malformed one
    fails every request whose id it names."""
    parked: list[wire.Request] = []
    broker.handler = parked.append  # answered below, three at a time
    with Client(broker.address, timeout=10, config=FAST) as client:
        given = [inputs(200 + i) for i in range(4)]
        futures = [client.infer_async("add", g) for g in given]
        client.models()  # the broker holds all four once this is answered
        replies = []
        for request in parked[:2]:
            reply = add_handler(request)
            assert isinstance(reply, wire.Reply)
            replies.append(reply)
        failed = wire.Fail(parked[2].request_id, "OVERLOADED", "too busy")
        broker.send_raw(wire.Replies(tuple(replies), (failed,)).encode())
        for future, g in zip(futures[:2], given[:2], strict=True):
            np.testing.assert_array_equal(future.result(10)["y"], expected(g))
        with pytest.raises(errors.OverloadedError, match="too busy"):
            futures[2].result(10)
        row = [parked[3].request_id.hex(), 7, {}]  # names a spec the header does not list
        header = json.dumps({"specs": [], "replies": [row]}).encode()
        broken = [wire.envelope(wire.Command.REPLIES), header]
        broker.send_raw(broken)
        with pytest.raises(errors.ProtocolError, match="names spec 7"):
            futures[3].result(10)
        assert client.stats.malformed == 1


def test_a_reply_with_a_short_tensor_frame_fails_with_invalid_input(broker: FakeBroker) -> None:
    def short(r: wire.Request) -> list[wire.Frame]:
        frames = add_handler(r).encode()
        return [*frames[:-1], b"\0" * 4]

    broker.handler = short
    with (
        Client(broker.address, timeout=10, config=FAST) as client,
        pytest.raises(errors.InvalidInputError, match="needs 24 bytes"),
    ):
        client.infer("add", inputs())


def test_a_dtype_the_wire_cannot_carry_is_refused_locally(client: Client) -> None:
    with pytest.raises(errors.InvalidInputError, match="complex"):
        client.infer_async("add", {"a": np.zeros(2, np.complex64)})


@pytest.mark.parametrize(
    ("model", "names", "timeout", "error", "message"),
    [
        (b"add", ("a", "b"), 10, errors.InvalidInputError, "model name must be a string"),
        ("", ("a", "b"), 10, errors.InvalidInputError, "model name must have 1..256"),
        ("x" * 257, ("a", "b"), 10, errors.InvalidInputError, "got 257"),
        ("add", (b"a", "b"), 10, errors.InvalidInputError, "input name b'a': the name must be"),
        ("add", ("a", 7), 10, errors.InvalidInputError, "input name 7"),
        ("add", ("a", "b"), 0, errors.ConfigError, "seconds > 0"),
        ("add", ("a", "b"), -1, errors.ConfigError, "seconds > 0"),
        ("add", ("a", "b"), float("nan"), errors.ConfigError, "got nan"),
        ("add", ("a", "b"), float("inf"), errors.ConfigError, "None to wait for ever"),
        ("add", ("a", "b"), 1e9, errors.ConfigError, r"below 1e\+09"),
        ("add", ("a", "b"), "10", errors.ConfigError, "not a str"),
    ],
)
def test_bad_arguments_are_refused_at_the_call_and_the_client_goes_on(
    client: Client, model: Any, names: tuple[Any, Any], timeout: Any, error: type, message: str
) -> None:
    """Each of these once reached the I/O thread, which died on it: every later call
    then failed with 'the client is closed'."""
    given = dict(zip(names, inputs().values(), strict=True))
    with pytest.raises(error, match=message):
        client.infer_async(model, given, timeout=timeout)
    with pytest.raises(error, match=message):
        client.infer(model, given, timeout=timeout)
    good = inputs(1)
    np.testing.assert_array_equal(client.infer("add", good)["y"], expected(good))


def test_a_client_timeout_must_be_seconds_above_zero(broker: FakeBroker) -> None:
    for bad in (0, -5, float("nan"), True):
        with pytest.raises(errors.ConfigError, match="timeout must be seconds > 0"):
            Client(broker.address, timeout=bad)


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("recv_batch", 0),
        ("send_hwm", -1),
        ("batch_requests", 0),
        ("reconnect_max_s", -1.0),
        ("deadline_grace_s", -0.1),
        ("routing_id", b"x" * 256),
        ("routing_id", b"\x00zero"),
        ("routing_id", "text"),
    ],
)
def test_a_bad_client_config_is_a_config_error_naming_the_setting(
    setting: str, value: object
) -> None:
    """recv_batch 0 never read the socket (requests timed out "is the broker running?");
    the others were ZeroMQ's bare "Invalid argument" or a TypeError from Client()."""
    with pytest.raises(errors.ConfigError, match=f"ClientConfig.{setting} must be"):
        ClientConfig(**{setting: value})  # type: ignore[arg-type]


_FORKED_CHILD = """
import os, sys
from ipuserve.client import lifecycle
from ipuserve.client.client import Client
from ipuserve import errors
import numpy as np
client = Client("tcp://127.0.0.1:9", timeout=None)  # nobody there: stays pending
pending = client.infer_async("m", {"x": np.zeros((1, 2), np.float32)})
pid = os.fork()
if pid == 0:
    code = 0
    try:
        client.infer_async("m", {"x": np.zeros((1, 2), np.float32)})
        code = 2
    except errors.RuntimeUsageError as exc:
        code = 0 if "create a new Client here" in str(exc) else 3
    client.close()  # fails what the child inherited, at once
    if not isinstance(pending.exception(timeout=5), errors.ClosedError):
        code = 4
    os._exit(code)
_, status = os.waitpid(pid, 0)
client.close()
print("parent", pending.exception(timeout=5).__class__.__name__)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_a_client_inherited_through_fork_refuses_work_and_close_settles_it() -> None:
    """In a forked child a Client took requests that never left (no I/O thread there)
    and close() left its futures pending for ever."""
    done = subprocess.run(
        [sys.executable, "-c", _FORKED_CHILD], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "parent ClosedError"


def test_close_returns_though_a_done_callback_blocks_the_io_thread(
    broker: FakeBroker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A callback waiting (concurrent.futures.wait) for another request never returns:
    close() and the interpreter's exit, which closes every client, hung with it."""
    monkeypatch.setattr(lifecycle, "CLOSE_WAIT_S", 0.2)
    blocking, release = threading.Event(), threading.Event()

    def block(_future: Future[Any]) -> None:
        blocking.set()
        release.wait()

    client = Client(broker.address, timeout=10, config=FAST)
    try:
        client.infer_async("add", inputs()).add_done_callback(block)
        assert blocking.wait(10)
        stranded = client.infer_async("add", inputs())  # the I/O thread will not take it
        client.close()
        assert "did not stop within 0.2 s: a done-callback is blocking it" in caplog.text
        assert isinstance(stranded.exception(timeout=0), errors.ClosedError)
    finally:
        release.set()


def test_a_timeout_of_months_is_carried_without_overflowing_the_io_thread(
    client: Client, broker: FakeBroker
) -> None:
    """A deadline beyond poll()'s int milliseconds (~24.8 days) once killed the I/O thread."""
    for seed in range(3):
        given = inputs(seed)
        result = client.infer("add", given, timeout=86400 * 30)
        np.testing.assert_array_equal(result["y"], expected(given))
    assert broker.requests[0].timeout_ms == pytest.approx(86400 * 30 * 1e3)


def test_infer_async_copies_its_inputs_so_the_caller_may_reuse_them_at_once(
    client: Client, broker: FakeBroker
) -> None:
    gate = gated(broker)  # nothing is answered (or read from the frames) before the refill
    buffer = inputs(0)
    originals, futures = [], []
    for seed in range(8):
        fresh = inputs(seed)
        for name in buffer:
            buffer[name][...] = fresh[name]  # refill the same arrays, as a reading loop does
        originals.append(fresh)
        futures.append(client.infer_async("add", buffer))
    for name in buffer:
        buffer[name][...] = 1e6
    gate.set()
    for future, given in zip(futures, originals, strict=True):
        np.testing.assert_array_equal(future.result(10)["y"], expected(given))


def test_waiting_on_another_future_in_a_callback_is_refused_instead_of_deadlocking(
    client: Client, broker: FakeBroker
) -> None:
    gate = gated(broker)
    first = client.infer_async("add", inputs(0))
    refused: Future[BaseException | None] = Future()

    def on_done(_f: Any) -> None:
        later = client.infer_async("add", inputs(1))  # allowed: it only sends
        try:
            later.result(5)
        except errors.RuntimeUsageError as exc:
            refused.set_result(exc)
        else:
            refused.set_result(None)

    first.add_done_callback(on_done)
    gate.set()
    assert isinstance(refused.result(10), errors.RuntimeUsageError)
    assert "add_done_callback" in str(refused.result())


def test_no_reply_within_the_timeout_raises_deadline_exceeded(broker: FakeBroker) -> None:
    broker.handler = lambda r: None
    with Client(broker.address, timeout=10, config=FAST) as client:
        with pytest.raises(errors.DeadlineExceeded, match=r"no reply within 0\.2") as raised:
            client.infer("add", inputs(), timeout=0.2)
        assert isinstance(raised.value, TimeoutError)  # one except for both kinds of "too slow"
        assert client.stats.expired == 1
    assert broker.requests[0].timeout_ms is not None and broker.requests[0].timeout_ms <= 200


def test_requests_sent_one_at_a_time_leave_from_the_callers_thread(client: Client) -> None:
    given = inputs()
    for _ in range(50):
        np.testing.assert_array_equal(client.infer("add", given)["y"], expected(given))
    # each went from this thread unless the I/O thread was mid-turn (a PING, say)
    assert client.stats.sent == 50 and client.stats.direct > 0


def test_a_request_due_before_the_io_thread_looks_again_still_expires_on_time(
    broker: FakeBroker,
) -> None:
    """Idle, the I/O thread sleeps up to a PING interval (here 30 s): a caller sending
    a request due sooner must wake it, or the request expires only when the caller's
    own wait gives up (its message then names no request id)."""
    config = ClientConfig(ping_interval_s=30.0, liveness_s=60.0)
    with Client(broker.address, timeout=10, config=config) as client:
        given = inputs()
        np.testing.assert_array_equal(client.infer("add", given)["y"], expected(given))
        broker.handler = lambda r: None
        with pytest.raises(errors.DeadlineExceeded, match=r"within 0\.2 s \(request ") as raised:
            client.infer("add", given, timeout=0.2)
        assert client.stats.expired == 1, raised.value


def test_ctrl_c_in_the_middle_of_a_callers_send_leaves_no_message_cut_short(
    client: Client, broker: FakeBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the main thread a signal handler's KeyboardInterrupt can land between the
    frames of a message the caller sends itself: the frames already queued must not
    be glued to the next message (that one then went unanswered)."""
    send_frames = LinkSocket.send_frames

    def cut_short(self: LinkSocket, frames: list[wire.Frame]) -> bool:
        if len(frames) < 3 or threading.current_thread() is not threading.main_thread():
            return send_frames(self, frames)  # a PING, or the I/O thread sending
        monkeypatch.setattr(LinkSocket, "send_frames", send_frames)  # once
        for frame in frames[:-1]:
            self.sock.send(frame, zmq.SNDMORE)
        raise KeyboardInterrupt  # as if Ctrl-C came before the last frame

    client.models()  # connected: requests may leave from this thread
    monkeypatch.setattr(LinkSocket, "send_frames", cut_short)
    answered = 0
    while answered < 100:  # until one leaves from this thread, not the I/O thread's
        try:
            client.infer("add", inputs(1))
        except KeyboardInterrupt:
            break
        answered += 1
    else:
        pytest.fail("no request left from the caller's thread")
    given = inputs(2)
    np.testing.assert_array_equal(client.infer("add", given, timeout=10)["y"], expected(given))
    assert len(broker.requests) == answered + 1  # the cut one never parsed as a request


def test_a_cancelled_request_that_times_out_leaves_the_client_serving(
    broker: FakeBroker,
) -> None:
    """cancel() then the request's deadline: the I/O thread set an exception on the
    cancelled future, died of the InvalidStateError, and failed every other request
    of the client (and every later call said "closed")."""
    broker.handler = lambda r: None  # nobody answers
    with Client(broker.address, timeout=10, config=FAST) as client:
        cancelled = client.infer_async("add", inputs(), timeout=0.2)
        assert cancelled.cancel()
        with pytest.raises(errors.DeadlineExceeded):  # expires after the cancelled one
            client.infer("add", inputs(), timeout=0.2)
        broker.handler = add_handler
        given = inputs(3)
        np.testing.assert_array_equal(client.infer("add", given)["y"], expected(given))
        assert cancelled.cancelled()


def test_after_its_io_thread_failed_a_client_says_so_not_that_it_is_closed(
    broker: FakeBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(_self: object, _now_ns: int) -> None:
        raise RuntimeError("injected")

    broker.handler = lambda r: None
    with Client(broker.address, timeout=10, config=FAST) as client:
        pending = client.infer_async("add", inputs(), timeout=0.2)
        monkeypatch.setattr(Core, "_expire", fail)  # a bug in the loop, injected
        with pytest.raises(errors.UnavailableError, match="I/O thread failed"):
            pending.result(10)
        with pytest.raises(errors.UnavailableError, match=r"injected.*create a new Client"):
            client.infer_async("add", inputs())


def test_requests_that_find_the_send_queue_full_go_once_it_has_room(
    broker: FakeBroker,
) -> None:
    """A send that met the socket's high-water mark was dropped, to be re-sent after a
    silence that never came while the broker answered the rest: 251 of 400 futures
    never settled (a Client review, with send_hwm=4)."""
    config = ClientConfig(ping_interval_s=0.05, liveness_s=10.0, send_hwm=4)
    rng = np.random.default_rng(5)
    with Client(broker.address, timeout=30, config=config) as client:
        sent = [
            {name: rng.standard_normal((2, 10_240)).astype(np.float32) for name in "ab"}
            for _ in range(200)
        ]  # 80 KiB each: too big to batch, so each is its own message
        futures = [client.infer_async("add", given, copy=False) for given in sent]
        for future, given in zip(futures, sent, strict=True):
            np.testing.assert_array_equal(future.result(30)["y"], expected(given))


def test_an_io_thread_released_after_close_gave_up_sends_nothing_more(
    broker: FakeBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Released from the callback that blocked it past close(), the I/O thread finished
    its turn: it took the blocked time for the broker's silence and re-sent requests
    whose callers already had ClosedError."""
    monkeypatch.setattr(lifecycle, "CLOSE_WAIT_S", 0.2)
    gate = threading.Event()

    def second_only(request: wire.Request) -> wire.Message | None:
        if len(broker.requests) == 1:
            return None  # the first stays unanswered
        gate.wait(10)  # until its callback is in place
        return add_handler(request)

    broker.handler = second_only
    blocking, release = threading.Event(), threading.Event()
    client = Client(broker.address, timeout=10, config=FAST)  # liveness 0.3 s
    unanswered = client.infer_async("add", inputs())
    wait_until(lambda: len(broker.requests) == 1)
    answered = client.infer_async("add", inputs())
    answered.add_done_callback(lambda _f: (blocking.set(), release.wait()))
    gate.set()
    assert blocking.wait(10)
    client.close()  # gives up after 0.2 s; the silence is past the liveness window soon
    wait_until(lambda: time.monotonic() - only_link(client).liveness.last_heard > FAST.liveness_s)
    release.set()
    client._io.thread.join(10)
    assert not client._io.thread.is_alive()
    assert len(broker.requests) == 2  # no re-send of what close() already failed
    assert isinstance(unanswered.exception(timeout=0), errors.ClosedError)


# ---------------------------------------------------------------- liveness and shutdown


def test_requests_lost_in_a_broker_restart_are_resent_once_answered(
    broker: FakeBroker, make_client: MakeClient
) -> None:
    arrived = Counter(5)
    broker.handler = counting(lambda r: None, arrived)  # the old broker loses them
    with make_client(broker.address, timeout=20, config=FAST) as client:
        given = [inputs(i) for i in range(5)]
        futures = [client.infer_async("add", g) for g in given]
        assert arrived.reached.wait(10)
        first_ids = [r.request_id for r in broker.requests]
        broker.handler = add_handler
        broker.duplicate_replies = 2
        broker.restart()
        for future, g in zip(futures, given, strict=True):
            np.testing.assert_array_equal(future.result(10)["y"], expected(g))
        client.models()  # a round trip after every duplicate reply
        assert client.stats.epoch_changes == 1
        assert client.stats.dropped_replies >= 5
        resent = {r.request_id for r in broker.requests[5:]}
        assert set(first_ids) <= resent


def test_a_reconnection_re_sends_what_is_pending(
    broker: FakeBroker, make_client: MakeClient
) -> None:
    """A connection lost for less than a liveness window: no silence, no new epoch, so
    nothing was re-sent, and a request whose reply the broker could not deliver (or
    whose queue it dropped, the client gone) waited out its timeout."""
    arrived = Counter(1)
    broker.handler = counting(lambda r: None, arrived)  # held, never answered
    with make_client(broker.address, timeout=30, config=FAST) as client:
        given = inputs(3)
        future = client.infer_async("add", given)
        assert arrived.reached.wait(10)
        broker.handler = add_handler
        broker.blip()
        np.testing.assert_array_equal(future.result(10)["y"], expected(given))
        assert client.stats.reconnects == 1 and client.stats.epoch_changes == 0


def test_a_broker_back_after_an_outage_gets_each_pending_request_once(
    broker: FakeBroker, caplog: pytest.LogCaptureFixture
) -> None:
    """Re-sends made while the broker was away waited in the socket's pipe and all
    arrived when it was back, with the re-send its new epoch caused: a broker back
    after 20 s ran each request two to several times."""
    caplog.set_level(logging.WARNING, logger="ipuserve.client")
    arrived = Counter(1)
    broker.handler = counting(lambda r: None, arrived)  # the old broker never answers
    config = ClientConfig(ping_interval_s=0.05, liveness_s=0.2)
    with Client(broker.address, timeout=30, config=config) as client:
        given = inputs(3)
        future = client.infer_async("add", given)
        assert arrived.reached.wait(10)
        broker.stop()
        wait_until(lambda: "not connected" in caplog.text)  # a silence while away
        seen = len(broker.requests)
        broker.handler = add_handler
        broker.epoch = "back"
        broker.start()
        np.testing.assert_array_equal(future.result(10)["y"], expected(given))
        client.models()  # a round trip: anything else sent before it has arrived
    assert len(broker.requests) - seen == 1


def test_a_silent_broker_gets_the_pending_requests_again(broker: FakeBroker) -> None:
    seen: set[bytes] = set()

    def hung_until_resent(request: wire.Request) -> wire.Message | None:
        if request.request_id not in seen:  # swallowed, like every PING so far
            seen.add(request.request_id)
            return None
        broker.silent = False
        return add_handler(request)

    broker.handler = hung_until_resent
    broker.silent = True
    with Client(broker.address, timeout=20, config=FAST) as client:
        given = inputs(7)
        np.testing.assert_array_equal(client.infer("add", given)["y"], expected(given))
        assert client.stats.resent >= 1
        assert client.stats.epoch_changes == 0
        assert len({r.request_id for r in broker.requests}) == 1
        first, again = broker.requests[0].timeout_ms, broker.requests[-1].timeout_ms
        assert first == 20_000 and again is not None and again < first  # what is left of it


def test_answered_requests_do_not_stay_in_the_deadline_heap(broker: FakeBroker) -> None:
    """Each request's deadline entry stayed until its deadline: with a day's timeout a
    long-lived client grew by one entry per request (8 MiB for 60,000)."""
    with Client(broker.address, timeout=86_400, config=FAST) as client:
        given = inputs()
        for _ in range(3000):
            client.infer("add", given)
        assert len(client._io.core.table.deadlines) <= 1025  # compacted, not 3000


def test_a_reply_the_client_cannot_handle_fails_its_request_not_the_client(
    broker: FakeBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A REPLY whose tensors numpy could not view (shape [0, 2**64]) once killed the I/O
    thread: that request waited out its timeout, every later call raised ClosedError.
    The fault is injected once where the reply's arrays are made, on the I/O thread."""
    arrays = wire.Tensors.arrays
    faults = [ValueError("Maximum allowed dimension exceeded")]

    def faulty(self: wire.Tensors) -> Any:
        if faults and threading.current_thread().name == "ipuserve-client-io":
            raise faults.pop()
        return arrays(self)

    monkeypatch.setattr(wire.Tensors, "arrays", faulty)
    with Client(broker.address, timeout=None, config=FAST) as client:  # no timeout to end it
        future = client.infer_async("add", inputs())
        with pytest.raises(errors.ProtocolError, match="Maximum allowed dimension exceeded"):
            future.result(10)
        given = inputs(2)
        np.testing.assert_array_equal(client.infer("add", given)["y"], expected(given))


def test_a_long_silence_re_sends_pending_requests_once_not_every_liveness_window(
    broker: FakeBroker,
) -> None:
    """ZeroMQ queues what is sent while the broker is away and delivers it all when it
    is back: a re-send every liveness window made a broker back after 20 s run each
    request several times. Here the broker hears everything and answers nothing."""
    broker.silent = True
    config = ClientConfig(ping_interval_s=0.05, liveness_s=0.1)  # 10 windows in 1 s
    with Client(broker.address, config=config) as client:
        with pytest.raises(errors.DeadlineExceeded):
            client.infer("add", inputs(), timeout=1.0)
        assert client.stats.resent == 1
    assert len(broker.requests) == 2  # the request and its one re-send


def test_a_client_dropped_without_close_stops_its_thread(broker: FakeBroker) -> None:
    client = Client(broker.address, timeout=10, config=FAST)
    given = inputs()
    np.testing.assert_array_equal(client.infer("add", given)["y"], expected(given))
    thread = client._io.thread
    del client
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()


def test_a_future_keeps_its_unnamed_client_alive_until_answered(broker: FakeBroker) -> None:
    """``Client(addr).infer_async(...)``: the client is garbage at once, but the request
    it sent must still be answered (it closes itself only once collected)."""
    gate = gated(broker)
    given = inputs(3)
    future = Client(broker.address, timeout=10, config=FAST).infer_async("add", given)
    gc.collect()
    gate.set()
    np.testing.assert_array_equal(future.result(10)["y"], expected(given))


def test_clients_closed_on_their_own_io_thread_leave_no_descriptor_behind(
    broker: FakeBroker,
) -> None:
    """In ``Client(addr).infer_async(...).result()`` the client's last reference goes
    on its own I/O thread, whose close() once skipped the waker: an eventfd per client."""

    def descriptors() -> int:
        return len(os.listdir("/proc/self/fd"))

    with Client(broker.address, timeout=10, config=FAST) as warm:  # the context's own fds
        warm.infer("add", inputs())
    wait_until(lambda: not io_threads())
    before = descriptors()
    for rows in range(1, 21):
        given = inputs(rows)
        future = Client(broker.address, timeout=10, config=FAST).infer_async("add", given)
        np.testing.assert_array_equal(future.result(10)["y"], expected(given))
    del future
    gc.collect()
    wait_until(lambda: not io_threads())
    wait_until(lambda: descriptors() <= before)  # ZeroMQ's own thread closes TCP fds late


def io_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ipuserve-client-io"]


def test_close_fails_pending_requests_and_refuses_new_ones(broker: FakeBroker) -> None:
    arrived = Counter(3)
    broker.handler = counting(lambda r: None, arrived)
    client = Client(broker.address, timeout=None, config=FAST)
    futures = [client.infer_async("add", inputs(i)) for i in range(3)]
    assert arrived.reached.wait(10)
    client.close()
    for future in futures:
        with pytest.raises(errors.ClosedError):
            future.result(5)
    with pytest.raises(errors.ClosedError):
        client.infer_async("add", inputs())
    client.close()  # idempotent


def fan_out(client: Client, given: list[dict[str, np.ndarray]]) -> list[InferFuture]:
    """Send ``given`` from a done-callback, on the client's I/O thread: one turn of its
    loop, so they leave together (one REQUESTS message), as groups where they may."""
    fanned_out: Future[list[InferFuture]] = Future()
    first = client.infer_async("add", inputs(999))
    first.add_done_callback(
        lambda _f: fanned_out.set_result([client.infer_async("add", g) for g in given])
    )
    return [first, *fanned_out.result(10)]


@pytest.mark.parametrize(
    ("group_samples", "sizes"),
    [(None, [0] * 7), (0, [0] * 7), (4, [2, 2, 2, 0]), (64, [7])],
    ids=["not-listed", "takes-no-groups", "two-a-group", "all-in-one"],
)
def test_a_client_forms_only_the_groups_its_broker_listed(
    broker: FakeBroker, group_samples: int | None, sizes: list[int]
) -> None:
    """Before the broker lists the model (or when it lists no group size) requests
    leave one by one; then in groups of at most ``group_samples`` samples (2 a request
    here), which the broker carries as they are."""
    broker.group_samples = group_samples
    with Client(broker.address, timeout=10, config=FAST) as client:
        client.models()  # what the client groups by (its own ask may come later)
        given = [inputs(500 + i) for i in range(7)]
        futures = fan_out(client, given)
        for future, g in zip(futures[1:], given, strict=True):
            np.testing.assert_array_equal(future.result(10)["y"], expected(g))
        assert [len(r.group) for r in broker.rows] == sizes
        assert client.stats.groups == sum(1 for size in sizes if size)


def test_requests_of_one_layout_leave_as_groups_and_groups_are_answered(
    broker: FakeBroker,
) -> None:
    """A run of requests with one model and tensor specs is one group row, once the
    broker has listed the model as taking groups; a group REPLIES row answers each
    of its requests."""
    gate = threading.Event()
    parked: list[wire.Request] = []

    def handler(request: wire.Request) -> Any:  # answer the first (held), park the rest
        if broker.requests[0] is request:
            gate.wait(10)
            return add_handler(request)
        parked.append(request)
        return None

    broker.handler = handler
    with Client(broker.address, timeout=10, config=FAST) as client:
        client.models()  # what the client groups by (its own ask may come later)
        given = [inputs(400 + i) for i in range(3)]
        other = {"a": np.ones((5, 3), np.float32), "b": np.ones((5, 3), np.float32)}
        order = [given[0], given[1], other, given[2]]
        fanned_out: Future[list[InferFuture]] = Future()
        first = client.infer_async("add", inputs(399))
        first.add_done_callback(
            lambda _f: fanned_out.set_result([client.infer_async("add", g) for g in order])
        )
        gate.set()
        futures = fanned_out.result(10)
        client.models()  # the broker holds all of them once this is answered
        rows = broker.rows
        assert [len(r.group) for r in rows] == [2, 0, 0]  # the run of two, then the others
        assert rows[0].group == (futures[0].request_id, futures[1].request_id)
        grouped = [m for m in parked if m.request_id in rows[0].group]
        answer = wire.Tensors.group(
            [wire.Tensors.of({"y": expected(g)}) for g in (given[0], given[1])]
        )
        broker.send_raw(wire.Replies((wire.Reply(b"", answer, {}, rows[0].group),)).encode())
        for request in parked:
            if request not in grouped:
                broker.send_raw(add_handler(request).encode())
        for future, g in zip(futures, order, strict=True):
            np.testing.assert_array_equal(future.result(10)["y"], expected(g))
