"""The model repository's calls and model versions, in both faces of the client.

The waiting rules are tested on the steps alone (``ipuserve.client.repository``: no
I/O). The calls run against the real fabric: a broker and a repository worker
(``ipuserve worker --repository``, 4 simulated IPUs) over a repository written by the
CLI with ``mlp`` versions 1 and 2 (other seeds, so numpy tells their answers apart);
what the client sent is read from the broker's metrics, and every result is checked
against the numpy reference of the version its reply names. PERMISSION_DENIED comes
from a CURVE broker of its own, whose admin allow-list the client's key is not in.
A scripted broker is kept for one thing only a broker-side socket sees: which
requests the client puts in one group on the wire.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ipuserve import protocol as wire
from ipuserve.client import Client, RepositoryIndex
from ipuserve.client.config import ClientConfig
from ipuserve.client.repository import (
    Ask,
    Pause,
    Stepper,
    Steps,
    check_version,
    load_steps,
    unload_steps,
)
from ipuserve.errors import (
    DeadlineExceeded,
    InvalidInputError,
    IpuserveError,
    NoRoomError,
    PermissionDeniedError,
    UnavailableError,
    UnknownModelError,
)
from tests.client.faces import MakeClient
from tests.client.fake_broker import FakeBroker, inputs, scripted_broker, state
from tests.helpers import (
    BrokerProc,
    Processes,
    scrape,
    start_broker,
    start_worker,
    wait_until,
)
from tests.integration.test_curve import admin_only_broker
from tests.repository import SMALL_MLP, MlpVersions, repository_worker_argv, write_version

FAST = ClientConfig(ping_interval_s=0.05, liveness_s=0.3)
TIMEOUT_S = 60.0
HOST = "host1"
Array = np.ndarray[Any, Any]


def index(*states: wire.VersionState) -> RepositoryIndex:
    return RepositoryIndex(states)


def walk(steps: Steps, answers: Sequence[RepositoryIndex]) -> tuple[RepositoryIndex, list[Ask]]:
    """Drive ``steps`` with ``answers``, one per Ask, without pausing; the asks made."""
    stepper, asks, queue = Stepper(steps), [], list(answers)
    step = stepper.next(None)
    while step is not None:
        if isinstance(step, Pause):
            assert step.seconds >= 0
            step = stepper.next(None)
        else:
            asks.append(step)
            step = stepper.next(queue.pop(0))
    assert stepper.result is not None and not queue, "every answer taken"
    return stepper.result, asks


LOAD_V2 = Ask("load", "mlp", "2")


# ---------------------------------------------------------------- the rules, no I/O


def test_a_load_waits_past_the_stale_state_and_through_loading_until_ready() -> None:
    answers = [
        index(state("1", "READY", workers=1), state("2", "UNAVAILABLE", "not loaded")),
        index(state("2", "UNAVAILABLE", "not loaded")),  # the hosts have not reported yet
        index(state("2", "LOADING")),
        index(state("2", "READY", workers=1)),
    ]
    last, asks = walk(load_steps(LOAD_V2, wait=True, timeout_s=10), answers)
    assert [a.action for a in asks] == ["load", "index", "index", "index"]
    assert last.find("mlp", "2") == state("2", "READY", workers=1)


def test_a_load_that_names_no_version_waits_for_the_latest_listed() -> None:
    ask = Ask("load", "mlp")
    answers = [
        index(state("1", "READY", workers=1), state("3", "LOADING"), state("2", "UNAVAILABLE")),
        index(state("1", "READY", workers=1), state("3", "READY", workers=1)),
    ]
    last, asks = walk(load_steps(ask, wait=True, timeout_s=10), answers)
    assert len(asks) == 2 and last.find("mlp", "3") is not None


def test_a_load_waits_for_as_many_workers_as_it_asked_for() -> None:
    ask = Ask("load", "mlp", "2", workers=2)
    answers = [
        index(state("2", "LOADING")),
        index(state("2", "READY", workers=1)),
        index(state("2", "READY", workers=2)),
    ]
    _, asks = walk(load_steps(ask, wait=True, timeout_s=10), answers)
    assert len(asks) == 3


def test_a_version_going_unavailable_while_loading_raises_its_reason() -> None:
    answers = [
        index(state("2", "LOADING")),
        index(state("2", "UNAVAILABLE", "popef: truncated file")),
    ]
    with pytest.raises(UnavailableError, match="mlp version 2 did not load: popef: truncated"):
        walk(load_steps(LOAD_V2, wait=True, timeout_s=10), answers)


def test_a_load_without_wait_returns_the_brokers_answer() -> None:
    first = RepositoryIndex((state("2", "UNAVAILABLE", "not loaded"),), "loading mlp 2 on h0")
    last, asks = walk(load_steps(LOAD_V2, wait=False, timeout_s=10), [first])
    assert last == first and asks == [LOAD_V2]


def test_a_wait_past_its_timeout_names_what_it_saw_last() -> None:
    steps = load_steps(LOAD_V2, wait=True, timeout_s=0.05)
    stepper = Stepper(steps)
    step = stepper.next(None)
    with pytest.raises(DeadlineExceeded, match=r"mlp version 2 READY.*version 2 LOADING"):
        while step is not None:
            if isinstance(step, Pause):
                time.sleep(step.seconds)  # the wait itself is what is tested here
                step = stepper.next(None)
            else:
                step = stepper.next(index(state("2", "LOADING")))


def test_an_unload_waits_until_every_hosted_version_is_gone_or_unavailable() -> None:
    ask = Ask("unload", "mlp")
    answers = [
        index(
            state("1", "READY", workers=1),
            state("2", "READY", workers=1),
            state("3", "UNAVAILABLE"),
        ),
        index(state("1", "UNLOADING"), state("2", "UNAVAILABLE", "not loaded")),
        index(state("2", "UNAVAILABLE", "not loaded")),
    ]
    _, asks = walk(unload_steps(ask, wait=True, timeout_s=10), answers)
    assert [a.action for a in asks] == ["unload", "index", "index"]


@pytest.mark.parametrize("given, wire_version", [(None, None), (2, "2"), ("17", "17")])
def test_versions_are_whole_numbers_as_strings(given: object, wire_version: str | None) -> None:
    assert check_version(given) == wire_version


@pytest.mark.parametrize("bad", ["0", "01", "v2", "", 0, -1, 2.0, True, "1" * 19])
def test_a_version_that_is_no_whole_number_is_refused_at_the_call(bad: object) -> None:
    with pytest.raises(InvalidInputError, match="whole number"):
        check_version(bad)


# ---------------------------------------------------------------- the real fabric


def counted(broker: BrokerProc, family: str, **labels: str) -> float:
    """The broker's ``ipuserve_broker_FAMILY``, summed over the samples whose labels
    include ``labels``: what the client sent, as the broker saw it."""
    want = [f'{key}="{value}"' for key, value in labels.items()]
    name = f"ipuserve_broker_{family}"
    return sum(
        value
        for key, value in scrape(broker.metrics_url).items()
        if key.split("{", 1)[0] == name and all(w in key for w in want)
    )


@dataclass
class Fabric:
    broker: BrokerProc
    versions: MlpVersions

    def counts(self, family: str, **labels: str) -> float:
        return counted(self.broker, family, **labels)

    def reached(self) -> float:
        """Everything from a client the broker counted: requests accepted, errors
        answered, messages dropped, repository commands answered or refused."""
        families = (
            *("requests_total", "errors_total", "dropped_total"),
            *("repository_commands_total", "repository_refused_total"),
        )
        return sum(self.counts(family) for family in families)


_HOSTED = ("READY", "LOADING", "UNLOADING")


def _hosted(client: Client) -> list[tuple[str, str]]:
    return [(v.name, v.version) for v in client.repository_index() if v.state in _HOSTED]


@pytest.fixture(scope="module")
def repo_fabric(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fabric]:
    """The module's broker and repository worker (``host1``, 4 IPUs of its own)."""
    root = tmp_path_factory.mktemp("repository")
    repo = root / "repo"
    write_version(repo, "mlp", "--seed", "1", *SMALL_MLP)
    write_version(repo, "mlp", "--seed", "2", *SMALL_MLP)
    procs = Processes()
    try:
        broker = start_broker(procs, liveness_ms=3000)  # no host dropped on a busy machine
        # module-scoped: set up before the per-test IPU inventory, so the host's is here
        machine = {
            "IPUSERVE_SIM_LOCK_DIR": str(root / "ipus"),
            "IPUSERVE_SIM_IPUS": "4",
            "IPUSERVE_SIM_TIME_SCALE": os.environ.get("IPUSERVE_TEST_TIME_SCALE", "0"),
        }
        procs.start(HOST, repository_worker_argv([broker.backend], repo, HOST), env=machine)
        fabric = Fabric(broker, MlpVersions(repo))
        wait_until(lambda: fabric.counts("hosts") == 1, timeout=TIMEOUT_S)
        yield fabric
    finally:
        procs.close()
        print(f"--- output of the fabric's processes ---\n{procs.output()}")


@pytest.fixture
def fabric(repo_fabric: Fabric) -> Iterator[Fabric]:
    """The module's fabric with nothing loaded; what a test loaded is unloaded after it."""
    with Client(repo_fabric.broker.frontend, timeout=TIMEOUT_S) as client:
        assert _hosted(client) == [], "a test before left versions loaded"
        try:
            yield repo_fabric
        finally:
            for name in {name for name, _ in _hosted(client)}:
                client.unload_model(name, timeout=TIMEOUT_S)


def mlp_inputs(seed: int, rows: int = 3) -> dict[str, Array]:
    rng = np.random.default_rng(seed)
    return {"input": rng.standard_normal((rows, 16)).astype(np.float32)}


def test_load_model_sends_the_command_and_waits_until_ready(
    fabric: Fabric, make_client: MakeClient
) -> None:
    loads = fabric.counts("repository_commands_total", action="load")
    polls = fabric.counts("repository_commands_total", action="index")
    with make_client(fabric.broker.frontend, timeout=TIMEOUT_S) as client:
        last = client.load_model("mlp", 2, replicas=2, workers=1, timeout=TIMEOUT_S)
        assert last.find("mlp", "2") == wire.VersionState(
            "mlp", "2", "READY", workers=(f"{HOST}/mlp/2",), default=True
        )
        # what the command did, not the last poll's ""
        assert last.message == f"loading model 'mlp' version 2 on {HOST} (2 replica(s))"
        assert fabric.counts("repository_commands_total", action="load") == loads + 1
        assert fabric.counts("repository_commands_total", action="index") > polls  # waited
        given = mlp_inputs(1)
        outputs = client.infer("mlp", given, version=2)
        assert outputs.version == "2" and fabric.versions.which(given, outputs) == "2"
        # its 2 replicas hold 2 of the host's 4 IPUs
        with pytest.raises(NoRoomError, match=rf"{HOST}: 2 of 4 IPU\(s\) free, 3 needed"):
            client.load_model("mlp", 1, replicas=3, timeout=TIMEOUT_S)


def test_unload_model_and_the_index_through_the_client(
    fabric: Fabric, make_client: MakeClient
) -> None:
    with make_client(fabric.broker.frontend, timeout=TIMEOUT_S) as client:
        client.load_model("mlp", "1", timeout=TIMEOUT_S)
        before = client.repository_index()
        after = client.unload_model("mlp", "1", timeout=TIMEOUT_S)
    assert [(s.version, s.state, s.reason) for s in before] == [
        ("1", "READY", ""),
        ("2", "UNAVAILABLE", "not loaded"),
    ]
    assert after.find("mlp", "1") == wire.VersionState("mlp", "1", "UNAVAILABLE", "not loaded")
    assert after.message == f"unloading model 'mlp' version 1 on {HOST}"


@pytest.mark.parametrize(
    "version, replicas, code, error, reason",
    [
        (None, None, "UNKNOWN_MODEL", UnknownModelError, "no worker's repository holds model"),
        ("3", None, "UNKNOWN_MODEL", UnknownModelError, "holds version 3 of model 'mlp'"),
        ("1", 5, "NO_ROOM", NoRoomError, rf"{HOST}: 4 of 4 IPU\(s\) free, 5 needed"),
    ],
)
def test_a_refused_command_raises_the_brokers_error_with_its_reason(
    fabric: Fabric,
    make_client: MakeClient,
    version: str | None,
    replicas: int | None,
    code: str,
    error: type[IpuserveError],
    reason: str,
) -> None:
    name = "nope" if version is None else "mlp"
    refused = fabric.counts("repository_refused_total", reason=code)
    polls = fabric.counts("repository_commands_total", action="index")
    with (
        make_client(fabric.broker.frontend, timeout=TIMEOUT_S) as client,
        pytest.raises(error, match=reason),
    ):
        client.load_model(name, version, replicas=replicas, timeout=TIMEOUT_S)
    assert fabric.counts("repository_refused_total", reason=code) == refused + 1
    # no waiting after a refusal
    assert fabric.counts("repository_commands_total", action="index") == polls


def test_a_request_naming_a_version_carries_it_and_the_reply_says_which_answered(
    fabric: Fabric, make_client: MakeClient
) -> None:
    with make_client(fabric.broker.frontend, timeout=TIMEOUT_S) as client:
        client.load_model("mlp", 1, timeout=TIMEOUT_S)
        client.load_model("mlp", 2, timeout=TIMEOUT_S)
        given = mlp_inputs(2)
        for named, answers in (("1", "1"), ("2", "2"), (None, "2")):  # default: the latest
            outputs = client.infer("mlp", given, version=named)
            assert outputs.version == answers
            assert fabric.versions.which(given, outputs) == answers  # numpy's, of that one


def test_requests_naming_different_versions_at_once_each_get_their_versions_answer(
    fabric: Fabric, make_client: MakeClient
) -> None:
    with make_client(fabric.broker.frontend, timeout=TIMEOUT_S) as client:
        client.load_model("mlp", 1, timeout=TIMEOUT_S)
        client.load_model("mlp", 2, timeout=TIMEOUT_S)
        sent = [(v, mlp_inputs(10 + n, rows=1 + n % 3)) for n, v in enumerate(("1", "2") * 12)]
        futures = [(v, x, client.infer_async("mlp", x, version=v)) for v, x in sent]
        for version, given, future in futures:
            outputs = future.result(TIMEOUT_S)
            assert outputs.version == version
            assert fabric.versions.which(given, outputs) == version


def test_a_bad_version_or_name_is_refused_before_anything_is_sent(
    fabric: Fabric, make_client: MakeClient
) -> None:
    before = fabric.reached()
    with make_client(fabric.broker.frontend, timeout=TIMEOUT_S) as client:
        with pytest.raises(InvalidInputError, match="whole number"):
            client.infer("mlp", mlp_inputs(0), version="latest")
        with pytest.raises(InvalidInputError, match="whole number"):
            client.load_model("mlp", "v2")
        with pytest.raises(InvalidInputError, match="model name"):
            client.unload_model("")
        assert fabric.reached() == before
        client.repository_index()  # the same client's next call reaches it, and is counted
        assert fabric.reached() == before + 1


# ---------------------------------------------------------------- a broker with keys


def test_a_client_whose_key_is_no_admins_is_refused_permission_denied(
    processes: Processes, tmp_path: Path, make_client: MakeClient
) -> None:
    """A CURVE broker answers the repository's calls to admin keys only: a client key
    is refused PERMISSION_DENIED with the reason, at once (nothing polled)."""
    keys, broker = admin_only_broker(processes, tmp_path, "client")
    public = str(keys.broker_public)
    as_client = {"curve_secret_key": str(keys.secret("client")), "broker_public_key": public}
    with (
        make_client(broker.frontend, timeout=TIMEOUT_S, **as_client) as client,
        pytest.raises(PermissionDeniedError, match="needs the admin role"),
    ):
        client.load_model("mlp", 1)
    assert counted(broker, "repository_refused_total", reason="PERMISSION_DENIED") == 1
    assert counted(broker, "repository_commands_total") == 0
    as_admin = {"curve_secret_key": str(keys.secret("admin")), "broker_public_key": public}
    with make_client(broker.frontend, timeout=TIMEOUT_S, **as_admin) as admin:
        assert len(admin.repository_index()) == 0  # answered: no repository worker yet
    assert counted(broker, "repository_commands_total", action="index") == 1


# ---------------------------------------------------------------- a scripted broker


@pytest.fixture
def broker() -> Iterator[FakeBroker]:
    with scripted_broker() as fake:
        yield fake


def test_requests_for_other_versions_never_share_a_group(broker: FakeBroker) -> None:
    """Which requests the client packs into one group is seen only by the socket that
    receives them: a real broker answers each right either way (the real fabric's test
    above checks the answers), so the rows are read here, on a scripted broker. The
    requests are sent from a done-callback, on the client's I/O thread, so that they
    leave in one turn of its loop: runs of one version, as groups where they may."""
    versions = ("1", "1", "2", "2") * 2
    with Client(broker.address, timeout=10, config=FAST) as client:
        client.models()  # the broker's group advice known
        x = inputs(1)
        fanned_out: Future[list[Future[Any]]] = Future()
        first = client.infer_async("add", x)
        first.add_done_callback(
            lambda _f: fanned_out.set_result(
                [client.infer_async("add", x, version=v) for v in versions]
            )
        )
        futures = fanned_out.result(10)
        assert all(f.result(10)["y"].shape == (2, 3) for f in futures)
    rows = broker.rows  # those of REQUESTS messages: the first went alone, as a REQUEST
    assert [len(row.group) for row in rows] == [2, 2, 2, 2]
    assert [{m.version for m in row.members()} for row in rows] == [{"1"}, {"2"}] * 2


# ---------------------------------------------------------------- a plain worker


def test_a_real_worker_answers_a_request_with_or_without_a_version(processes: Processes) -> None:
    """Through a real broker and worker: the version travels, the result is numpy's,
    and the reply names version "1" (a worker given a model file) once the broker says."""
    broker = start_broker(processes)
    start_worker(processes, broker)
    rng = np.random.default_rng(5)
    x, y = (rng.standard_normal((3, 8)).astype(np.float32) for _ in range(2))
    with Client(broker.frontend, timeout=20, config=FAST) as client:
        for version in (None, "1"):
            outputs = client.infer("add", {"x": x, "y": y}, version=version)
            np.testing.assert_allclose(outputs["z"], x + 2 * y, rtol=1e-6)
            assert outputs.version in (None, "1")
