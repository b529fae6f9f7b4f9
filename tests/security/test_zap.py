"""The ZAP handler with real CURVE sockets on loopback: who is served, who is refused,
what is counted and logged, and what a reload changes."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterator

import pytest
import zmq

from ipuserve.errors import ConfigError
from ipuserve.security import (
    BACKEND_DOMAIN,
    FRONTEND_DOMAIN,
    KeyPair,
    Mode,
    Role,
    ZapHandler,
    curve_client,
    curve_server,
    fingerprint,
    peer_user_id,
    reload_on_sighup,
)
from tests.security.conftest import Keys, handshake, receive, watch

Context = zmq.Context[zmq.Socket[bytes]]


@pytest.fixture
def handler(context: Context, keys: Keys) -> Iterator[ZapHandler]:
    zap = ZapHandler.from_dirs(
        context,
        client_keys=keys.dirs[Role.CLIENT],
        worker_keys=keys.dirs[Role.WORKER],
        admin_keys=keys.dirs[Role.ADMIN],
    )
    with zap:
        yield zap


class Broker:
    """A ROUTER per domain, as the broker's frontend and backend will be, echoing."""

    def __init__(self, context: Context, keys: Keys, handler: ZapHandler) -> None:
        self.context = context
        self.keys = keys
        self.handler = handler
        self.sockets: dict[str, zmq.Socket[bytes]] = {}
        self.endpoints: dict[str, str] = {}
        self.peers: list[Peer] = []
        #: the User-Id of each message echoed
        self.user_ids: list[str | None] = []
        for domain in (FRONTEND_DOMAIN, BACKEND_DOMAIN):
            sock = context.socket(zmq.ROUTER)
            curve_server(sock, keys.broker, domain)
            sock.bind("tcp://127.0.0.1:*")
            self.sockets[domain] = sock
            self.endpoints[domain] = sock.last_endpoint.decode()

    def connect(self, pair: KeyPair, domain: str = FRONTEND_DOMAIN) -> Peer:
        self.peers.append(Peer(self, pair, domain))
        return self.peers[-1]

    def close(self) -> None:
        """Close every socket here, not in the garbage collector (a ResourceWarning)."""
        for peer in self.peers:
            peer.monitor.close(linger=0)
            peer.sock.close(linger=0)
        for sock in self.sockets.values():
            sock.close(linger=0)

    def echo(self, domain: str = FRONTEND_DOMAIN) -> str | None:
        """Receive one message, send it back; its sender's role now (None: none)."""
        frames = receive(self.sockets[domain])
        self.sockets[domain].send_multipart(frames)
        self.user_ids.append(peer_user_id(frames[-1]))
        role = self.handler.role_of(frames[-1], domain)
        return role.value if role is not None else None

    def idle(self, domain: str = FRONTEND_DOMAIN) -> bool:
        return not self.sockets[domain].poll(0)


class Peer:
    """A DEALER with its own key; ``outcome`` is its first handshake's fate."""

    def __init__(self, broker: Broker, pair: KeyPair, domain: str) -> None:
        self.sock = broker.context.socket(zmq.DEALER)
        self.sock.linger = 0
        curve_client(self.sock, pair, broker.keys.broker.public)
        self.monitor = watch(self.sock)
        self.sock.connect(broker.endpoints[domain])
        self.outcome = handshake(self.monitor)

    @property
    def admitted(self) -> bool:
        return self.outcome[0] == zmq.EVENT_HANDSHAKE_SUCCEEDED

    def round_trip(
        self, broker: Broker, payload: bytes, domain: str = FRONTEND_DOMAIN
    ) -> str | None:
        """Send, have the broker echo, receive: the role the broker judged it to have."""
        self.sock.send(payload)
        role = broker.echo(domain)
        assert [f.bytes for f in receive(self.sock)] == [payload]
        return role


REFUSED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400)


@pytest.fixture
def broker(context: Context, keys: Keys, handler: ZapHandler) -> Iterator[Broker]:
    made = Broker(context, keys, handler)
    try:
        yield made
    finally:
        made.close()


def test_an_allowed_client_is_served_as_client(broker: Broker, keys: Keys) -> None:
    peer = broker.connect(keys.pairs["client"])
    assert peer.admitted
    assert peer.round_trip(broker, b"x") == "client"
    # every frame carries the sender's key, which the role is read from per message
    assert broker.user_ids == [keys.pairs["client"].public.decode()]


def test_an_admin_is_served_and_told_apart(broker: Broker, keys: Keys, handler: ZapHandler) -> None:
    peer = broker.connect(keys.pairs["admin"])
    assert peer.round_trip(broker, b"models?") == "admin"
    assert handler.admitted_by_role["admin"] == 1


def test_an_unknown_key_is_refused_counted_and_logged_once(
    broker: Broker, keys: Keys, handler: ZapHandler, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="ipuserve.security")
    strangers = [broker.connect(keys.pairs["stranger"]) for _ in range(3)]
    for stranger in strangers:
        stranger.sock.send(b"let me in")

    assert [s.outcome for s in strangers] == [REFUSED] * 3
    assert handler.refused_by_domain == {FRONTEND_DOMAIN: 3, BACKEND_DOMAIN: 0}
    named = [r for r in caplog.records if fingerprint(keys.pairs["stranger"].public) in r.message]
    assert len(named) == 1, [r.message for r in caplog.records]
    assert "admin or client allow-list" in named[0].message
    assert broker.idle(), "a refused peer's message got through"
    # the refusals cost the allowed nothing
    assert broker.connect(keys.pairs["client"]).round_trip(broker, b"still here") == "client"
    assert broker.idle()


def test_keys_are_admitted_by_role_not_just_by_being_known(
    broker: Broker, keys: Keys, handler: ZapHandler
) -> None:
    assert broker.connect(keys.pairs["worker"], FRONTEND_DOMAIN).outcome == REFUSED
    assert broker.connect(keys.pairs["client"], BACKEND_DOMAIN).outcome == REFUSED
    assert broker.connect(keys.pairs["admin"], BACKEND_DOMAIN).outcome == REFUSED
    worker = broker.connect(keys.pairs["worker"], BACKEND_DOMAIN)
    assert worker.round_trip(broker, b"HELLO", BACKEND_DOMAIN) == "worker"
    assert handler.refused_by_domain == {FRONTEND_DOMAIN: 1, BACKEND_DOMAIN: 2}
    assert broker.idle(FRONTEND_DOMAIN) and broker.idle(BACKEND_DOMAIN)


def test_a_key_in_two_lists_gets_the_higher_role(
    broker: Broker, keys: Keys, handler: ZapHandler
) -> None:
    both = keys.make("both", into=Role.CLIENT)
    (keys.dirs[Role.ADMIN] / "both.key").write_bytes((keys.root / "keys/both.key").read_bytes())
    assert broker.connect(both).outcome == REFUSED  # not reloaded yet: unknown
    handler.reload()
    assert broker.connect(both).round_trip(broker, b"x") == "admin"


def test_reload_admits_an_added_key_and_revokes_a_removed_one_on_open_connections(
    broker: Broker, keys: Keys, handler: ZapHandler
) -> None:
    existing = broker.connect(keys.pairs["client"])
    late = keys.make("late")
    assert broker.connect(late).outcome == REFUSED

    (keys.dirs[Role.CLIENT] / "late.key").write_bytes((keys.root / "keys/late.key").read_bytes())
    assert handler.reload()["client"] == 2
    admitted = broker.connect(late)
    assert admitted.round_trip(broker, b"new") == "client"
    assert existing.round_trip(broker, b"old") == "client"

    (keys.dirs[Role.CLIENT] / "late.key").unlink()
    assert handler.reload()["client"] == 1
    assert broker.connect(late).outcome == REFUSED
    # the connection made before the removal stays up, but its messages have no role
    # now (the broker refuses them); another client's open connection is untouched
    assert admitted.round_trip(broker, b"open") is None
    assert existing.round_trip(broker, b"old") == "client"


def test_a_demoted_admin_is_a_client_from_its_next_message(
    broker: Broker, keys: Keys, handler: ZapHandler
) -> None:
    admin = broker.connect(keys.pairs["admin"])
    assert admin.round_trip(broker, b"load") == "admin"
    (keys.dirs[Role.CLIENT] / "admin.key").write_bytes(
        (keys.dirs[Role.ADMIN] / "admin.key").read_bytes()
    )
    (keys.dirs[Role.ADMIN] / "admin.key").unlink()
    handler.reload()
    assert admin.round_trip(broker, b"load") == "client"  # the same connection
    (keys.dirs[Role.CLIENT] / "admin.key").unlink()
    handler.reload()
    assert admin.round_trip(broker, b"infer") is None


def test_a_revoked_worker_has_no_role_and_its_refusals_are_counted_and_logged_once(
    broker: Broker, keys: Keys, handler: ZapHandler, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="ipuserve.security")
    worker = broker.connect(keys.pairs["worker"], BACKEND_DOMAIN)
    assert worker.round_trip(broker, b"HELLO", BACKEND_DOMAIN) == "worker"
    (keys.dirs[Role.WORKER] / "worker.key").unlink()
    handler.reload()
    for _ in range(3):
        worker.sock.send(b"RESULTS")
        frames = receive(broker.sockets[BACKEND_DOMAIN])
        assert handler.role_of(frames[-1], BACKEND_DOMAIN) is None
        reason = handler.refuse_message(frames[-1], BACKEND_DOMAIN)
    fingerprint_ = fingerprint(keys.pairs["worker"].public)
    assert f"key {fingerprint_} is no longer in the worker allow-list" in reason
    assert handler.refused_messages_by_domain == {FRONTEND_DOMAIN: 0, BACKEND_DOMAIN: 3}
    assert handler.refused_by_domain == {FRONTEND_DOMAIN: 0, BACKEND_DOMAIN: 0}  # handshakes
    named = [r for r in caplog.records if fingerprint_ in r.message]
    assert len(named) == 1, [r.message for r in caplog.records]


def test_without_keys_a_peer_has_the_role_its_socket_grants(context: Context) -> None:
    with ZapHandler(context) as zap, context.socket(zmq.ROUTER) as router:
        router.zap_domain = BACKEND_DOMAIN.encode()
        router.bind("tcp://127.0.0.1:*")
        with context.socket(zmq.DEALER) as dealer:
            dealer.linger = 0
            dealer.connect(router.last_endpoint.decode())
            dealer.send(b"HELLO")
            frames = receive(router)
        assert zap.role_of(frames[-1], BACKEND_DOMAIN) is Role.WORKER
        assert zap.role_of(frames[-1], FRONTEND_DOMAIN) is Role.ADMIN


def test_a_reload_that_reads_a_bad_file_keeps_the_lists_in_force(
    broker: Broker, keys: Keys, handler: ZapHandler
) -> None:
    (keys.dirs[Role.CLIENT] / "broken.key").write_text("curve\n    nothing here\n")
    with pytest.raises(ConfigError, match=r"broken\.key"):
        handler.reload()
    assert handler.key_counts["client"] == 1
    assert broker.connect(keys.pairs["client"]).admitted


def test_sighup_reloads(
    broker: Broker, keys: Keys, handler: ZapHandler, caplog: pytest.LogCaptureFixture
) -> None:
    late = keys.make("late", into=Role.CLIENT)
    previous = signal.getsignal(signal.SIGHUP)
    try:
        reload_on_sighup(handler)
        os.kill(os.getpid(), signal.SIGHUP)
        assert handler.key_counts["client"] == 2
        (keys.dirs[Role.CLIENT] / "broken.key").write_text("not a key")
        os.kill(os.getpid(), signal.SIGHUP)  # logged, not raised
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert "not reloaded" in caplog.text
    assert broker.connect(late).admitted


@pytest.mark.parametrize("broker_key", ["none", "wrong"])
def test_a_peer_without_curve_or_with_a_wrong_broker_key_is_refused_and_counted(
    context: Context,
    keys: Keys,
    handler: ZapHandler,
    broker_key: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with context.socket(zmq.ROUTER) as router:
        curve_server(router, keys.broker, FRONTEND_DOMAIN)
        handler.watch(router, FRONTEND_DOMAIN)
        router.bind("tcp://127.0.0.1:*")
        with context.socket(zmq.DEALER) as dealer, watch(dealer) as monitor:
            dealer.linger = 0
            if broker_key == "wrong":
                curve_client(dealer, keys.pairs["client"], keys.pairs["admin"].public)
            dealer.connect(router.last_endpoint.decode())
            dealer.send(b"let me in")
            assert handshake(monitor)[0] != zmq.EVENT_HANDSHAKE_SUCCEEDED
            assert handler.wait_refused(FRONTEND_DOMAIN, 1, timeout=10)
            assert not router.poll(0)
    assert handler.refused_by_domain == {FRONTEND_DOMAIN: 1, BACKEND_DOMAIN: 0}
    expected = "another security mechanism" if broker_key == "none" else "CURVE"
    assert expected in caplog.text


def test_a_watched_socket_counts_a_zap_refusal_once(
    context: Context, keys: Keys, handler: ZapHandler
) -> None:
    broker = Broker(context, keys, handler)
    try:
        handler.watch(broker.sockets[FRONTEND_DOMAIN], FRONTEND_DOMAIN)
        assert broker.connect(keys.pairs["stranger"]).outcome == REFUSED
        with context.socket(zmq.DEALER) as plain:  # a failure the monitor reports
            plain.linger = 0
            plain.connect(broker.endpoints[FRONTEND_DOMAIN])
            # the monitor reports in order: any event of the ZAP refusal came first
            assert handler.wait_refused(FRONTEND_DOMAIN, 2, timeout=10)
        assert handler.refused_by_domain[FRONTEND_DOMAIN] == 2
    finally:
        broker.close()


def test_a_handler_with_keys_needs_client_and_worker_dirs(context: Context, keys: Keys) -> None:
    with pytest.raises(ConfigError, match="worker"):
        ZapHandler.from_dirs(context, client_keys=keys.dirs[Role.CLIENT])
    with pytest.raises(ConfigError, match="insecure"):
        ZapHandler.from_dirs(
            context,
            client_keys=keys.dirs[Role.CLIENT],
            worker_keys=keys.dirs[Role.WORKER],
            insecure=True,
        )
    zap = ZapHandler.from_dirs(
        context, client_keys=keys.dirs[Role.CLIENT], worker_keys=keys.dirs[Role.WORKER]
    )
    assert zap.mode is Mode.CURVE
    assert "CURVE" in zap.startup_line() and "1 client key" in zap.startup_line()


def test_one_zap_handler_per_context(context: Context, handler: ZapHandler) -> None:
    with pytest.raises(ConfigError, match="already has a ZAP handler"):
        ZapHandler(context).start()
