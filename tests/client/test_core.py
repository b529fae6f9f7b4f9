"""The client's core on its own: no socket, no thread, no event loop.

The core is sans-I/O by design (ipuserve.client.core): it is fed events and sends
through the port its driver gives each link. Here the ports are :class:`Port`, which
keeps what it was given (decoded, as a broker would read it) and can say its pipe is
full; the broker's answers are real encoded protocol messages. Every request's future
is a real ``concurrent.futures.Future`` settled through the core's ``due`` queue.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest
import zmq

from ipuserve import errors, transport
from ipuserve import protocol as wire
from ipuserve.client.config import ClientConfig
from ipuserve.client.core import Core
from ipuserve.client.link import Link
from ipuserve.client.pending import Pending, parse_reply
from ipuserve.client.reply_router import settle
from tests.client.fake_broker import add_handler, inputs

CONFIG = ClientConfig(ping_interval_s=0.5, liveness_s=2.0, deadline_grace_s=0.05)


class Port:
    """A link's port that keeps what it is given; ``full`` refuses it (the HWM)."""

    def __init__(self) -> None:
        self.messages: list[wire.Message] = []
        self.full = False

    def send_frames(self, frames: list[wire.Frame]) -> bool:
        if self.full:
            return False
        self.messages.append(wire.decode([zmq.Frame(bytes(memoryview(f))) for f in frames]))
        return True

    def requests(self) -> list[wire.Request]:
        """The requests received, a batch's and a group's one by one."""
        found: list[wire.Request] = []
        for message in self.messages:
            if isinstance(message, wire.Request):
                found.extend(message.members() if message.group else [message])
            elif isinstance(message, wire.Requests):
                for row in message.requests:
                    found.extend(row.members() if row.group else [row])
        return found

    def ids(self) -> list[bytes]:
        return [r.request_id for r in self.requests()]


def frames(message: Any) -> list[zmq.Frame]:
    """A message as the socket hands it over."""
    return [zmq.Frame(bytes(memoryview(f))) for f in message.encode()]


def connect(core: Core, link: Link, *, limit: int = 64 << 20) -> None:
    """The handshake, then the broker's PONG: the link is usable."""
    now = time.monotonic()
    core.on_connection_event(link, zmq.EVENT_HANDSHAKE_SUCCEEDED, 0, now)
    core.on_frames(link, frames(wire.Pong(b"", "epoch-" + link.endpoint, limit)), now)


def request(number: int, timeout_s: float | None = 10.0, **given: Any) -> Pending:
    arrays = given or inputs(number)
    message = wire.Request(number.to_bytes(8, "little"), "add", wire.Tensors.of(arrays), None)
    return Pending(message, Future(), timeout_s, parse_reply)


def answer(core: Core, link: Link, sent: wire.Request) -> None:
    core.on_frames(link, frames(add_handler(sent)), time.monotonic())


def two_links() -> tuple[Core, Link, Link, Port, Port]:
    core = Core(CONFIG)
    port_a, port_b = Port(), Port()
    a, b = core.add_link("tcp://a:1", port_a), core.add_link("tcp://b:1", port_b)
    connect(core, a)
    connect(core, b)
    return core, a, b, port_a, port_b


def tick(core: Core, now_ns: int | None = None) -> None:
    core.tick(time.monotonic(), time.perf_counter_ns() if now_ns is None else now_ns)
    core.flush()


def test_requests_spread_over_the_usable_links_and_settle_once_answered() -> None:
    core, a, b, port_a, port_b = two_links()
    pendings = [request(i) for i in range(4)]
    for pending in pendings:
        core.submit(pending, time.monotonic())
    core.flush()
    assert sorted(port_a.ids() + port_b.ids()) == sorted(p.request_id for p in pendings)
    assert port_a.ids() and port_b.ids()  # least loaded: both got some
    for link, port in ((a, port_a), (b, port_b)):
        for sent in port.requests():
            answer(core, link, sent)
    assert len(core.due) == 4
    settle(core.due)
    for number, pending in enumerate(pendings):
        given = inputs(number)
        np.testing.assert_array_equal(pending.future.result(0)["y"], given["a"] + given["b"])
    assert not core.table and core.stats.replies == 4


def test_failover_moves_a_lost_links_requests_with_the_same_ids() -> None:
    core, a, b, port_a, port_b = two_links()
    for i in range(6):
        core.submit(request(i), time.monotonic())
    core.flush()
    on_a = port_a.ids()
    assert on_a
    core.on_connection_event(a, zmq.EVENT_DISCONNECTED, 0, time.monotonic())
    assert core.lost  # the driver re-resolves the names
    tick(core)
    moved = port_b.ids()[-len(on_a) :]
    assert moved == on_a  # the same ids, in order
    assert core.stats.failovers == len(on_a)
    assert not a.ids and len(b.ids) == 6


def test_a_duplicate_reply_from_the_first_broker_settles_nothing_twice() -> None:
    core, a, b, port_a, port_b = two_links()
    pending = request(7)
    core.submit(pending, time.monotonic())
    core.flush()
    first, first_port = (a, port_a) if port_a.ids() else (b, port_b)
    second, second_port = (b, port_b) if first is a else (a, port_a)
    core.on_connection_event(first, zmq.EVENT_DISCONNECTED, 0, time.monotonic())
    tick(core)
    (moved,) = second_port.requests()
    answer(core, second, moved)
    answer(core, first, first_port.requests()[0])  # the first broker answers after all
    assert len(core.due) == 1
    settle(core.due)
    assert pending.future.done() and core.stats.dropped_replies == 1


def test_a_deadline_expires_after_the_grace_when_the_broker_answers() -> None:
    core = Core(CONFIG)
    link = core.add_link("tcp://a:1", Port())
    connect(core, link)
    pending = request(1, timeout_s=1.0)
    core.submit(pending, time.monotonic())
    core.flush()
    assert pending.deadline_ns is not None
    tick(core, pending.deadline_ns - 1)
    tick(core, pending.deadline_ns + 1)  # past it: the broker's own answer may come
    assert not core.due and pending.request_id in core.table
    tick(core, pending.deadline_ns + int(CONFIG.deadline_grace_s * 1e9) + 1)
    settle(core.due)
    with pytest.raises(errors.DeadlineExceeded, match=r"no reply within 1\.0 s"):
        pending.future.result(0)
    assert core.stats.expired == 1 and not core.table


def test_a_deadline_with_no_broker_heard_expires_without_grace() -> None:
    core = Core(CONFIG)
    core.add_link("tcp://a:1", Port())  # never connects
    pending = request(1, timeout_s=1.0)
    core.submit(pending, time.monotonic())
    assert pending.deadline_ns is not None
    tick(core, pending.deadline_ns + 1)
    settle(core.due)
    assert isinstance(pending.future.exception(0), errors.DeadlineExceeded)


def test_a_big_request_is_held_until_the_brokers_limit_is_known() -> None:
    core = Core(CONFIG)
    port = Port()
    link = core.add_link("tcp://a:1", port)
    big = request(1, x=np.zeros(transport.FRAME_SLACK_BYTES // 4 + 1, np.float32))
    core.submit(big, time.monotonic())
    core.flush()
    assert not port.ids() and big.request_id in link.held
    connect(core, link)  # the PONG says the limit: it leaves
    assert port.ids() == [big.request_id] and not link.held


def test_a_request_over_the_limit_fails_unsent() -> None:
    core = Core(CONFIG)
    port = Port()
    link = core.add_link("tcp://a:1", port)
    connect(core, link, limit=1000)
    pending = request(1, x=np.zeros(1000, np.float32))
    core.submit(pending, time.monotonic())
    core.flush()
    settle(core.due)
    with pytest.raises(errors.PayloadTooLargeError, match="1000"):
        pending.future.result(0)
    assert not port.ids()


def test_sends_that_find_the_pipe_full_go_in_order_once_it_has_room() -> None:
    core = Core(CONFIG)
    port = Port()
    link = core.add_link("tcp://a:1", port)
    connect(core, link)
    port.full = True
    pendings = [request(i, x=np.zeros(20_000, np.float32)) for i in range(3)]  # unbatched
    for pending in pendings:
        core.submit(pending, time.monotonic())
    core.flush()
    assert list(link.unsent) == [p.request_id for p in pendings]
    assert core.place_direct(request(9), time.monotonic()) is None  # nothing overtakes them
    port.full = False
    core.send_unsent()
    assert port.ids() == [p.request_id for p in pendings] and not link.unsent


def test_a_lone_link_takes_requests_before_it_connects() -> None:
    """One broker: there is nowhere else to go, so ZeroMQ keeps the request until the
    broker is there (with several links it would wait for a usable one)."""
    core = Core(CONFIG)
    port = Port()
    link = core.add_link("tcp://a:1", port)
    pending = request(1)
    assert core.place_direct(pending, time.monotonic()) is link
    link.send(pending)
    assert port.ids() == [pending.request_id] and core.stats.direct == 1


def test_with_several_links_none_usable_requests_wait_for_one() -> None:
    core = Core(CONFIG)
    port_a, port_b = Port(), Port()
    a = core.add_link("tcp://a:1", port_a)
    core.add_link("tcp://b:1", port_b)
    pending = request(1)
    core.submit(pending, time.monotonic())
    tick(core)
    assert not port_a.ids() and not port_b.ids()
    connect(core, a)
    tick(core)
    assert port_a.ids() == [pending.request_id]


def test_unknown_model_is_asked_of_the_other_broker_before_it_fails() -> None:
    core, a, b, port_a, _port_b = two_links()
    pending = request(1)
    core.submit(pending, time.monotonic())
    core.flush()
    first, second = (a, b) if port_a.ids() else (b, a)
    refusal = wire.ErrorReply(pending.request_id, "UNKNOWN_MODEL", "no worker serves add")
    core.on_frames(first, frames(refusal), time.monotonic())
    core.flush()
    assert not core.due and pending.request_id in second.ids
    core.on_frames(second, frames(refusal), time.monotonic())
    settle(core.due)
    assert isinstance(pending.future.exception(0), errors.UnknownModelError)
    assert core.stats.unknown_model_retries == 1


def test_broker_shutdown_holds_the_request_for_the_broker_back() -> None:
    core = Core(CONFIG)
    port = Port()
    link = core.add_link("tcp://a:1", port)
    connect(core, link)
    pending = request(1)
    core.submit(pending, time.monotonic())
    core.flush()
    shutdown = wire.ErrorReply(pending.request_id, "BROKER_SHUTDOWN", "stopping")
    core.on_frames(link, frames(shutdown), time.monotonic())
    assert not core.due and core.stats.held_over_shutdown == 1
    core.on_connection_event(link, zmq.EVENT_DISCONNECTED, 0, time.monotonic())
    core.on_connection_event(link, zmq.EVENT_HANDSHAKE_SUCCEEDED, 0, time.monotonic())
    assert port.ids().count(pending.request_id) == 2  # re-sent on the new connection
    answer(core, link, port.requests()[-1])
    settle(core.due)
    assert pending.future.result(0)["y"].shape == (2, 3)


def test_a_backend_port_fails_the_requests_at_once_when_no_other_broker_is_usable() -> None:
    core = Core(CONFIG)
    port = Port()
    link = core.add_link("tcp://a:1", port)
    pending = request(1)
    core.submit(pending, time.monotonic())
    core.flush()
    core.on_frames(link, frames(wire.Heartbeat()), time.monotonic())
    tick(core)
    settle(core.due)
    with pytest.raises(errors.UnavailableError, match="backend"):
        pending.future.result(0)


def test_a_dropped_endpoints_requests_move_to_the_others() -> None:
    core, a, b, port_a, port_b = two_links()
    for i in range(4):
        core.submit(request(i), time.monotonic())
    core.flush()
    on_a = port_a.ids()
    core.drop_link(a.endpoint)
    tick(core)
    assert port_b.ids()[-len(on_a) :] == on_a
    assert list(core.links) == [b.endpoint]
