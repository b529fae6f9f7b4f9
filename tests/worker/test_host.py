"""A repository worker (``ipuserve worker --repository``), as real processes: it serves
the versions it loads through a real broker, and takes LOAD/UNLOAD from a broker,
reporting every change in HOST.

The LOAD and UNLOAD come from a second real ``ipuserve broker``, told by an admin's
Client, while the first serves the requests: the worker registers with both, as a
worker given two brokers does. Results tell the versions apart (different weights),
checked against numpy. A LOAD that the host itself must refuse (a broker sends none:
it refuses the command from the host's report) is tested in-process, in
tests/worker/test_model_host.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ipuserve import protocol as wire
from ipuserve.client import Client
from ipuserve.errors import NoRoomError, UnknownModelError
from tests.helpers import (
    Proc,
    Processes,
    RawClient,
    metric,
    scrape,
    start_broker,
    wait_until,
)
from tests.repository import SMALL_MLP, MlpVersions, repository_worker_argv, write_version
from tests.test_probes import get

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
    """LOAD and UNLOAD come from one broker (``control``, an admin's Client's commands),
    requests through another (``serving``): the host joins both, as a worker given two
    brokers does, so what one broker loads serves the other's clients. What the host
    reports (HOST) is read where a broker shows it: its index (states, reasons, the
    worker serving a version) and its NO_ROOM message (IPUs free of how many); the IPUs
    it holds from its metrics page."""
    serving = start_broker(processes, liveness_ms=3000)  # no host dropped on a busy machine
    control = start_broker(processes, liveness_ms=3000)
    args = ("--load", "mlp:1", "--metrics-port", "0")
    host = processes.start("host", host_argv(repo, serving.backend, control.backend, args=args))
    page = host.wait_for(r"metrics on (http://127\.0\.0\.1:\d+)/metrics")[1] + "/metrics"
    free = lambda: metric(scrape(page), "ipuserve_worker_free_ipus")  # noqa: E731
    with Client(control.frontend, timeout=TIMEOUT) as admin:
        wait_until(lambda: state(admin, "mlp", "1") == "READY", TIMEOUT)
        assert metric(scrape(control.metrics_url), "ipuserve_broker_hosts") == 1
        assert free() == 3
        index = {(v.name, v.version): v for v in admin.repository_index()}
        assert index[("mlp", "1")].workers == (f"{HOST}/mlp/1",)
        assert (index[("mlp", "2")].state, index[("mlp", "2")].reason) == (
            "UNAVAILABLE",
            "not loaded",
        )
        assert "replicas" in index[("simple", "1")].reason
        assert index[("empty", "1")].reason.startswith("no .popef file")
        _switch_under_traffic(serving.frontend, admin, free, host, repo)
        _refusals_are_said_with_their_reason(admin, free)
    mark = host.mark()
    host.terminate()
    assert host.wait() == 0
    # v2 drained and its IPUs freed before the host node's last report, and its BYE
    host.wait_for(rf"worker {HOST}/mlp/2 drained", since=mark)
    freed = host.wait_for(r"mlp version 2 unloaded", since=mark)
    host.wait_for(rf"worker {HOST} drained", since=host.lines.index(freed.string, mark))
    for broker in (serving, control):  # each dropped the host node and v2
        _dropped_everything(broker.metrics_url)


def _dropped_everything(metrics_url: str) -> None:
    wait_until(lambda: metric(scrape(metrics_url), "ipuserve_broker_workers") == 0, TIMEOUT)
    assert metric(scrape(metrics_url), "ipuserve_broker_hosts") == 0


def state(client: Client, name: str, version: str) -> str | None:
    """The broker's state of ``name`` ``version``; None while it lists no such version."""
    found = client.repository_index().find(name, version)
    return None if found is None else found.state


def _switch_under_traffic(
    frontend: str, admin: Client, free: Callable[[], float], host: Proc, repo: Path
) -> None:
    """Unload v1 under traffic, then load v2: v1 drains (what it runs finishes, what it
    has not started goes back to the broker, which holds it and what arrives meanwhile
    for the model's next worker), its IPU is freed, v2 answers the rest."""
    traffic = Traffic(frontend)
    wait_for_replies(traffic, 20)
    after_unload = admin.unload_model("mlp", "1", timeout=TIMEOUT)  # waits until gone
    assert after_unload.find("mlp", "1") == wire.VersionState(
        "mlp", "1", "UNAVAILABLE", "not loaded"
    )
    wait_until(lambda: free() == 4, TIMEOUT)
    host.wait_for(rf"worker {HOST}/mlp/1 drained: finished \d+ job\(s\), handed back \d+")
    after = traffic.mark()  # sent once v1 was gone: only v2 can answer them
    loaded = admin.load_model("mlp", "2", replicas=1, workers=1, timeout=TIMEOUT)
    assert loaded.find("mlp", "2") == wire.VersionState(
        "mlp", "2", "READY", workers=(f"{HOST}/mlp/2",), default=True
    )
    assert free() == 3
    host.wait_for(rf"worker {HOST}/mlp/2 registered with")
    again = admin.load_model("mlp", "2", timeout=TIMEOUT)  # a no-op, said so
    assert again.message == f"model 'mlp' version 2 is loaded (or loading) on {HOST} already"
    assert state(admin, "mlp", "2") == "READY" and free() == 3
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


def _refusals_are_said_with_their_reason(admin: Client, free: Callable[[], float]) -> None:
    """A broker refuses a load the host's report says cannot be done, saying why, and
    sends it no LOAD (the host's own refusals: tests/worker/test_model_host.py)."""
    cases: list[tuple[str, str, int | None, type[Exception], str]] = [
        ("nope", "1", None, UnknownModelError, "no worker's repository holds model 'nope'"),
        ("empty", "1", None, NoRoomError, r"its entry is broken \(no \.popef file"),
        ("simple", "1", None, NoRoomError, r"its entry is broken \(.*replicas"),
        ("mlp", "1", 4, NoRoomError, rf"{HOST}: 3 of 4 IPU\(s\) free, 4 needed"),
    ]
    for name, version, replicas, error, said in cases:
        with pytest.raises(error, match=said):
            admin.load_model(name, version, replicas=replicas, timeout=TIMEOUT)
    hosted = [(v.name, v.version) for v in admin.repository_index() if v.state != "UNAVAILABLE"]
    assert hosted == [("mlp", "2")] and free() == 3
