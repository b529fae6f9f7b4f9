"""A repository worker (``ipuserve worker --repository``), as real processes: it serves
the versions it loads through a real broker, and takes LOAD/UNLOAD from a broker-side
socket, reporting every change in HOST.

Until the broker learns the control plane (issue 22's broker piece), LOAD and UNLOAD
come from the test playing a second broker (a bare ROUTER speaking the wire, which
lets in the host node only), while a real ``ipuserve broker`` serves the versions:
the worker registers with both, as a worker given two brokers does. The broker of
main routes by name, so while two versions are loaded either may answer; the
results tell them apart (different weights), checked against numpy.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ipuserve import protocol as wire
from tests.helpers import Proc, Processes, RawClient, start_broker, wait_until
from tests.repository import SMALL_MLP, MlpVersions, repository_worker_argv, write_version
from tests.test_probes import get
from tests.worker.fakes import FakeBroker

pytestmark = pytest.mark.slow

Array = np.ndarray[Any, Any]
HOST = "host1"
TIMEOUT = 60.0


class Versions(MlpVersions):
    """:class:`MlpVersions`, reading which version a REPLY is from."""

    def which(self, inputs: dict[str, Array], reply: wire.Message) -> str:  # type: ignore[override]
        assert isinstance(reply, wire.Reply), reply
        return super().which(inputs, reply.tensors.arrays())


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """mlp versions 1 and 2 (other seeds), an empty version, and a broken config."""
    root = tmp_path / "repo"
    write_version(root, "mlp", "--seed", "1", *SMALL_MLP)
    write_version(root, "mlp", "--seed", "2", *SMALL_MLP)
    write_version(root, "simple")
    (root / "simple" / "config.toml").write_text("replicas = 'two'\n")
    (root / "empty" / "1").mkdir(parents=True)
    return root


def host_argv(repo: Path, *brokers: str, args: tuple[str, ...] = ()) -> list[str]:
    return repository_worker_argv(brokers, repo, HOST, *args)


def mlp_inputs(rng: np.random.Generator, rows: int) -> dict[str, Array]:
    return {"input": rng.standard_normal((rows, 16)).astype(np.float32)}


def test_a_repository_worker_serves_the_version_it_loads_at_start(
    processes: Processes, repo: Path
) -> None:
    broker = start_broker(processes)
    args = ("--load", "mlp:1", "--metrics-port", "0")
    host = processes.start("host", host_argv(repo, broker.backend, args=args))
    host.wait_for(rf"worker {HOST}/mlp/1 registered with \S+ \(epoch {broker.epoch}")
    probes = host.wait_for(r"metrics on (http://127\.0\.0\.1:\d+)/metrics")[1]
    wait_until(lambda: get(f"{probes}/ready")[0] == 200)  # the host node joined
    assert get(f"{probes}/healthz")[0] == 200
    # the broken entries are said at start, and did not stop the worker
    host.wait_for(r"simple:1: .*config\.toml.*replicas")
    host.wait_for(r"empty:1: no \.popef file")
    versions = Versions(repo)
    rng = np.random.default_rng(0)
    with RawClient(broker.frontend) as client:
        [info] = [m for m in client.models() if m.spec.name == "mlp"]
        assert info.spec.version == "1"
        assert [w.worker_id for w in info.workers] == [f"{HOST}/mlp/1"]
        for rows in (1, 3, 16, 20):
            inputs = mlp_inputs(rng, rows)
            assert versions.which(inputs, client.call("mlp", inputs)) == "1"
    host.terminate()
    assert host.wait() == 0
    host.wait_for(rf"worker {HOST}/mlp/1 drained")


class Control:
    """The test's broker-side socket: lets the host node in, sends it LOAD and UNLOAD,
    reads its HOST reports. The hosted versions' HELLOs to it go unanswered."""

    def __init__(self) -> None:
        self.fake = FakeBroker()
        self.endpoint = self.fake.endpoint
        self.host: bytes | None = None
        self.last = wire.Host(ipus=0, free_ipus=0)
        self.byes = 0

    def welcome(self) -> None:
        """Wait for the host node's HELLO (no models, credit 0) and let it in."""
        hello = self._next(lambda m: isinstance(m, wire.Hello) and m.worker_id == HOST)
        assert hello.models == () and hello.credit == 0, hello

    def report(self, until: Callable[[wire.Host], bool]) -> wire.Host:
        """The first HOST report (from now) that ``until`` accepts."""
        self.last = self._next(lambda m: isinstance(m, wire.Host) and until(m))
        return self.last

    def state(self, until: Callable[[wire.Host], bool]) -> wire.Host:
        """The last report if ``until`` accepts it, else the next one it accepts: for a
        state the host may have reached before its last report (a fast load's READY)."""
        return self.last if until(self.last) else self.report(until)

    def send(self, message: wire.Message) -> None:
        assert self.host is not None
        self.fake.send(self.host, message)

    def _next(self, wanted: Callable[[Any], bool]) -> Any:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            try:
                identity, message = self.fake.recv(timeout=1.0)
            except TimeoutError:
                continue
            if isinstance(message, wire.Hello) and message.worker_id == HOST:
                self.host = identity
                self.fake.send(identity, wire.Welcome("control", 50, 600_000))
            if isinstance(message, wire.Bye) and identity == self.host:
                self.byes += 1
            if wanted(message):
                return message
        raise AssertionError("the host never sent what the test waited for")


def hosted(report: wire.Host) -> dict[tuple[str, str], wire.Hosted]:
    return {(h.name, h.version): h for h in report.hosted}


class Traffic:
    """A client thread sending mlp requests without pause (8 in flight) until stopped,
    keeping each request's inputs and reply."""

    def __init__(self, frontend: str) -> None:
        self.frontend = frontend
        self.stop = threading.Event()
        self.sent: dict[bytes, dict[str, Array]] = {}
        self.replies: dict[bytes, wire.Message] = {}
        self.order: list[bytes] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        rng = np.random.default_rng(1)
        with RawClient(self.frontend) as client:
            while not self.stop.is_set() or len(self.replies) < len(self.sent):
                while not self.stop.is_set() and len(self.sent) - len(self.replies) < 8:
                    inputs = mlp_inputs(rng, int(rng.integers(1, 20)))
                    request_id = client.request("mlp", inputs)
                    self.sent[request_id] = inputs
                    self.order.append(request_id)
                reply = client.recv(TIMEOUT)
                self.replies[reply.request_id] = reply  # type: ignore[union-attr]

    def mark(self) -> int:
        return len(self.order)

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(TIMEOUT)
        assert not self.thread.is_alive(), "requests went unanswered"


def test_load_and_unload_from_a_broker_drain_and_free_the_ipus(
    processes: Processes, repo: Path
) -> None:
    broker = start_broker(processes)
    control = Control()
    try:
        argv = host_argv(repo, broker.backend, control.endpoint, args=("--load", "mlp:1"))
        host = processes.start("host", argv)
        control.welcome()
        first = control.report(lambda r: ("mlp", "1") in hosted(r))
        assert (first.ipus, first.free_ipus) == (4, 3)
        problems = {(e.name, e.version): e.problem for e in first.repository}
        assert problems[("mlp", "1")] == problems[("mlp", "2")] == ""
        assert "replicas" in problems[("simple", "1")]
        assert problems[("empty", "1")].startswith("no .popef file")
        ready = control.state(lambda r: hosted(r)[("mlp", "1")].state == "READY")
        assert hosted(ready)[("mlp", "1")].worker_id == f"{HOST}/mlp/1"
        _switch_under_traffic(processes, broker.frontend, control, host, repo)
        _refusals_are_reported_with_their_reason(control)
        host.terminate()
        assert host.wait() == 0
        host.wait_for(rf"worker {HOST}/mlp/2 drained")
        control.report(lambda r: not r.hosted and r.free_ipus == 4)  # drained, then BYE
    finally:
        control.fake.close()


def _switch_under_traffic(
    processes: Processes, frontend: str, control: Control, host: Proc, repo: Path
) -> None:
    """Unload v1 under traffic, then load v2: v1 drains (what it runs finishes, what it
    has not started goes back to the broker, which holds it and what arrives meanwhile
    for the model's next worker), its IPU is freed, v2 answers the rest. The broker of
    main keeps one schema per name, version included, so the two cannot serve at once
    there: that switch (load v2, then unload v1) is the broker piece's to test."""
    traffic = Traffic(frontend)
    wait_for_replies(traffic, 20)
    control.send(wire.Unload("mlp", "1"))  # UNLOADING (a report may say so), then gone
    freed = control.report(lambda r: ("mlp", "1") not in hosted(r))
    assert freed.free_ipus == 4
    host.wait_for(rf"worker {HOST}/mlp/1 drained: finished \d+ job\(s\), handed back \d+")
    after = traffic.mark()  # sent once v1 was gone: only v2 can answer them
    control.send(wire.Load("mlp", "2", replicas=1, wanted_workers=1))
    loading = control.report(lambda r: ("mlp", "2") in hosted(r))
    assert hosted(loading)[("mlp", "2")].state in ("LOADING", "READY")
    assert hosted(loading)[("mlp", "2")].worker_id == f"{HOST}/mlp/2"
    assert loading.free_ipus == 3
    control.state(lambda r: hosted(r)[("mlp", "2")].state == "READY")
    host.wait_for(rf"worker {HOST}/mlp/2 registered with")
    control.send(wire.Load("mlp", "2"))  # again: a no-op, answered by a report
    again = control.report(lambda r: True)
    assert hosted(again)[("mlp", "2")].state == "READY" and again.free_ipus == 3
    wait_for_replies(traffic, after + 40)
    traffic.finish()
    assert len(traffic.replies) == len(traffic.sent)
    versions = Versions(repo)
    answered = {
        rid: versions.which(traffic.sent[rid], traffic.replies[rid]) for rid in traffic.order
    }
    assert len(answered) == len(traffic.sent)  # 0 failed (which() checks each), 0 lost
    assert "1" in answered.values()
    assert {answered[rid] for rid in traffic.order[after:]} == {"2"}


def wait_for_replies(traffic: Traffic, count: int) -> None:
    wait_until(lambda: len(traffic.replies) >= count, timeout=TIMEOUT)


def _refusals_are_reported_with_their_reason(control: Control) -> None:
    cases = {
        ("nope", "1"): "not in this worker's repository",
        ("empty", "1"): "no .popef file",
        ("simple", "1"): "replicas",
    }
    for name, version in cases:
        control.send(wire.Load(name, version))
    report = control.report(lambda r: all(key in hosted(r) for key in cases))
    for key, said in cases.items():
        assert hosted(report)[key].state == "UNAVAILABLE" and said in hosted(report)[key].reason
    control.send(wire.Load("mlp", "1", replicas=4))  # 3 free
    full = control.report(lambda r: ("mlp", "1") in hosted(r))
    assert (
        "no room: it needs 4 IPU(s), this worker has 3 of 4 free"
        in hosted(full)[("mlp", "1")].reason
    )
    assert full.free_ipus == 3
    for name, version in [*cases, ("mlp", "1")]:
        control.send(wire.Unload(name, version))
    control.report(lambda r: set(hosted(r)) == {("mlp", "2")})
