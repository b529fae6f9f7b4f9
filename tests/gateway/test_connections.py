"""Connections are bounded per client on both doors (issue 28, item 2): a deadline until a
connection is useful (the TLS handshake, gRPC's HTTP/2 handshake), an idle limit after,
caps in all and per address, a write timeout, and a door that rides out descriptor
exhaustion. Real gateways on loopback, raw sockets, so nothing between the test and the
gateway fixes the bytes; every wait is on a condition, with a deadline."""

from __future__ import annotations

import http.client
import socket
import ssl
import struct
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.gateway.conftest import (
    Fabric,
    GatewayProc,
    gateway_argv,
    self_signed,
    start_gateway,
    started_gateway,
)
from tests.helpers import wait_until

pytestmark = pytest.mark.slow

#: how long a test waits for the gateway to act on a limit of a few seconds
PATIENCE_S = 60.0
#: the client preface of HTTP/2 and an empty SETTINGS frame: a connection that then
#: says nothing more, as an idle gRPC channel does
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
GOAWAY = 0x7
PROBE = b"GET /v2/health/live HTTP/1.1\r\nHost: gateway\r\nConnection: close\r\n\r\n"


def _host_port(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


@contextmanager
def _connection(address: str, source: str | None = None) -> Iterator[socket.socket]:
    source_address = None if source is None else (source, 0)
    sock = socket.create_connection(
        _host_port(address), timeout=PATIENCE_S, source_address=source_address
    )
    try:
        yield sock
    finally:
        sock.close()


def _read_all(sock: socket.socket) -> bytes:
    """Everything the gateway sends until it closes the connection (a reset ends it too)."""
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def _frame_types(data: bytes) -> list[int]:
    """The types of the HTTP/2 frames in ``data`` (9-byte headers, 24-bit lengths)."""
    types, at = [], 0
    while at + 9 <= len(data):
        length = struct.unpack(">I", b"\x00" + data[at : at + 3])[0]
        types.append(data[at + 3])
        at += 9 + length
    return types


def _live(gateway: GatewayProc, source: str | None = None) -> int:
    """An honest probe's status (0: the connection failed)."""
    try:
        with _connection(gateway.host_port, source) as sock:
            sock.sendall(PROBE)
            answer = _read_all(sock)
    except OSError:
        return 0
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0


# -- gRPC ---------------------------------------------------------------------------


def test_grpc_connections_get_a_handshake_deadline_and_an_idle_limit(fabric: Fabric) -> None:
    gateway = start_gateway(
        fabric.procs, fabric.broker, "--header-timeout-s", "1", "--grpc-idle-timeout-s", "1"
    )
    assert gateway.grpc is not None
    with _connection(gateway.grpc) as silent:  # TCP, and not a byte of HTTP/2
        _read_all(silent)  # returns: the gateway closed it
    with _connection(gateway.grpc) as idle:  # an HTTP/2 connection with no call
        idle.sendall(H2_PREFACE)
        assert GOAWAY in _frame_types(_read_all(idle))  # told to go, then closed
    with grpcclient.InferenceServerClient(gateway.grpc) as triton:  # a caller is served
        assert triton.is_server_live()


def test_grpc_connections_over_the_cap_are_closed_and_the_rest_served(fabric: Fabric) -> None:
    gateway = start_gateway(fabric.procs, fabric.broker, "--max-connections", "2")
    assert gateway.grpc is not None
    with ExitStack() as held:
        for _ in range(2):  # two HTTP/2 connections, admitted: the server's SETTINGS came
            sock = held.enter_context(_connection(gateway.grpc))
            sock.sendall(H2_PREFACE)
            assert sock.recv(9)
        with _connection(gateway.grpc) as third:
            third.sendall(H2_PREFACE)
            assert _read_all(third) == b""  # closed unanswered
    with grpcclient.InferenceServerClient(gateway.grpc) as triton:  # the two let go

        def live() -> bool:
            """Served, once the gateway has seen the two close (until then a new
            connection is over the cap and closed: UNAVAILABLE, a retry)."""
            try:
                return bool(triton.is_server_live())
            except InferenceServerException:
                return False

        wait_until(live, timeout=PATIENCE_S)


# -- HTTP ---------------------------------------------------------------------------


def test_a_tls_handshake_never_started_counts_and_is_cut_at_the_deadline(
    fabric: Fabric, tmp_path: Path
) -> None:
    cert, key = self_signed(tmp_path)
    gateway = start_gateway(
        fabric.procs,
        fabric.broker,
        *("--tls-cert", str(cert), "--tls-key", str(key)),
        *("--header-timeout-s", "5", "--max-connections", "2"),
        name="tls",
    )
    trusting = ssl.create_default_context(cafile=str(cert))

    def handshake_refused() -> bool:
        """With two TCP connections that never start TLS holding the cap, a third
        client's handshake is refused (if they ran out first, try again)."""
        with (
            _connection(gateway.host_port),
            _connection(gateway.host_port),
            _connection(gateway.host_port) as third,
        ):
            try:
                with trusting.wrap_socket(third, server_hostname="127.0.0.1") as tls:
                    tls.sendall(PROBE)
                    return tls.recv(1) == b""
            except OSError:  # ssl.SSLError included
                return True

    wait_until(handshake_refused, timeout=PATIENCE_S)
    with _connection(gateway.host_port) as silent:  # no ClientHello: cut at 5 s, not 60
        assert _read_all(silent) == b""
    with (
        _connection(gateway.host_port) as raw,  # TLS, then no request: the same clock
        trusting.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        assert tls.recv(1) == b""

    def served() -> bool:
        connection = http.client.HTTPSConnection(
            "127.0.0.1", _host_port(gateway.host_port)[1], timeout=PATIENCE_S, context=trusting
        )
        try:
            connection.request("GET", "/v2/health/live")
            return connection.getresponse().status == 200
        except OSError:
            return False
        finally:
            connection.close()

    wait_until(served, timeout=PATIENCE_S)


def test_one_address_at_its_cap_does_not_take_the_others_slots(fabric: Fabric) -> None:
    """127.0.0.2 is loopback too (Linux routes 127/8 to lo): the abuser's address."""
    gateway = start_gateway(
        fabric.procs,
        fabric.broker,
        *("--max-connections", "4", "--max-connections-per-peer", "3"),
        *("--header-timeout-s", "30"),  # the abuser's idle connections outlive the test
    )
    with ExitStack() as held:
        for _ in range(3):
            held.enter_context(_connection(gateway.host_port, source="127.0.0.2"))

        def fourth_refused() -> bool:
            return _live(gateway, source="127.0.0.2") == 429

        wait_until(fourth_refused, timeout=PATIENCE_S)
        assert _live(gateway, source="127.0.0.1") == 200  # the honest one has its slot
    wait_until(lambda: _live(gateway, source="127.0.0.2") == 200, timeout=PATIENCE_S)


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _deaf(gateway: GatewayProc, requests: int) -> socket.socket:
    """A client that asks for ``requests`` answers in one go and reads none of them,
    with a small receive buffer so the gateway's write buffer fills soon."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(_host_port(gateway.host_port))
    sock.settimeout(5.0)
    pipeline = b"GET /v2/health/live HTTP/1.1\r\nHost: gateway\r\n\r\n" * requests
    try:
        sock.sendall(pipeline)
    except TimeoutError:  # the gateway stopped reading: it has plenty
        pass
    return sock


def test_a_client_that_never_reads_its_answers_is_cut_off(fabric: Fabric) -> None:
    gateway = start_gateway(
        fabric.procs, fabric.broker, "--write-timeout-s", "1", "--header-timeout-s", "30"
    )
    pid = gateway.proc.pid
    before = _rss_bytes(pid)
    deaf = [_deaf(gateway, 20_000) for _ in range(4)]
    try:
        gateway.proc.wait_for_count(r"aborting a connection that read none", 4, PATIENCE_S)
        grown = _rss_bytes(pid) - before
        print(f"gateway RSS {before / 2**20:.0f} MiB, +{grown / 2**20:.1f} MiB after 4 deaf")
        assert grown < 64 * 2**20
        assert _live(gateway) == 200
    finally:
        for sock in deaf:
            sock.close()


def test_descriptor_exhaustion_is_ridden_out_with_one_line_per_interval(fabric: Fabric) -> None:
    """The gateway under a limit of 128 descriptors, 300 connections at it: it logs the
    exhaustion, not a traceback per accept, and serves again once they close."""
    limit = 128
    set_limit = (
        "import os, resource, sys; "
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit})); "
        "os.execv(sys.argv[1], sys.argv[1:])"
    )
    argv = [
        sys.executable,
        "-c",
        set_limit,
        *gateway_argv(fabric.broker, "--grpc", "off", "--header-timeout-s", "30"),
    ]
    gateway = started_gateway(fabric.procs.start("emfile", argv), argv)
    assert _live(gateway) == 200
    with ExitStack() as held:
        for _ in range(300):  # the kernel's backlog takes those the gateway cannot
            held.enter_context(_connection(gateway.host_port))
        gateway.proc.wait_for(r"accepting connections is out of descriptors", PATIENCE_S)
    wait_until(lambda: _live(gateway) == 200, timeout=PATIENCE_S)
    output = gateway.proc.output()
    assert "Traceback" not in output, output
    assert output.count("accepting connections is") <= 3, output
