"""Issue 22's switch of versions under load, as real processes: a repository holding
``mlp`` versions 1 and 2 (other seeds, so numpy tells their answers apart), two
repository workers, a broker, eight client threads sending without pause; load v1 on
both workers, load v2 (the default moves to v2 once it is READY), unload v1 (it drains).
No request fails or is lost, every result matches the reference of the version its
reply names, and once v1 is unloaded only v2 answers. The same switch driven through
the gateway by ``tritonclient`` (Triton's repository extension) over HTTP.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ipuserve.client import Client
from ipuserve.errors import UnknownModelError
from tests.gateway.conftest import start_gateway
from tests.helpers import BrokerProc, Processes, metric, scrape, start_broker, wait_until
from tests.repository import SMALL_MLP, MlpVersions, repository_worker_argv, write_version

pytestmark = pytest.mark.slow

Array = np.ndarray[Any, Any]
THREADS = 8
TIMEOUT_S = 60.0


@dataclass
class Traffic:
    """Eight threads sending without pause until stopped; what each reply said."""

    versions: MlpVersions
    send: Any  # (inputs) -> (version, outputs)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: (sequence number at send, version that answered, matched its reference)
    answered: list[tuple[int, str | None, bool]] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    sent: int = 0

    def run(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=self._loop, args=(n,)) for n in range(THREADS)]
        for thread in threads:
            thread.start()
        return threads

    def mark(self) -> int:
        """A point in the traffic: requests sent after it started after this call."""
        with self.lock:
            return self.sent

    def answers(self) -> int:
        with self.lock:
            return len(self.answered)

    def answered_by(self, version: str, since: int) -> bool:
        """Whether ``version`` answered a request sent after mark ``since``."""
        with self.lock:
            return any(s >= since and v == version for s, v, _ in self.answered)

    def _loop(self, n: int) -> None:
        rng = np.random.default_rng(n)
        while not self.stop.is_set():
            inputs = {"input": rng.standard_normal((1 + n % 3, 16)).astype(np.float32)}
            with self.lock:
                seq = self.sent
                self.sent += 1
            try:
                version, outputs = self.send(inputs)
            except Exception as exc:  # every failure is the test's to report
                with self.lock:
                    self.failed.append(f"{type(exc).__name__}: {exc}")
                continue
            ok = self.versions.matches(version, inputs, outputs)
            with self.lock:
                self.answered.append((seq, version, ok))


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    write_version(root, "mlp", "--seed", "1", *SMALL_MLP)
    write_version(root, "mlp", "--seed", "2", *SMALL_MLP)
    return root


@pytest.fixture
def fabric(processes: Processes, repo: Path, tmp_path: Path) -> Iterator[BrokerProc]:
    """A broker and two repository workers, each its own machine of 2 simulated IPUs
    (its own lock folder: as two containers, not two processes sharing one host's)."""
    broker = start_broker(processes, liveness_ms=3000)  # no host dropped on a busy machine
    for n in (1, 2):
        machine = {"IPUSERVE_SIM_LOCK_DIR": str(tmp_path / f"ipus{n}")}
        argv = repository_worker_argv([broker.backend], repo, f"host{n}", ipus=2)
        processes.start(f"host{n}", argv, env=machine)
    hosts = lambda: metric(scrape(broker.metrics_url), "ipuserve_broker_hosts")  # noqa: E731
    wait_until(lambda: hosts() == 2, timeout=TIMEOUT_S)  # both reported: room on each
    yield broker


def _switch(traffic: Traffic, load_v1: Any, switch: Any) -> int:
    """Load v1, send, switch to v2 (``switch`` returns once v1 is unloaded), send on:
    the mark after which every request must be answered by v2."""
    load_v1()
    threads = traffic.run()
    try:
        wait_until(lambda: traffic.answers() >= 100, timeout=TIMEOUT_S)
        switch()
        after, answered = traffic.mark(), traffic.answers()
        wait_until(lambda: traffic.answers() >= answered + 200, timeout=TIMEOUT_S)
    finally:
        traffic.stop.set()
        for thread in threads:
            thread.join(TIMEOUT_S)
    return after


def _check(traffic: Traffic, after: int) -> None:
    assert traffic.failed == []
    assert len(traffic.answered) == traffic.sent  # none lost
    wrong = [(s, v) for s, v, ok in traffic.answered if not ok]
    assert wrong == [], f"results that match no reference of the version named: {wrong[:5]}"
    seen = {v for _, v, _ in traffic.answered}
    assert seen == {"1", "2"}, seen
    late_v1 = [s for s, v, _ in traffic.answered if s >= after and v != "2"]
    assert late_v1 == [], f"{len(late_v1)} requests sent after the unload answered by v1"


def test_a_version_switch_under_load_fails_and_loses_nothing(
    fabric: BrokerProc, repo: Path
) -> None:
    versions = MlpVersions(repo)
    with Client(fabric.frontend, timeout=TIMEOUT_S) as client:

        def send(inputs: dict[str, Array]) -> tuple[str | None, dict[str, Any]]:
            outputs = client.infer("mlp", inputs)
            return outputs.version, outputs

        traffic = Traffic(versions, send)

        def load(version: str) -> None:
            client.load_model("mlp", version, workers=2, timeout=TIMEOUT_S)
            index = {(v.name, v.version): v for v in client.repository_index()}
            assert index[("mlp", version)].state == "READY"
            assert sorted(index[("mlp", version)].workers) == [
                f"host1/mlp/{version}",
                f"host2/mlp/{version}",
            ]

        def switch() -> None:
            load("2")  # the default moves to v2 once it is READY, v1 still loaded:
            since = traffic.mark()
            wait_until(lambda: traffic.answered_by("2", since), timeout=TIMEOUT_S)
            client.unload_model("mlp", "1", timeout=TIMEOUT_S)  # drains v1

        after = _switch(traffic, lambda: load("1"), switch)
        index = {(v.name, v.version): v for v in client.repository_index()}
    _check(traffic, after)
    assert index[("mlp", "2")].state == "READY" and index[("mlp", "2")].default
    assert index[("mlp", "1")].state == "UNAVAILABLE"


def test_the_same_switch_through_the_gateway_by_tritonclient(
    processes: Processes, fabric: BrokerProc, repo: Path
) -> None:
    import tritonclient.http as httpclient

    versions = MlpVersions(repo)
    gateway = start_gateway(processes, fabric)
    local = threading.local()

    def triton() -> Any:
        if not hasattr(local, "client"):  # tritonclient's HTTP client is per thread
            local.client = httpclient.InferenceServerClient(gateway.host_port)
        return local.client

    def send(inputs: dict[str, Array]) -> tuple[str | None, dict[str, Any]]:
        x = httpclient.InferInput("input", list(inputs["input"].shape), "FP32")
        x.set_data_from_numpy(inputs["input"])
        result = triton().infer("mlp", [x])
        names = [o["name"] for o in result.get_response()["outputs"]]
        return result.get_response()["model_version"], {n: result.as_numpy(n) for n in names}

    traffic = Traffic(versions, send)
    admin = httpclient.InferenceServerClient(gateway.host_port)

    def policy(version: str) -> str:
        return json.dumps({"version_policy": {"specific": {"versions": [int(version)]}}})

    def state(version: str) -> str | None:
        found = [
            m.get("state")
            for m in admin.get_model_repository_index()
            if m["name"] == "mlp" and m.get("version") == version
        ]
        return found[0] if found else None

    def load_v1() -> None:
        admin.load_model("mlp", config=policy("1"))
        wait_until(lambda: state("1") == "READY", timeout=TIMEOUT_S)

    def switch() -> None:
        # Triton's meaning of a version policy: v2 in, and once it is READY the
        # model's other versions out
        admin.load_model("mlp", config=policy("2"))
        wait_until(lambda: state("2") == "READY", timeout=TIMEOUT_S)
        wait_until(lambda: state("1") in (None, "UNAVAILABLE"), timeout=TIMEOUT_S)

    after = _switch(traffic, load_v1, switch)
    _check(traffic, after)


def test_a_request_naming_an_unloaded_version_is_told_it_is_gone(fabric: BrokerProc) -> None:
    """Once v1 is unloaded, a request that names it is refused UNKNOWN_MODEL naming the
    versions there are, at once: not queued as for a version whose worker died (which
    may come back), to fail UNAVAILABLE after ``--orphan-ms`` or at its timeout."""
    inputs = {"input": np.ones((1, 16), np.float32)}
    with Client(fabric.frontend, timeout=TIMEOUT_S) as client:
        client.load_model("mlp", "1", workers=1, timeout=TIMEOUT_S)
        client.load_model("mlp", "2", workers=1, timeout=TIMEOUT_S)
        assert client.infer("mlp", inputs, version=1).version == "1"
        client.unload_model("mlp", "1", timeout=TIMEOUT_S)
        with pytest.raises(UnknownModelError, match=r"has no version 1 \(versions: 2\)"):
            client.infer("mlp", inputs, version=1)
        assert client.infer("mlp", inputs).version == "2"
