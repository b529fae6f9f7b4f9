"""Protected mode with real sockets: a broker without keys admits peers on this host
only, and every address with ``insecure``; the last test runs it end to end with a
real ``ipuserve broker`` process and a real client in the namespace.

The non-loopback peer runs in a network namespace this test creates for itself,
joined to this host by a veth pair with addresses in 10.200.N.0/30 (a prefix no
other interface here has): the traffic goes only to that namespace. It needs root
and ``ip netns``; elsewhere those tests are skipped, saying why, and the address
check itself is covered by test_policy.py.
"""

from __future__ import annotations

import ipaddress
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import zmq

from ipuserve.security import (
    BACKEND_DOMAIN,
    FRONTEND_DOMAIN,
    Mode,
    ZapHandler,
    keyless_server,
    peer_user_id,
)
from tests.helpers import Processes, scrape, start_broker
from tests.security.conftest import handshake, receive, watch

#: the broker's metric family of refused handshakes (by socket)
REFUSED = "ipuserve_broker_refused_handshakes_total"

Context = zmq.Context[zmq.Socket[bytes]]
_names = itertools.count()

#: run inside the namespace: connect, report the handshake, echo once if admitted
PEER_SCRIPT = """
import sys, zmq
from zmq.utils.monitor import recv_monitor_message
ctx = zmq.Context()
sock = ctx.socket(zmq.DEALER)
sock.linger = 0
monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
sock.connect(sys.argv[1])
sock.send(b"from the namespace")
if not monitor.poll(10_000):
    sys.exit("no handshake outcome")
event = recv_monitor_message(monitor)
print(event["event"], event["value"], flush=True)
if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
    if not sock.poll(10_000):
        sys.exit("no echo")
    print(sock.recv().decode(), flush=True)
monitor.close(); sock.close(); ctx.term()
"""


@dataclass
class Namespace:
    name: str
    host_address: str  # this side of the veth pair: where the broker binds
    peer_address: str  # the namespace's side

    def run_peer(self, endpoint: str) -> list[str]:
        """The peer script's lines, run in the namespace with this interpreter."""
        done = subprocess.run(
            ["ip", "netns", "exec", self.name, sys.executable, "-c", PEER_SCRIPT, endpoint],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.split("\n")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _free_subnet() -> ipaddress.IPv4Network:
    """A 10.200.N.0/30 that no interface of this host has an address in."""
    shown = subprocess.run(
        ["ip", "-o", "-4", "addr", "show"], check=True, capture_output=True, text=True
    ).stdout
    for third in range(256):
        net = ipaddress.ip_network(f"10.200.{third}.0/30")
        if f" 10.200.{third}." not in shown:
            return net
    pytest.skip("no free 10.200.N.0/30 on this host")


@pytest.fixture
def namespace() -> Iterator[Namespace]:
    if os.geteuid() != 0:
        pytest.skip("creating a network namespace needs root")
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2) to create a network namespace")
    tag = f"{os.getpid() % 100_000}{next(_names)}"
    name, host_if, peer_if = f"ipusec{tag}", f"ivh{tag}", f"ivp{tag}"
    try:
        _ip("netns", "add", name)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot create a network namespace here: {exc.stderr.strip()}")
    try:
        net = _free_subnet()
        host, peer = (str(a) for a in list(net.hosts())[:2])
        _ip("link", "add", host_if, "type", "veth", "peer", "name", peer_if)
        _ip("link", "set", peer_if, "netns", name)
        _ip("addr", "add", f"{host}/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("-n", name, "addr", "add", f"{peer}/30", "dev", peer_if)
        _ip("-n", name, "link", "set", peer_if, "up")
        _ip("-n", name, "link", "set", "lo", "up")
        yield Namespace(name, host, peer)
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


@pytest.fixture
def protected(context: Context) -> Iterator[ZapHandler]:
    with ZapHandler(context) as zap:
        yield zap


@pytest.fixture
def insecure(context: Context) -> Iterator[ZapHandler]:
    with ZapHandler(context, insecure=True) as zap:
        yield zap


def keyless_router(context: Context, bind: str, domain: str = FRONTEND_DOMAIN) -> zmq.Socket[bytes]:
    sock = context.socket(zmq.ROUTER)
    sock.linger = 0
    sock.ipv6 = "[" in bind
    keyless_server(sock, domain)
    sock.bind(bind)
    return sock


@pytest.mark.parametrize("host", ["127.0.0.1", "[::1]"])
def test_protected_mode_serves_a_loopback_peer(
    context: Context, protected: ZapHandler, host: str
) -> None:
    assert protected.mode is Mode.PROTECTED
    with (
        keyless_router(context, f"tcp://{host}:*", BACKEND_DOMAIN) as router,
        context.socket(zmq.DEALER) as dealer,
        watch(dealer) as monitor,
    ):
        dealer.linger = 0
        dealer.ipv6 = True
        dealer.connect(router.last_endpoint.decode())
        dealer.send(b"HELLO")
        assert handshake(monitor)[0] == zmq.EVENT_HANDSHAKE_SUCCEEDED
        frames = receive(router)
        assert peer_user_id(frames[-1]) == "worker"
    assert protected.admitted_by_role["worker"] == 1


def test_protected_mode_refuses_a_peer_from_another_address(
    context: Context, protected: ZapHandler, namespace: Namespace, caplog: pytest.LogCaptureFixture
) -> None:
    with keyless_router(context, f"tcp://{namespace.host_address}:*") as router:
        lines = namespace.run_peer(router.last_endpoint.decode())
        assert lines[0] == f"{zmq.EVENT_HANDSHAKE_FAILED_AUTH} 400"
        assert protected.refused_by_domain[FRONTEND_DOMAIN] == 1
        assert not router.poll(0), "a refused peer's message got through"
    assert f"address {namespace.peer_address} not a loopback address" in caplog.text


def test_insecure_mode_serves_a_peer_from_another_address(
    context: Context, insecure: ZapHandler, namespace: Namespace
) -> None:
    with keyless_router(context, f"tcp://{namespace.host_address}:*") as router:
        endpoint = router.last_endpoint.decode()
        with subprocess.Popen(
            ["ip", "netns", "exec", namespace.name, sys.executable, "-c", PEER_SCRIPT, endpoint],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ) as peer:
            frames = receive(router)
            assert frames[-1].get("Peer-Address") == namespace.peer_address
            assert peer_user_id(frames[-1]) == "admin"
            router.send_multipart(frames)
            out, err = peer.communicate(timeout=60)
        assert peer.returncode == 0, err
        assert out.split("\n")[:2] == [f"{zmq.EVENT_HANDSHAKE_SUCCEEDED} 0", "from the namespace"]
    assert insecure.refused_by_domain == {FRONTEND_DOMAIN: 0, BACKEND_DOMAIN: 0}


def test_insecure_mode_warns_once_at_start(
    context: Context, caplog: pytest.LogCaptureFixture
) -> None:
    with ZapHandler(context, insecure=True):
        pass
    warnings = [r for r in caplog.records if "INSECURE" in r.message]
    assert len(warnings) == 1 and warnings[0].levelname == "WARNING"


def models_from(namespace: Namespace, frontend: str) -> subprocess.CompletedProcess[str]:
    """``ipuserve models --json`` run in the namespace (a real client, keyless)."""
    argv = [sys.executable, "-m", "ipuserve", "models", "--broker", frontend, "--json",
            "--timeout-s", "3"]  # fmt: skip
    return subprocess.run(
        ["ip", "netns", "exec", namespace.name, *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize("insecure", [False, True], ids=["protected", "insecure"])
def test_a_keyless_broker_process_serves_another_address_only_when_insecure(
    processes: Processes, namespace: Namespace, insecure: bool
) -> None:
    """End to end: ``ipuserve broker`` without keys, bound on this host's end of the
    veth pair, and ``ipuserve models`` from the namespace. By default (protected
    mode) the broker says so at start, refuses the peer (logged with its address and
    counted) and the client is told at once that it was refused; with ``--insecure`` the
    broker warns at start and the same client is served."""
    host = namespace.host_address
    broker = start_broker(
        processes,
        *(["--insecure"] if insecure else []),
        frontend=f"tcp://{host}:*",
        backend=f"tcp://{host}:*",
        ping_check=False,  # from this host's side its address is not loopback either
    )
    startup = r"WARNING .*security: INSECURE" if insecure else r"security: protected mode"
    broker.proc.wait_for(startup)
    listed = models_from(namespace, broker.frontend)
    refused = scrape(broker.metrics_url).get(f'{REFUSED}{{socket="frontend"}}', 0.0)
    if insecure:
        assert listed.returncode == 0, listed.stderr
        assert json.loads(listed.stdout) == []  # served: no worker yet, so no model
        assert refused == 0
    else:
        assert listed.returncode != 0, listed.stdout
        assert "[HANDSHAKE_REFUSED]" in listed.stderr and "protected mode" in listed.stderr
        assert refused >= 1
        broker.proc.wait_for(rf"address {re.escape(namespace.peer_address)} not a loopback")
