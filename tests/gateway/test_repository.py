"""Triton's model repository extension on a real ``ipuserve gateway``, driven by
tritonclient (HTTP and gRPC), on the real fabric: a broker and two repository workers
(``ipuserve worker --repository``, each its own simulated machine of 2 IPUs) over a
repository holding ``mlp`` versions 1 and 2 (other seeds, so numpy tells their answers
apart) and a ``simple`` whose config.toml asks for more IPUs than a host has.

Inference naming a version is checked against the numpy reference of that version's
weights; a load with a version policy unloads the other versions only once the named
ones are READY (the hosts' log time stamps tell the order).

The fabric is the module's; each test leaves nothing loaded (the ``nothing_loaded``
fixture checks before and cleans after). The broker's refusal of a gateway whose key is
not an admin's runs on a CURVE broker of its own. The version policy's parsing is
tested on its own at the end.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from ipuserve.client import Client
from ipuserve.errors import InvalidInputError
from ipuserve.gateway.repository import versions_of_config
from ipuserve.runtime.popef import examples
from ipuserve.runtime.popef.reader import load_model
from tests.gateway.conftest import GatewayProc, start_gateway, wait_ready
from tests.helpers import BrokerProc, Proc, Processes, metric, scrape, start_broker, wait_until
from tests.integration.test_curve import admin_only_broker
from tests.repository import SMALL_MLP, repository_worker_argv, write_version

pytestmark = pytest.mark.slow

Array = np.ndarray[Any, Any]
ADMIN = "admin-token-7"
TIMEOUT_S = 60.0
_HOSTED = ("READY", "LOADING", "UNLOADING")
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
#: ``wide``: an mlp whose input has this many features, by version
WIDE = {"1": 16, "2": 24}


def _small_mlp(features: int) -> tuple[str, ...]:
    return ("--input-size", str(features), "--hidden-size", "32", "--layers", "1")


@dataclass
class RepoFabric:
    broker: BrokerProc
    gateway: GatewayProc
    hosts: list[Proc]
    weights: dict[str, dict[str, Array]]  # mlp's, by version; wide's as "wideV"
    repo: Path

    def reference(self, version: str, x: Array) -> dict[str, Array]:
        return examples.reference("mlp", {"input": x}, self.weights[version])

    def commands(self) -> float:
        """The repository commands the broker answered or refused so far."""
        samples = scrape(self.broker.metrics_url)
        return metric(samples, "ipuserve_broker_repository_commands_total") + metric(
            samples, "ipuserve_broker_repository_refused_total"
        )

    def marks(self) -> list[int]:
        """Where each host's output is now: :meth:`logged` looks after it."""
        return [len(host.lines) for host in self.hosts]

    def logged(self, pattern: str, since: list[int]) -> str:
        """When a host logged ``pattern`` after ``since`` (waiting for the line): its
        log time stamp (the hosts share this machine's clock; milliseconds)."""
        found: list[str] = []

        def seen() -> bool:
            for host, mark in zip(self.hosts, since, strict=True):
                found.extend(line for line in host.lines[mark:] if re.search(pattern, line))
            return bool(found)

        wait_until(seen, timeout=TIMEOUT_S)
        stamp = _STAMP.match(found[0])
        assert stamp is not None, found[0]
        return stamp[1]


@pytest.fixture(scope="module")
def repo_fabric(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RepoFabric]:
    """The module's broker, two repository workers and gateway (with an admin token)."""
    root = tmp_path_factory.mktemp("repository")
    repo = root / "repo"
    write_version(repo, "mlp", "--seed", "1", *SMALL_MLP)
    write_version(repo, "mlp", "--seed", "2", *SMALL_MLP)
    write_version(repo, "simple")
    (repo / "simple" / "config.toml").write_text("replicas = 3\n")  # a host has 2 IPUs
    for version, features in WIDE.items():  # an mlp whose versions differ in schema
        staging = root / f"wide{version}"
        write_version(staging, "mlp", "--seed", version, *_small_mlp(features))
        (repo / "wide").mkdir(exist_ok=True)
        (staging / "mlp" / "1").rename(repo / "wide" / version)
    (repo / "broken" / "1").mkdir(parents=True)  # no model file: a problem with a path
    weights = {
        v: examples.tensor_arrays(load_model([str(repo / "mlp" / v / "mlp.popef")]))
        for v in ("1", "2")
    }
    weights |= {
        f"wide{v}": examples.tensor_arrays(load_model([str(repo / "wide" / v / "mlp.popef")]))
        for v in WIDE
    }
    tokens = root / "admin.tokens"
    tokens.write_text(ADMIN + "\n")
    procs, hosts = Processes(), []
    try:
        broker = start_broker(procs, liveness_ms=3000)  # no host dropped on a busy machine
        for n in (1, 2):
            # Module-scoped: set up before the per-test IPU inventory, so each
            # machine's is given here (its own lock folder: two containers' worth)
            machine = {
                "IPUSERVE_SIM_LOCK_DIR": str(root / f"ipus{n}"),
                "IPUSERVE_SIM_IPUS": "4",
                "IPUSERVE_SIM_TIME_SCALE": os.environ.get("IPUSERVE_TEST_TIME_SCALE", "0"),
            }
            argv = repository_worker_argv([broker.backend], repo, f"host{n}", ipus=2)
            hosts.append(procs.start(f"host{n}", argv, env=machine))
        joined = lambda: metric(scrape(broker.metrics_url), "ipuserve_broker_hosts")  # noqa: E731
        wait_until(lambda: joined() == 2, timeout=TIMEOUT_S)
        gateway = start_gateway(procs, broker, "--admin-tokens", str(tokens))
        wait_ready(gateway)
        yield RepoFabric(broker, gateway, hosts, weights, repo)
    finally:
        procs.close()
        print(f"--- output of the fabric's processes ---\n{procs.output()}")


def _hosted(client: Client) -> list[tuple[str, str]]:
    return [(v.name, v.version) for v in client.repository_index() if v.state in _HOSTED]


@pytest.fixture
def fabric(repo_fabric: RepoFabric) -> Iterator[RepoFabric]:
    """The module's fabric with nothing loaded; whatever a test loaded is unloaded after
    it (straight at the broker, so a failing gateway cannot leave it loaded)."""
    with Client(repo_fabric.broker.frontend, timeout=TIMEOUT_S) as client:
        assert _hosted(client) == [], "a test before left versions loaded"
        try:
            yield repo_fabric
        finally:
            for name in {name for name, _ in _hosted(client)}:
                client.unload_model(name, timeout=TIMEOUT_S)


def admin(*, grpc: bool = False) -> dict[str, str]:
    """The admin's bearer token (gRPC metadata keys are lower case)."""
    return {"authorization" if grpc else "Authorization": f"Bearer {ADMIN}"}


def policy(*versions: int) -> str:
    return json.dumps({"version_policy": {"specific": {"versions": list(versions)}}})


def mlp_states(index: list[dict[str, Any]]) -> dict[str, str]:
    return {m["version"]: m["state"] for m in index if m["name"] == "mlp"}


def x_of(seed: int, rows: int = 3) -> Array:
    return np.random.default_rng(seed).standard_normal((rows, 16)).astype(np.float32)


def http_infer(triton: Any, version: str, x: Array) -> tuple[str, dict[str, Array]]:
    """Infer ``version`` of mlp (naming it); the version the reply names, the outputs."""
    given = httpclient.InferInput("input", list(x.shape), "FP32")
    given.set_data_from_numpy(x)
    result = triton.infer("mlp", [given], model_version=version, headers=admin())
    return answer(result, result.get_response())


def grpc_infer(triton: Any, version: str, x: Array) -> tuple[str, dict[str, Array]]:
    given = grpcclient.InferInput("input", list(x.shape), "FP32")
    given.set_data_from_numpy(x)
    result = triton.infer("mlp", [given], model_version=version, headers=admin(grpc=True))
    return answer(result, result.get_response(as_json=True))


def answer(result: Any, response: dict[str, Any]) -> tuple[str, dict[str, Array]]:
    """The version a tritonclient result names, and its outputs."""
    names = [o["name"] for o in response["outputs"]]
    return response["model_version"], {n: result.as_numpy(n) for n in names}


def assert_answers(fabric: RepoFabric, infer: Any, triton: Any, version: str, seed: int) -> None:
    """Inference naming ``version`` is answered by it, with its weights' results."""
    x = x_of(seed)
    answered, got = infer(triton, version, x)
    assert answered == version
    want = fabric.reference(version, x)
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5)


def test_http_index_load_with_a_version_policy_and_unload(fabric: RepoFabric) -> None:
    triton = httpclient.InferenceServerClient(fabric.gateway.host_port)
    index = triton.get_model_repository_index(headers=admin())
    assert mlp_states(index) == {"1": "UNAVAILABLE", "2": "UNAVAILABLE"}
    assert {m["name"] for m in index} == {"mlp", "simple", "wide", "broken"}

    triton.load_model("mlp", headers=admin(), config=policy(1))
    assert mlp_states(triton.get_model_repository_index(headers=admin())) == {
        "1": "READY",
        "2": "UNAVAILABLE",
    }
    assert triton.is_model_ready("mlp", "1", headers=admin())
    assert not triton.is_model_ready("mlp", "2", headers=admin())
    assert_answers(fabric, http_infer, triton, "1", seed=1)

    # Triton's meaning: version 2 loaded (and waited for), then the others unloaded
    since = fabric.marks()
    triton.load_model("mlp", headers=admin(), config=policy(2))
    ready = fabric.logged(r"mlp version 2 is READY", since)
    assert ready <= fabric.logged(r"unloading mlp version 1: draining", since)
    assert mlp_states(triton.get_model_repository_index(headers=admin())) == {
        "1": "UNAVAILABLE",
        "2": "READY",
    }
    assert triton.is_model_ready("mlp", "2", headers=admin())
    assert not triton.is_model_ready("mlp", "1", headers=admin())
    assert_answers(fabric, http_infer, triton, "2", seed=2)

    triton.unload_model("mlp", headers=admin())
    index = triton.get_model_repository_index(headers=admin())
    assert mlp_states(index) == {"1": "UNAVAILABLE", "2": "UNAVAILABLE"}
    assert not triton.is_model_ready("mlp", "2", headers=admin())
    triton.close()


def test_grpc_index_load_and_unload(fabric: RepoFabric) -> None:
    assert fabric.gateway.grpc is not None
    with grpcclient.InferenceServerClient(fabric.gateway.grpc) as triton:
        index = triton.get_model_repository_index(headers=admin(grpc=True), as_json=True)
        assert mlp_states(index["models"]) == {"1": "UNAVAILABLE", "2": "UNAVAILABLE"}

        triton.load_model("mlp", headers=admin(grpc=True))  # no config: the latest, 2
        index = triton.get_model_repository_index(headers=admin(grpc=True), as_json=True)
        assert mlp_states(index["models"]) == {"1": "UNAVAILABLE", "2": "READY"}
        assert triton.is_model_ready("mlp", "2", headers=admin(grpc=True))
        assert not triton.is_model_ready("mlp", "1", headers=admin(grpc=True))
        assert_answers(fabric, grpc_infer, triton, "2", seed=3)

        triton.load_model("mlp", headers=admin(grpc=True), config=policy(1, 2))  # both
        index = triton.get_model_repository_index(headers=admin(grpc=True), as_json=True)
        assert mlp_states(index["models"]) == {"1": "READY", "2": "READY"}
        assert_answers(fabric, grpc_infer, triton, "1", seed=4)
        assert_answers(fabric, grpc_infer, triton, "2", seed=5)

        triton.unload_model("mlp", headers=admin(grpc=True))
        index = triton.get_model_repository_index(headers=admin(grpc=True), as_json=True)
        assert mlp_states(index["models"]) == {"1": "UNAVAILABLE", "2": "UNAVAILABLE"}
        assert not triton.is_model_ready("mlp", "1", headers=admin(grpc=True))


def wide_x(version: str, seed: int, rows: int = 3) -> Array:
    """Rows of ``wide`` version ``version``'s input."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, WIDE[version])).astype(np.float32)


def wide_infer(triton: Any, x: Array, version: str = "") -> tuple[str, dict[str, Array]]:
    """Infer ``wide`` over HTTP (``version`` "": naming none); the version the reply
    names, the outputs."""
    given = httpclient.InferInput("input", list(x.shape), "FP32")
    given.set_data_from_numpy(x)
    result = triton.infer("wide", [given], model_version=version, headers=admin())
    return answer(result, result.get_response())


def assert_wide_default(fabric: RepoFabric, triton: Any, version: str, seed: int) -> None:
    """A request naming no version, shaped for ``version``, is run by it: the reply
    says so and the numbers are its weights' (numpy)."""
    x = wide_x(version, seed)
    answered, got = wide_infer(triton, x)
    assert answered == version
    want = examples.reference("mlp", {"input": x}, fabric.weights[f"wide{version}"])
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5)


def wide_success_and_fail(triton: Any) -> dict[str, tuple[int, int]]:
    """``wide``'s statistics: (successes, failures) by version."""
    stats = triton.get_inference_statistics("wide", headers=admin())["model_stats"]
    return {
        s["version"]: (
            s["inference_stats"]["success"]["count"],
            s["inference_stats"]["fail"]["count"],
        )
        for s in stats
    }


def test_a_request_naming_no_version_is_checked_and_run_by_the_brokers_default(
    fabric: RepoFabric,
) -> None:
    """The broker picks the default and checks against it, so a request naming no
    version is checked and run by one version, and the metadata names that one too
    (one rule, ipuserve/versions.py): wide's versions differ in schema (16 and 24
    input features), so a check against the other version would be seen."""
    triton = httpclient.InferenceServerClient(fabric.gateway.host_port)
    triton.load_model("wide", headers=admin(), config=policy(1))
    assert_wide_default(fabric, triton, "1", seed=1)
    triton.load_model("wide", headers=admin(), config=policy(1, 2))
    # at once, whatever the gateway listed last: the broker picks the latest served
    assert_wide_default(fabric, triton, "2", seed=2)

    # the metadata follows the same rule, once the gateway's listing has version 2
    def metadata_says_2() -> bool:
        meta = triton.get_model_metadata("wide", headers=admin())
        return meta["versions"] == ["1", "2"] and meta["inputs"][0]["shape"] == [-1, 24]

    wait_until(metadata_says_2, timeout=TIMEOUT_S)
    # version 1's shape naming no version: refused by the broker against version 2
    with pytest.raises(InferenceServerException) as refused:
        wide_infer(triton, wide_x("1", seed=3))
    assert refused.value.status() == "400"
    assert (
        "input 'input' of model 'wide' must have shape (16, 24) (dimension 0 may be any "
        "size >= 1), got (3, 16)" in str(refused.value.message())
    )
    answered, got = wide_infer(triton, x := wide_x("1", seed=4), version="1")  # named: served
    assert answered == "1"
    want = examples.reference("mlp", {"input": x}, fabric.weights["wide1"])
    np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-4, atol=1e-5)
    # counted under the version that answered; the refusal under the default
    assert wide_success_and_fail(triton) == {"1": (2, 0), "2": (1, 1)}
    triton.close()


def test_the_index_names_no_path_of_the_workers_machine(fabric: RepoFabric) -> None:
    """A broken entry's reason names its files relative to the repository's root."""
    roots = {str(fabric.repo), str(fabric.repo.resolve())}
    triton = httpclient.InferenceServerClient(fabric.gateway.host_port)
    index = triton.get_model_repository_index(headers=admin())
    triton.close()
    assert fabric.gateway.grpc is not None
    with grpcclient.InferenceServerClient(fabric.gateway.grpc) as grpc_triton:
        grpc_index = grpc_triton.get_model_repository_index(headers=admin(grpc=True), as_json=True)
    for entries in (index, grpc_index["models"]):
        [broken] = [m for m in entries if m["name"] == "broken"]
        assert broken["reason"] == "no .popef file in broken/1", broken
        assert not any(root in json.dumps(entries) for root in roots)


def test_the_repository_needs_an_admin_token(fabric: RepoFabric) -> None:
    before = fabric.commands()
    triton = httpclient.InferenceServerClient(fabric.gateway.host_port)
    with pytest.raises(InferenceServerException, match="bearer token") as refused:
        triton.load_model("mlp")
    assert refused.value.status() == "401"
    triton.close()
    assert fabric.gateway.grpc is not None
    with (
        grpcclient.InferenceServerClient(fabric.gateway.grpc) as grpc_triton,
        pytest.raises(InferenceServerException) as grpc_refused,
    ):
        grpc_triton.get_model_repository_index(headers={"authorization": "Bearer x"})
    assert grpc_refused.value.status() == "StatusCode.UNAUTHENTICATED"
    assert fabric.commands() == before  # nothing reached the broker


@pytest.mark.parametrize(
    "model, http, grpc_code, reason",
    [
        ("nope", "404", "StatusCode.NOT_FOUND", "no worker's repository holds model 'nope'"),
        ("simple", "503", "StatusCode.UNAVAILABLE", "model 'simple' version 1 wants 1 more"),
    ],
)
def test_the_brokers_refusals_keep_their_reason_and_map_to_status(
    fabric: RepoFabric, model: str, http: str, grpc_code: str, reason: str
) -> None:
    triton = httpclient.InferenceServerClient(fabric.gateway.host_port)
    with pytest.raises(InferenceServerException, match=reason) as refused:
        triton.load_model(model, headers=admin())
    assert refused.value.status() == http
    triton.close()
    assert fabric.gateway.grpc is not None
    with (
        grpcclient.InferenceServerClient(fabric.gateway.grpc) as grpc_triton,
        pytest.raises(InferenceServerException) as grpc_refused,
    ):
        grpc_triton.load_model(model, headers=admin(grpc=True))
    assert grpc_refused.value.status() == grpc_code
    assert reason in str(grpc_refused.value.message())


def test_a_gateway_whose_key_is_not_an_admins_is_refused_by_the_broker(
    processes: Processes, tmp_path: Path
) -> None:
    keys, broker = admin_only_broker(processes, tmp_path, "gateway")
    gateway = start_gateway(processes, broker, *keys.peer_options("gateway"))
    wait_ready(gateway)
    reason = "needs the admin role"
    triton = httpclient.InferenceServerClient(gateway.host_port)
    with pytest.raises(InferenceServerException, match=reason) as refused:
        triton.get_model_repository_index()
    assert refused.value.status() == "403"
    triton.close()
    assert gateway.grpc is not None
    with (
        grpcclient.InferenceServerClient(gateway.grpc) as grpc_triton,
        pytest.raises(InferenceServerException) as grpc_refused,
    ):
        grpc_triton.load_model("mlp")
    assert grpc_refused.value.status() == "StatusCode.PERMISSION_DENIED"
    assert reason in str(grpc_refused.value.message())


# ---------------------------------------------------------------- the version policy


@pytest.mark.parametrize(
    "config, wanted",
    [
        (None, None),
        ("{}", None),
        ('{"version_policy": {"specific": {"versions": [3, "1"]}}}', ["3", "1"]),
        ('{"version_policy": {"latest": {"num_versions": 2}}}', ["2", "3"]),
        ('{"version_policy": {"all": {}}}', ["1", "2", "3"]),
    ],
)
def test_a_version_policy_names_the_versions_to_serve(
    config: str | None, wanted: list[str] | None
) -> None:
    assert versions_of_config(config, ["1", "2", "3"]) == wanted


@pytest.mark.parametrize(
    "config",
    [
        "not json",
        '{"version_policy": {"specific": {"versions": ["v2"]}}}',
        '{"version_policy": {"newest": {}}}',
        '{"version_policy": {"latest": {"num_versions": 0}}}',
    ],
)
def test_a_bad_version_policy_is_refused_with_why(config: str) -> None:
    with pytest.raises(InvalidInputError):
        versions_of_config(config, ["1"])
