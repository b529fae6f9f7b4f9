"""The supervisor's port reservation (gateway/supervisor.py), on real sockets: a door
given port 0 gets one port, held so that sockets with SO_REUSEPORT (the children's)
can bind it and no other can, until the supervisor lets it go."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ipuserve.gateway.config import GatewayConfig, split_address
from ipuserve.gateway.supervisor import STEADY_S, Backoff, describe_exit, reserved_ports


def _bind(port: int, *, reuse_port: bool) -> socket.socket:
    sock = socket.socket()
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        sock.close()
        raise
    return sock


def test_port_zero_becomes_a_port_only_reuse_port_sockets_share() -> None:
    config = GatewayConfig(brokers=("tcp://127.0.0.1:5555",), http="127.0.0.1:0", grpc=None)
    with reserved_ports(config) as fixed:
        assert fixed.grpc is None
        host, port = split_address(fixed.http)
        assert (host, fixed.http) == ("127.0.0.1", f"127.0.0.1:{port}") and port != 0
        with _bind(port, reuse_port=True) as child, _bind(port, reuse_port=True) as other:
            child.listen()
            other.listen()  # two listeners on one port: what the children do
        with pytest.raises(OSError, match="in use"):
            _bind(port, reuse_port=False)
    _bind(port, reuse_port=False).close()  # let go at the end


def test_a_given_port_is_left_to_the_children() -> None:
    config = GatewayConfig(brokers=("tcp://127.0.0.1:5555",), http="127.0.0.1:0", grpc="[::1]:7")
    with reserved_ports(config) as fixed:
        assert fixed.grpc == "[::1]:7"
        assert fixed.http != "127.0.0.1:0"


def test_exits_are_worded_by_signal_or_code() -> None:
    assert (describe_exit(-9), describe_exit(1)) == ("signal 9", "code 1")


def test_the_supervisor_is_a_plain_process_manager() -> None:
    """No client, no event loop, no server library: it only starts and watches."""
    probe = (
        "import sys, ipuserve.gateway.supervisor; print(sorted({m.split('.')[0] if "
        "not m.startswith('ipuserve.') else '.'.join(m.split('.')[:2]) for m in sys.modules}))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    for name in ("ipuserve.client", "asyncio", "aiohttp", "grpc", "zmq"):
        assert f"'{name}'" not in loaded
    assert "'ipuserve.gateway'" in loaded  # the probe saw the imports


def test_the_backoff_doubles_to_ten_seconds_and_starts_over_after_a_steady_run() -> None:
    backoff = Backoff()
    assert [backoff.after(1.0) for _ in range(7)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert [backoff.after(STEADY_S), backoff.after(1.0)] == [0.5, 1.0]


def test_a_child_that_never_announces_itself_fails_the_start_and_is_stopped() -> None:
    """A child that runs but writes no start line (here: one that reads its stdin for
    ever) is not waited for without end: the start fails naming it, and it is stopped."""
    from ipuserve.errors import ConfigError
    from ipuserve.gateway.supervisor import Supervisor

    started: list[int] = []
    config = GatewayConfig(brokers=("tcp://127.0.0.1:5555",), http="127.0.0.1:0", grpc=None)
    hung = [sys.executable, "-c", "import sys; sys.stdin.read()"]

    def argv(_config: GatewayConfig) -> list[str]:
        return hung

    supervisor = Supervisor(config, 2, argv, started.append, start_timeout_s=1.0)
    with pytest.raises(ConfigError, match=r"gateway process 1, 2 did not start within 1 s"):
        supervisor.run()
    assert started == []
    # every child stopped and reaped: none of this process's children runs the hung line
    children = [
        int(pid)
        for task in Path("/proc/self/task").glob("*/children")
        for pid in task.read_text().split()
    ]
    assert not [pid for pid in children if "sys.stdin.read()" in _cmdline(pid)]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""
