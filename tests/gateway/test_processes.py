"""``ipuserve gateway --processes N``: a supervisor and N gateway processes sharing the
doors' ports (gateway/supervisor.py), against a real broker and workers.

Which process holds a connection is read from /proc (the server side of the TCP
connection, by its inode, among each process's file descriptors), so the tests can
pin a kept-alive connection to each process and prove every one of them answers,
without timing anything.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.gateway.conftest import (
    Fabric,
    GatewayProc,
    gateway_argv,
    mlp_input,
    start_gateway,
    started_gateway,
)
from tests.helpers import Processes, wait_until

pytestmark = pytest.mark.slow

#: three Python processes importing numpy, aiohttp and grpcio on a loaded two-core machine
START_S = 120.0
CLOSE = {"rtol": 1e-5, "atol": 1e-5}
_EXITED = r"gateway process (\d+) \(pid {pid}\) exited \(signal 9\); restarting"


# ---------------------------------------------------------------- processes, from /proc


def children_of(pid: int) -> set[int]:
    """The live child processes of ``pid`` (every thread's, as any may have forked)."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            found |= {int(child) for child in (task / "children").read_text().split()}
    return found


def wait_children(supervisor: GatewayProc, count: int) -> set[int]:
    pids: set[int] = set()

    def counted() -> bool:
        nonlocal pids
        pids = children_of(supervisor.proc.pid)
        return len(pids) == count

    wait_until(counted, timeout=START_S)
    return pids


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            if match := re.fullmatch(r"socket:\[(\d+)\]", os.readlink(fd)):
                inodes.add(int(match[1]))
    return inodes


def _tcp() -> Iterator[tuple[int, int, int]]:
    """(local port, remote port, inode) of this host's TCP sockets, IPv4 and IPv6 (grpcio
    serves an IPv4 address on an IPv6 socket)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, remote = (int(f.rsplit(":", 1)[1], 16) for f in fields[1:3])
            yield local, remote, int(fields[9])


def _server_inode(server_port: int, client_port: int) -> int:
    """The inode of the server's side of the loopback connection from ``client_port``."""
    for local, remote, inode in _tcp():
        if (local, remote) == (server_port, client_port):
            return inode
    raise AssertionError(f"no connection from :{client_port} to :{server_port}")


def connections_held(pid: int, port: int) -> int:
    """How many connections to ``port`` (their server side) process ``pid`` holds."""
    mine = _socket_inodes(pid)
    return sum(1 for local, remote, inode in _tcp() if local == port and remote and inode in mine)


def owner(connection: http.client.HTTPConnection, port: int, pids: set[int]) -> int:
    """Which of ``pids`` holds the server side of ``connection`` (it answered on it)."""
    assert connection.sock is not None
    inode = _server_inode(port, connection.sock.getsockname()[1])
    [pid] = [pid for pid in pids if inode in _socket_inodes(pid)]
    return pid


def gateways_naming(text: str) -> list[int]:
    """Supervised gateway processes whose command line holds ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if b"--supervised" in argv and any(text.encode() in arg for arg in argv):
                found.append(int(entry.name))
    return found


# ---------------------------------------------------------------- HTTP


def _request(
    connection: http.client.HTTPConnection, method: str, path: str, body: Any = None
) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    connection.request(method, path, body=data, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    text = response.read()
    return response.status, json.loads(text) if text else None


def infer_mlp(fabric: Fabric, connection: http.client.HTTPConnection, seed: int) -> None:
    """One JSON infer of the mlp on ``connection``, checked against numpy."""
    x = mlp_input(1 + seed % 4, seed=seed)
    tensor = {
        "name": "input",
        "datatype": "FP32",
        "shape": list(x.shape),
        "data": x.ravel().tolist(),
    }
    status, body = _request(connection, "POST", "/v2/models/mlp/infer", {"inputs": [tensor]})
    assert status == 200, body
    got = {
        out["name"]: np.array(out["data"], np.float32).reshape(out["shape"])
        for out in body["outputs"]
    }
    for name, want in fabric.models["mlp"].reference({"input": x}).items():
        np.testing.assert_allclose(got[name], want, **CLOSE)


def infer_on_new_connections(fabric: Fabric, gateway: GatewayProc, count: int) -> None:
    """``count`` mlp requests, each on a connection of its own, all answered right."""
    host, port = gateway.host_port.rsplit(":", 1)
    for seed in range(count):
        connection = http.client.HTTPConnection(host, int(port), timeout=60)
        try:
            infer_mlp(fabric, connection, seed)
        finally:
            connection.close()


@contextlib.contextmanager
def one_connection_each(gateway: GatewayProc, pids: set[int]) -> Iterator[dict[int, Any]]:
    """A kept-alive connection to each of ``pids``, each once its process serves mlp:
    new connections until every process holds one (the kernel picks by a hash of the
    addresses, so 64 tries all missing a process is a 2**-63 chance)."""
    host, port = gateway.host_port.rsplit(":", 1)
    pinned: dict[int, http.client.HTTPConnection] = {}
    opened = []
    try:
        for _ in range(64):
            connection = http.client.HTTPConnection(host, int(port), timeout=60)
            opened.append(connection)
            assert _request(connection, "GET", "/v2/health/live")[0] == 200
            pinned.setdefault(owner(connection, int(port), pids), connection)
            if len(pinned) == len(pids):
                break
        assert set(pinned) == pids, f"connections reached only {sorted(pinned)} of {sorted(pids)}"
        for connection in pinned.values():
            wait_until(
                lambda c=connection: _request(c, "GET", "/v2/models/mlp/ready")[0] == 200,
                timeout=START_S,
            )
        yield pinned
    finally:
        for connection in opened:
            connection.close()


# ---------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def pair(fabric: Fabric) -> Iterator[GatewayProc]:
    """A supervisor of two gateway processes in front of the module's fabric, stopped
    with SIGTERM at the end (the fabric's SIGKILL would leave its directory behind)."""
    argv = gateway_argv(fabric.broker, "--processes", "2")
    supervisor = started_gateway(fabric.procs.start("gateway-pair", argv), argv, timeout=START_S)
    yield supervisor
    supervisor.proc.terminate()
    supervisor.proc.wait(timeout=START_S)


def test_the_start_line_names_the_processes_and_the_ports(pair: GatewayProc) -> None:
    line = pair.proc.wait_for(r"ipuserve gateway: 2 processes, ").string
    assert f"http {pair.url}, grpc {pair.grpc}, brokers " in line
    assert not pair.host_port.endswith(":0") and pair.grpc and not pair.grpc.endswith(":0")
    assert len(wait_children(pair, 2)) == 2


def test_both_processes_answer_on_one_port(fabric: Fabric, pair: GatewayProc) -> None:
    pids = wait_children(pair, 2)
    with one_connection_each(pair, pids) as pinned:
        for seed, connection in enumerate(pinned.values()):
            infer_mlp(fabric, connection, seed)
    infer_on_new_connections(fabric, pair, 20)


def test_a_killed_process_is_restarted_while_the_other_serves(
    fabric: Fabric, pair: GatewayProc
) -> None:
    pids = wait_children(pair, 2)
    victim, survivor = sorted(pids)
    mark = pair.proc.mark()
    os.kill(victim, signal.SIGKILL)
    slot = pair.proc.wait_for(_EXITED.format(pid=victim), timeout=START_S, since=mark)[1]
    # the victim is reaped (its sockets closed): the port is served by the survivor
    # and, once it is up, the restarted process
    infer_on_new_connections(fabric, pair, 10)
    pair.proc.wait_for(rf"gateway process {slot} \(pid \d+\) started", timeout=START_S, since=mark)
    now = wait_children(pair, 2)
    assert survivor in now and victim not in now
    with one_connection_each(pair, now) as pinned:
        for seed, connection in enumerate(pinned.values()):
            infer_mlp(fabric, connection, seed)
    infer_on_new_connections(fabric, pair, 10)


#: a channel of its own per client: grpcio shares one connection among channels to the
#: same target with the same options (tritonclient's clients too) unless told not to
OWN_CONNECTION = [
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.max_receive_message_length", -1),
]


def test_grpc_channels_spread_over_the_processes(fabric: Fabric, pair: GatewayProc) -> None:
    """One gRPC channel is one connection, so one process; 32 channels of their own
    reach both (all 32 on one process: a 2**-31 chance)."""
    assert pair.grpc is not None
    pids = wait_children(pair, 2)
    mlp = fabric.models["mlp"]
    clients = [
        grpcclient.InferenceServerClient(pair.grpc, channel_args=OWN_CONNECTION) for _ in range(32)
    ]
    try:
        for seed, triton in enumerate(clients):
            wait_until(lambda t=triton: bool(t.is_model_ready("mlp")), timeout=START_S)
            x = mlp_input(1 + seed % 4, seed=seed)
            tensor = grpcclient.InferInput("input", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x)
            result = triton.infer("mlp", [tensor])
            for name, want in mlp.reference({"input": x}).items():
                np.testing.assert_allclose(result.as_numpy(name), want, **CLOSE)
        port = int(pair.grpc.rsplit(":", 1)[1])
        held = {pid: connections_held(pid, port) for pid in pids}
        assert all(held.values()) and sum(held.values()) >= 32, held
    finally:
        for triton in clients:
            triton.close()


def test_a_plain_gateway_cannot_take_the_shared_port(fabric: Fabric, pair: GatewayProc) -> None:
    """Sharing is for the supervisor's children only: a gateway of one process binds
    without SO_REUSEPORT, so the port is refused to it."""
    argv = gateway_argv(fabric.broker, "--grpc", "off")
    argv[argv.index("--http") + 1] = pair.host_port
    refused = subprocess.run(argv, capture_output=True, text=True, timeout=START_S)
    assert refused.returncode == 1, refused.stderr
    assert "address already in use" in refused.stderr


def test_one_process_still_binds_exclusively(fabric: Fabric, processes: Processes) -> None:
    first = start_gateway(processes, fabric.broker, "--grpc", "off")
    argv = gateway_argv(fabric.broker, "--grpc", "off", "--processes", "1")
    argv[argv.index("--http") + 1] = first.host_port
    refused = subprocess.run(argv, capture_output=True, text=True, timeout=START_S)
    assert refused.returncode == 1 and "address already in use" in refused.stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_every_process_and_removes_the_directory(
    fabric: Fabric, processes: Processes, signum: signal.Signals
) -> None:
    argv = gateway_argv(fabric.broker, "--processes", "2")
    supervisor = started_gateway(processes.start("gateway-n", argv), argv, timeout=START_S)
    pids = wait_children(supervisor, 2)
    [directory] = {_environ(pid)["PROMETHEUS_MULTIPROC_DIR"] for pid in pids}
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    supervisor.proc.popen.send_signal(signum)  # to the supervisor alone: it passes it on
    assert supervisor.proc.wait(timeout=START_S) == 0, supervisor.proc.output()
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)
    assert not Path(directory).exists()
    for pid in pids:  # each drained, and its records name it
        assert f"gateway-{pid} ipuserve.gateway.app: stopping: closing" in supervisor.proc.output()


def test_a_supervisor_killed_takes_its_processes_with_it(
    fabric: Fabric, processes: Processes
) -> None:
    """SIGKILL cannot be forwarded: the children stop at the end of their stdin."""
    argv = gateway_argv(fabric.broker, "--processes", "2", "--grpc", "off")
    supervisor = started_gateway(processes.start("gateway-n", argv), argv, timeout=START_S)
    pids = wait_children(supervisor, 2)
    [directory] = {_environ(pid)["PROMETHEUS_MULTIPROC_DIR"] for pid in pids}
    os.kill(supervisor.proc.pid, signal.SIGKILL)
    try:
        wait_until(lambda: all(_gone(pid) for pid in pids), timeout=START_S)
    finally:
        shutil.rmtree(directory, ignore_errors=True)  # a killed supervisor cannot


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie its new parent has not reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True


def _environ(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
    return dict(pair.split("=", 1) for pair in pairs if "=" in pair)


def test_a_process_that_cannot_start_fails_the_supervisor(
    fabric: Fabric, processes: Processes
) -> None:
    with socket.socket() as taken:  # bound and listening, without SO_REUSEPORT
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        argv = gateway_argv(fabric.broker, "--processes", "2")
        argv[argv.index("--http") + 1] = address
        proc = processes.start("gateway-n", argv)
        assert proc.wait(timeout=START_S) == 1, proc.output()
    output = proc.output()
    assert re.search(r"Error: gateway process \d could not start: cannot serve: .*in use", output)
    assert "ipuserve gateway: 2 processes" not in output
    assert gateways_naming(address) == []


def test_processes_must_be_at_least_one(fabric: Fabric) -> None:
    argv = gateway_argv(fabric.broker, "--processes", "0")
    refused = subprocess.run(argv, capture_output=True, text=True, timeout=START_S)
    assert refused.returncode == 2 and "--processes" in refused.stderr
