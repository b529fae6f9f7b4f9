"""Triton's model repository extension and version routing on a real ``ipuserve
gateway``, driven by tritonclient (HTTP and gRPC).

The repository calls run against the client tests' fake broker (a real ZeroMQ ROUTER in
this process) answering REPOSITORY as a broker with repository workers does
(tests/client/fake_broker.py ``ScriptedRepository``): a stand-in until the broker and
host pieces of issue 22 are merged, when the end-to-end version switch runs on the
real fabric. Version routing runs on the real fabric: tests/gateway/test_http.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from ipuserve import protocol as wire
from ipuserve.errors import InvalidInputError
from ipuserve.gateway.repository import versions_of_config
from tests.client.fake_broker import FakeBroker, ScriptedRepository, scripted_broker
from tests.gateway.conftest import (
    GatewayProc,
    gateway_argv,
    started_gateway,
    wait_ready,
)
from tests.helpers import BrokerProc, Processes

pytestmark = pytest.mark.slow

ADMIN = "admin-token-7"


@pytest.fixture
def broker() -> Iterator[FakeBroker]:
    with scripted_broker() as fake:
        yield fake


@pytest.fixture
def repo_gateway(processes: Processes, broker: FakeBroker, tmp_path: Path) -> GatewayProc:
    """A gateway with an admin token in front of the fake broker."""
    tokens = tmp_path / "admin.tokens"
    tokens.write_text(ADMIN + "\n")
    fake = BrokerProc(None, broker.address, "", broker.epoch, None)  # type: ignore[arg-type]
    argv = gateway_argv(fake, "--admin-tokens", str(tokens))
    started = started_gateway(processes.start("gateway", argv), argv)
    wait_ready(started)
    return started


def admin(*, grpc: bool = False) -> dict[str, str]:
    """The admin's bearer token (gRPC metadata keys are lower case)."""
    return {"authorization" if grpc else "Authorization": f"Bearer {ADMIN}"}


def versions(broker: FakeBroker) -> dict[str, str]:
    assert isinstance(broker.repository, ScriptedRepository)
    return {v: s.state for v, s in broker.repository.states.items()}


def test_http_index_load_with_a_version_policy_and_unload(
    repo_gateway: GatewayProc, broker: FakeBroker
) -> None:
    triton = httpclient.InferenceServerClient(repo_gateway.host_port)
    index = triton.get_model_repository_index(headers=admin())
    assert index == [
        {"name": "mlp", "version": "1", "state": "READY", "reason": ""},
        {"name": "mlp", "version": "2", "state": "UNAVAILABLE", "reason": "not loaded"},
    ]
    config = json.dumps({"version_policy": {"specific": {"versions": [2]}}})
    triton.load_model("mlp", headers=admin(), config=config)
    # Triton's meaning: version 2 loaded (and waited for), then the others unloaded
    assert versions(broker) == {"1": "UNAVAILABLE", "2": "READY"}
    actions = [(c.action, c.version) for c in broker.commands if c.action != "index"]
    assert actions == [("load", "2"), ("unload", "1")]
    ready = triton.get_model_repository_index(headers=admin(), query_params=None)
    assert [e["version"] for e in ready if e["state"] == "READY"] == ["2"]
    triton.unload_model("mlp", headers=admin())
    assert versions(broker) == {"1": "UNAVAILABLE", "2": "UNAVAILABLE"}
    triton.close()


def test_grpc_index_load_and_unload(repo_gateway: GatewayProc, broker: FakeBroker) -> None:
    assert repo_gateway.grpc is not None
    with grpcclient.InferenceServerClient(repo_gateway.grpc) as triton:
        index = triton.get_model_repository_index(headers=admin(grpc=True), as_json=True)
        states = {m["version"]: m["state"] for m in index["models"]}
        assert states == {"1": "READY", "2": "UNAVAILABLE"}
        triton.load_model("mlp", headers=admin(grpc=True))  # no config: the latest, 2
        assert versions(broker) == {"1": "READY", "2": "READY"}
        triton.unload_model("mlp", headers=admin(grpc=True))
    assert versions(broker) == {"1": "UNAVAILABLE", "2": "UNAVAILABLE"}
    unloads = [c for c in broker.commands if c.action == "unload"]
    assert [(c.model, c.version) for c in unloads] == [("mlp", None)]


def test_the_repository_needs_an_admin_token(repo_gateway: GatewayProc, broker: FakeBroker) -> None:
    triton = httpclient.InferenceServerClient(repo_gateway.host_port)
    with pytest.raises(InferenceServerException, match="bearer token") as refused:
        triton.load_model("mlp")
    assert refused.value.status() == "401"
    assert repo_gateway.grpc is not None
    with (
        grpcclient.InferenceServerClient(repo_gateway.grpc) as grpc_triton,
        pytest.raises(InferenceServerException) as grpc_refused,
    ):
        grpc_triton.get_model_repository_index(headers={"authorization": "Bearer x"})
    assert grpc_refused.value.status() == "StatusCode.UNAUTHENTICATED"
    assert broker.commands == []  # nothing reached the broker
    triton.close()


@pytest.mark.parametrize(
    "code, http, grpc_code",
    [
        ("PERMISSION_DENIED", "403", "StatusCode.PERMISSION_DENIED"),
        ("NO_ROOM", "503", "StatusCode.UNAVAILABLE"),
        ("UNKNOWN_MODEL", "404", "StatusCode.NOT_FOUND"),
    ],
)
def test_the_brokers_refusals_keep_their_reason_and_map_to_status(
    repo_gateway: GatewayProc, broker: FakeBroker, code: str, http: str, grpc_code: str
) -> None:
    assert isinstance(broker.repository, ScriptedRepository)
    broker.repository.refusal = wire.ErrorReply(b"", code, f"because {code.lower()}")
    triton = httpclient.InferenceServerClient(repo_gateway.host_port)
    with pytest.raises(InferenceServerException, match=f"because {code.lower()}") as refused:
        triton.get_model_repository_index(headers=admin())
    assert refused.value.status() == http
    triton.close()
    assert repo_gateway.grpc is not None
    with (
        grpcclient.InferenceServerClient(repo_gateway.grpc) as grpc_triton,
        pytest.raises(InferenceServerException) as grpc_refused,
    ):
        grpc_triton.load_model("mlp", headers=admin(grpc=True))
    assert grpc_refused.value.status() == grpc_code
    assert f"because {code.lower()}" in str(grpc_refused.value.message())


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
