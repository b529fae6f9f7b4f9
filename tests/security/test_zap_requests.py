"""The ZAP handler spoken to directly over RFC 27, as libzmq does: a REQ socket on
``inproc://zeromq.zap.01`` of the handler's context. Covers what no well-behaved
libzmq sends and what takes many keys: malformed requests and a flood of keys."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import zmq
from zmq.utils import z85

from ipuserve.security import FRONTEND_DOMAIN, Role, ZapHandler, zap
from tests.security.conftest import WAIT_MS, Keys

Context = zmq.Context[zmq.Socket[bytes]]


@dataclass
class Asker:
    handler: ZapHandler
    sock: zmq.Socket[bytes]

    def __call__(self, frames: list[bytes]) -> list[bytes]:
        self.sock.send_multipart(frames)
        assert self.sock.poll(WAIT_MS)
        return self.sock.recv_multipart()


@pytest.fixture
def ask(context: Context, keys: Keys) -> Iterator[Asker]:
    handler = ZapHandler.from_dirs(
        context, client_keys=keys.dirs[Role.CLIENT], worker_keys=keys.dirs[Role.WORKER]
    )
    with handler, context.socket(zmq.REQ) as req:
        req.linger = 0
        req.connect(zap.ZAP_ENDPOINT)
        yield Asker(handler, req)


def curve_request(request_id: bytes, key: bytes) -> list[bytes]:
    return [b"1.0", request_id, FRONTEND_DOMAIN.encode(), b"10.0.0.1", b"", b"CURVE", key]


def test_a_malformed_request_is_refused_and_the_handler_lives_on(ask: Asker, keys: Keys) -> None:
    assert ask([b"1.0", b"7", b"frontend"])[:3] == [b"1.0", b"7", b"400"]
    assert ask([b"9.9", b"8", b"frontend", b"", b"", b"NULL"])[2] == b"400"
    client = keys.pairs["client"].public
    reply = ask(curve_request(b"9", z85.decode(client)))
    assert reply == [b"1.0", b"9", b"200", b"OK", client, b""]  # User-Id: the key


def test_a_flood_of_keys_is_counted_but_logged_only_up_to_a_bound(
    ask: Asker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(zap, "MAX_LOGGED_PEERS", 5)
    caplog.set_level(logging.WARNING, logger="ipuserve.security")
    for n in range(20):
        key = n.to_bytes(32, "big")
        for attempt in range(2):
            reply = ask(curve_request(b"%d-%d" % (n, attempt), key))
            assert reply[2:5] == [b"400", b"refused", b""]
    assert ask.handler.refused_by_domain[FRONTEND_DOMAIN] == 40
    named = [r for r in caplog.records if "refused a peer" in r.message]
    assert len(named) == 5
    assert [r for r in caplog.records if "only counted" in r.message] != []
    assert len(caplog.records) == 6
