"""The HTTP door's connection counting, without a network: which address a connection
counts against, and the caps in all and per address (the sockets-and-processes
versions are in test_connections.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from ipuserve.gateway.config import GatewayConfig
from ipuserve.gateway.grpc_server import server_options
from ipuserve.gateway.http_guard import ConnectionGuards, GuardedProtocol, peer_key


class _Transport(asyncio.Transport):
    """Just enough of a transport for the guard: a peer address, and what was done."""

    def __init__(self, host: str) -> None:
        super().__init__()
        self.host = host
        self.written = b""
        self.closed = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return (self.host, 40000) if name == "peername" else default

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += bytes(data)

    def write_eof(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


@pytest.mark.parametrize(
    ("host", "key"),
    [
        ("127.0.0.1", "127.0.0.1"),
        ("::ffff:10.0.0.7", "10.0.0.7"),  # IPv4 on an IPv6 socket: its IPv4 address
        ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),  # a host's /64
        ("2001:db8:1:2:bbbb::9", "2001:db8:1:2::/64"),
        ("fe80::1%eth0", "fe80::/64"),
    ],
)
def test_a_connection_counts_against_its_address_or_its_64(host: str, key: str) -> None:
    assert peer_key(_Transport(host)) == key


def _connect(guards: ConnectionGuards, host: str) -> tuple[GuardedProtocol, _Transport]:
    guard = guards.factory(asyncio.Protocol)()
    transport = _Transport(host)
    guard.connection_made(transport)
    return guard, transport


def test_one_address_is_capped_and_others_still_admitted() -> None:
    async def run() -> None:
        guards = ConnectionGuards(header_timeout_s=60, max_connections=4, max_per_peer=2)
        held = [_connect(guards, "10.0.0.2") for _ in range(2)]
        _, third = _connect(guards, "10.0.0.2")
        assert third.written.startswith(b"HTTP/1.1 429") and b"2 at most" in third.written
        _, honest = _connect(guards, "10.0.0.1")
        assert honest.written == b"" and guards.open == 3
        _, more = _connect(guards, "10.0.0.3")
        _, over = _connect(guards, "10.0.0.4")  # the total cap: 4
        assert more.written == b"" and over.written.startswith(b"HTTP/1.1 503")
        held[0][0].connection_lost(None)  # one of the address's goes: it may open one
        assert guards.from_peer("10.0.0.2") == 1
        guards.max_connections = 10
        _, again = _connect(guards, "10.0.0.2")
        assert again.written == b"" and guards.refused == 2
        guards.close_all()

    asyncio.run(run())


def test_the_grpc_door_gets_every_connection_limit() -> None:
    config = GatewayConfig(
        brokers=("tcp://127.0.0.1:5555",),
        header_timeout_s=2.5,
        grpc_idle_timeout_s=0,  # off: no such argument
        grpc_max_connection_age_s=10,
    )
    options = dict(server_options(config))
    assert options["grpc.server_handshake_timeout_ms"] == 2500
    assert options["grpc.max_allowed_incoming_connections"] == config.max_connections
    assert options["grpc.max_concurrent_streams"] == config.grpc_max_streams
    assert options["grpc.keepalive_timeout_ms"] == 30_000
    assert "grpc.max_connection_idle_ms" not in options
    assert options["grpc.max_connection_age_ms"] == 10_000
    assert options["grpc.max_connection_age_grace_ms"] == 30_000
