"""One local process against the doors' connections: a thousand idle ones held and
re-opened from one address, clients that send and never read. Each case is watched
(:mod:`tests.gateway.abuse.watch`): the honest probe and infer client, from another
loopback address, keep being served, and the gateway's memory stays bounded."""

from __future__ import annotations

import socket
import threading

import pytest

from tests.gateway.abuse import payloads as p
from tests.gateway.abuse.watch import Watch
from tests.gateway.conftest import GatewayProc

pytestmark = pytest.mark.slow

ABUSER = "127.0.0.1"
IDLE = 1024
#: how much a never-reading client sends before it stops (or the gateway stops reading)
UNREAD_BYTES = 64 * p.MIB


def _address(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def _hold(address: tuple[str, int], count: int) -> list[socket.socket]:
    """``count`` connections from the abuser's address that say nothing."""
    held = []
    for _ in range(count):
        sock = socket.socket()
        sock.bind((ABUSER, 0))
        sock.settimeout(30)
        try:
            sock.connect(address)
        except OSError:
            sock.close()
            continue
        held.append(sock)
    return held


def _reopen_closed(held: list[socket.socket], address: tuple[str, int]) -> int:
    """Re-open every held connection the gateway has closed (a refusal, a deadline);
    how many it re-opened."""
    reopened = 0
    for i, sock in enumerate(held):
        sock.setblocking(False)
        try:
            closed = sock.recv(65536, socket.MSG_PEEK) == b""
        except BlockingIOError:
            closed = False
        except OSError:
            closed = True
        if closed or _answered(sock):
            sock.close()
            [held[i]] = _hold(address, 1) or [sock]
            reopened += 1
    return reopened


def _answered(sock: socket.socket) -> bool:
    try:
        return bool(sock.recv(65536, socket.MSG_PEEK))
    except (BlockingIOError, OSError):
        return False


@pytest.mark.parametrize("door", ["http", "grpc"])
def test_a_thousand_idle_connections_from_one_address(
    door: str, target: GatewayProc, watch: Watch
) -> None:
    assert target.grpc is not None
    address = _address(target.host_port if door == "http" else target.grpc)
    with watch.case(f"{IDLE}-idle-{door}-connections-one-address", 0) as case:
        held = _hold(address, IDLE)
        try:
            for _ in range(3):  # the abuser re-opens what the gateway closed
                _reopen_closed(held, address)
                case.honest_calls(20)  # served while the abuser holds its connections
        finally:
            for sock in held:
                sock.close()


def test_clients_that_never_read(target: GatewayProc, watch: Watch) -> None:
    """Four connections pipelining infer requests and reading nothing: the gateway
    stops reading them, or closes them, rather than queueing their answers."""
    address = _address(target.host_port)
    body = p.infer_json("[" + ",".join(["0"] * p.FEATURES) + "]", [1, p.FEATURES])
    request = p.post("/v2/models/mlp/infer") + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    burst = request * max(1, p.MIB // len(request))

    def flood() -> None:
        sock = socket.socket()
        sock.bind((ABUSER, 0))
        sock.settimeout(5)  # a send blocked this long: the gateway stopped reading
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        try:
            sock.connect(address)
            sent = 0
            while sent < UNREAD_BYTES:
                sock.sendall(burst)
                sent += len(burst)
        except OSError:
            pass  # blocked (timed out) or closed by the gateway: both are fine
        finally:
            sock.close()

    with watch.case("4-clients-never-reading", 0):
        floods = [threading.Thread(target=flood) for _ in range(4)]
        for thread in floods:
            thread.start()
        for thread in floods:
            thread.join(120)
