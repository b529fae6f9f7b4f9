"""ModelHost in-process: IPU accounting, states, and loads and unloads that overlap.

The hosted versions are real BrokerNodes joining a fake broker (a bare ROUTER); their
backend is the test's (an add function), built when the test lets it: so a test can
unload a version while it still loads, or load it again while it drains.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ipuserve import protocol as wire
from ipuserve.errors import DeviceUnavailableError
from ipuserve.runtime.popef import examples
from ipuserve.worker.backend import Backend
from ipuserve.worker.config import WorkerConfig
from ipuserve.worker.host import ModelHost
from ipuserve.worker.host_node import host_nodes
from ipuserve.worker.repository import RepoEntry, Repository
from tests.helpers import wait_until
from tests.worker.fakes import TIMEOUT, FakeBroker, GatedAdd


class Builds:
    """The host's backend factory: each build waits for the test's go-ahead (``gate``),
    and every backend is kept to check that it was closed."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.built: list[tuple[RepoEntry, int]] = []
        self.closed: list[str] = []
        self.fail: Exception | None = None

    def __call__(self, entry: RepoEntry, replicas: int) -> Backend:
        assert self.gate.wait(TIMEOUT)
        if self.fail is not None:
            raise self.fail
        self.built.append((entry, replicas))
        backend = GatedAdd().backend()
        close = backend.close

        def closing() -> None:
            close()
            self.closed.append(f"{entry.name}:{entry.version}")

        backend.close = closing  # type: ignore[method-assign]
        return backend


@pytest.fixture
def fake() -> Iterator[FakeBroker]:
    broker = FakeBroker()
    yield broker
    broker.close()


@pytest.fixture
def repo(tmp_path: Path) -> Repository:
    for version in ("1", "2"):
        examples.simple().write(tmp_path / "add" / version / "add.popef")
    examples.simple().write(tmp_path / "big" / "1" / "big.popef")
    (tmp_path / "big" / "config.toml").write_text("replicas = 3\n")
    return Repository(tmp_path)


@pytest.fixture
def host(repo: Repository, fake: FakeBroker) -> Iterator[tuple[ModelHost, Builds]]:
    builds = Builds()
    config = WorkerConfig(broker=fake.endpoint, worker_id="h", heartbeat_ms=50)
    model_host = ModelHost(repo, 4, config, [fake.endpoint], make_backend=builds)
    yield model_host, builds
    builds.gate.set()
    model_host.close()


def hosted(host: ModelHost) -> dict[tuple[str, str], wire.Hosted]:
    return {(h.name, h.version): h for h in host.report().hosted}


def welcome(fake: FakeBroker, worker_id: str) -> None:
    while True:
        identity, message = fake.recv()
        if isinstance(message, wire.Hello) and message.worker_id == worker_id:
            fake.send(identity, wire.Welcome("e", 50, 60_000))
            return


def test_a_load_is_loading_until_its_worker_joins_then_ready(
    host: tuple[ModelHost, Builds], fake: FakeBroker
) -> None:
    model_host, builds = host
    rings = []
    model_host.watch(lambda: rings.append(1))
    report = model_host.report()
    assert (report.ipus, report.free_ipus, report.hosted) == (4, 4, ())
    assert [(e.name, e.version, e.replicas) for e in report.repository] == [
        ("add", "1", 1),
        ("add", "2", 1),
        ("big", "1", 3),
    ]
    model_host.load("big", "1")  # replicas: its config's (a broker's LOAD names them)
    assert hosted(model_host)[("big", "1")].state == "LOADING"
    assert model_host.report().free_ipus == 1 and rings
    welcome(fake, "h/big/1")
    wait_until(lambda: hosted(model_host)[("big", "1")].state == "READY", TIMEOUT)
    assert builds.built[0][1] == 3
    seq = model_host.seq
    model_host.handle(wire.Load("big", "1", replicas=3))  # hosted already: only a report
    assert model_host.seq == seq + 1 and len(builds.built) == 1
    model_host.handle(wire.Load("add", "1", replicas=2))
    assert "no room: it needs 2 IPU(s), this worker has 1 of 4 free" in (
        hosted(model_host)[("add", "1")].reason
    )
    model_host.handle(wire.Unload("big", "1"))
    wait_until(lambda: ("big", "1") not in hosted(model_host), TIMEOUT)
    assert builds.closed == ["big:1"] and model_host.report().free_ipus == 4


def test_unload_while_it_loads_drains_as_soon_as_it_exists(
    host: tuple[ModelHost, Builds],
) -> None:
    model_host, builds = host
    builds.gate.clear()
    model_host.load("add", None)  # the latest: 2
    assert hosted(model_host)[("add", "2")].state == "LOADING"
    model_host.unload("add", "2")
    assert hosted(model_host)[("add", "2")].state == "UNLOADING"
    assert model_host.report().free_ipus == 3  # held until its backend is closed
    builds.gate.set()
    wait_until(lambda: not hosted(model_host), TIMEOUT)
    assert builds.closed == ["add:2"] and model_host.report().free_ipus == 4


def test_a_load_while_it_drains_loads_it_again_once_freed(
    host: tuple[ModelHost, Builds], fake: FakeBroker
) -> None:
    model_host, builds = host
    builds.gate.clear()
    model_host.load("add", "1")
    model_host.unload("add", "1")
    model_host.load("add", "1", replicas=2)  # while it drains
    builds.gate.set()
    wait_until(lambda: len(builds.built) == 2, TIMEOUT)
    assert builds.closed == ["add:1"] and builds.built[1][1] == 2
    assert hosted(model_host)[("add", "1")].state == "LOADING"
    assert model_host.report().free_ipus == 2


def test_a_failed_load_is_unavailable_with_why_and_holds_no_ipu(
    host: tuple[ModelHost, Builds],
) -> None:
    model_host, builds = host
    builds.fail = DeviceUnavailableError("no free device with 1 IPU(s): IPUs 0 (pid 7) in use")
    model_host.load("add", "1")
    wait_until(lambda: hosted(model_host)[("add", "1")].state == "UNAVAILABLE", TIMEOUT)
    why = hosted(model_host)[("add", "1")].reason
    assert why.startswith("its load failed: no free device") and "pid 7" in why
    assert model_host.report().free_ipus == 4
    builds.fail = None
    model_host.load("add", "1")  # tried again
    assert hosted(model_host)[("add", "1")].state == "LOADING"
    model_host.load("nope", "3")
    assert "not in this worker's repository" in hosted(model_host)[("nope", "3")].reason
    model_host.unload("nope", "3")
    assert ("nope", "3") not in hosted(model_host)


def test_a_load_of_a_broken_entry_is_unavailable_with_its_problem(
    host: tuple[ModelHost, Builds], tmp_path: Path
) -> None:
    """A LOAD no broker sends (it refuses the command from the host's report) but a
    host must still answer: an entry broken since (here: added without a model file)."""
    model_host, builds = host
    (tmp_path / "empty" / "1").mkdir(parents=True)
    model_host.handle(wire.Load("empty", "1"))
    broken = hosted(model_host)[("empty", "1")]
    assert broken.state == "UNAVAILABLE" and broken.reason.startswith("no .popef file"), broken
    assert model_host.report().free_ipus == 4 and builds.built == []


def test_host_nodes_report_after_every_welcome_and_pass_on_load_and_unload(
    host: tuple[ModelHost, Builds], fake: FakeBroker
) -> None:
    """The host node: HELLO without models or credit, HOST after WELCOME and again
    after a reconnect, LOAD/UNLOAD handed to the host, its last report before BYE."""
    model_host, _builds = host
    config = WorkerConfig(broker=fake.endpoint, worker_id="h", heartbeat_ms=50)
    nodes = host_nodes(model_host, config, [fake.endpoint])
    thread = threading.Thread(target=nodes.run, daemon=True)
    thread.start()
    try:
        node = _join_host(fake)
        assert isinstance(fake.expect(wire.Host)[1], wire.Host)
        fake.send(node, wire.Reconnect())  # as a broker that lost us says
        node = _join_host(fake)
        first = fake.expect(wire.Host)[1]  # sent again, though nothing changed
        assert first.free_ipus == 4 and not first.hosted
        fake.send(node, wire.Load("add", "2", replicas=2))
        report = _next_report(fake, lambda r: bool(r.hosted))
        assert [(h.name, h.version, h.replicas) for h in report.hosted] == [("add", "2", 2)]
        assert report.free_ipus == 2
        fake.send(node, wire.Unload("add", "2"))
        _next_report(fake, lambda r: not r.hosted and r.free_ipus == 4)
    finally:
        nodes.request_stop()
        thread.join(TIMEOUT)
    assert not thread.is_alive()
    assert isinstance(_next_message(fake, wire.Bye), wire.Bye)


def _join_host(fake: FakeBroker) -> bytes:
    while True:
        identity, message = fake.recv()
        if isinstance(message, wire.Hello) and message.worker_id == "h":
            assert message.models == () and message.credit == 0
            fake.send(identity, wire.Welcome("e", 50, 60_000))
            return identity


def _next_report(fake: FakeBroker, wanted: Callable[[wire.Host], bool]) -> wire.Host:
    while True:
        report = _next_message(fake, wire.Host)
        if wanted(report):
            return report


def _next_message(fake: FakeBroker, kind: type[Any]) -> Any:
    """The next ``kind`` from the host node (the hosted version's HELLOs skipped)."""
    while True:
        _identity, message = fake.recv()
        if isinstance(message, kind):
            return message
