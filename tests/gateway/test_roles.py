"""Roles close by default: the role matrix, each cell a real call to a real gateway.

Four gateways on loopback (no tokens, infer tokens only, admin tokens only, both), two
doors, three endpoint classes (the health probe; metadata, the class of infer, stats
and metrics; the model repository's admin calls), four credentials (none, an infer
token, an admin token, a token nobody configured). What each cell answers is written
out in :data:`EXPECTED`, so the table is the specification (docs/security.md)."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf.message import Message

from ipuserve.gateway.proto import inference_pb2 as pb
from tests.gateway.conftest import Fabric, GatewayProc, start_gateway, wait_ready

pytestmark = pytest.mark.slow

INFER_TOKEN, ADMIN_TOKEN = "infer-token-1", "admin-token-1"
CREDENTIALS = {"none": None, "infer": INFER_TOKEN, "admin": ADMIN_TOKEN, "wrong": "nobody-s"}
GATEWAYS = ("no-tokens", "infer-only", "admin-only", "both")
ENDPOINTS = ("health", "metadata", "repository")

OK, UNAUTH, DENIED = 200, 401, 403
_ALL_OK = {"none": OK, "infer": OK, "admin": OK, "wrong": OK}
#: (gateway, endpoint) -> credential -> HTTP status (gRPC: OK, UNAUTHENTICATED,
#: PERMISSION_DENIED). A token the gateway was not given is as unknown as a wrong one.
EXPECTED: dict[tuple[str, str], dict[str, int]] = {
    **{(g, "health"): _ALL_OK for g in GATEWAYS},
    ("no-tokens", "metadata"): _ALL_OK,
    ("no-tokens", "repository"): _ALL_OK,  # loopback peers only (test below)
    ("infer-only", "metadata"): {"none": UNAUTH, "infer": OK, "admin": UNAUTH, "wrong": UNAUTH},
    ("infer-only", "repository"): {"none": DENIED, "infer": DENIED, "admin": DENIED,
                                   "wrong": DENIED},  # closed: no admin tokens
    ("admin-only", "metadata"): {"none": UNAUTH, "infer": UNAUTH, "admin": OK, "wrong": UNAUTH},
    ("admin-only", "repository"): {"none": UNAUTH, "infer": UNAUTH, "admin": OK,
                                   "wrong": UNAUTH},
    ("both", "metadata"): {"none": UNAUTH, "infer": OK, "admin": OK, "wrong": UNAUTH},
    ("both", "repository"): {"none": UNAUTH, "infer": DENIED, "admin": OK, "wrong": UNAUTH},
}  # fmt: skip
GRPC_CODES = {OK: grpc.StatusCode.OK, UNAUTH: grpc.StatusCode.UNAUTHENTICATED,
              DENIED: grpc.StatusCode.PERMISSION_DENIED}  # fmt: skip

#: endpoint class -> (HTTP method, path, body), (gRPC method, request)
HTTP_CALLS = {
    "health": ("GET", "/v2/health/live", None),
    "metadata": ("GET", "/v2/models/mlp", None),
    "repository": ("POST", "/v2/repository/index", b"{}"),
}
GRPC_CALLS: dict[str, tuple[str, Message, type[Message]]] = {
    "health": ("/grpc.health.v1.Health/Check", pb.HealthCheckRequest(), pb.HealthCheckResponse),
    "metadata": (
        "/inference.GRPCInferenceService/ModelMetadata",
        pb.ModelMetadataRequest(name="mlp"),
        pb.ModelMetadataResponse,
    ),
    "repository": (
        "/inference.GRPCInferenceService/RepositoryIndex",
        pb.RepositoryIndexRequest(),
        pb.RepositoryIndexResponse,
    ),
}


@pytest.fixture(scope="module")
def gateways(fabric: Fabric, tmp_path_factory: pytest.TempPathFactory) -> dict[str, GatewayProc]:
    folder = tmp_path_factory.mktemp("role-tokens")
    infer, admin = folder / "infer.tokens", folder / "admin.tokens"
    infer.write_text(INFER_TOKEN + "\n")
    admin.write_text(ADMIN_TOKEN + "\n")
    options = {
        "no-tokens": [],
        "infer-only": ["--infer-tokens", str(infer)],
        "admin-only": ["--admin-tokens", str(admin)],
        "both": ["--infer-tokens", str(infer), "--admin-tokens", str(admin)],
    }
    started = {
        kind: start_gateway(fabric.procs, fabric.broker, *args, name=f"gateway-{kind}")
        for kind, args in options.items()
    }
    for gateway in started.values():
        wait_ready(gateway)
    return started


def http_call(url: str, endpoint: str, token: str | None) -> int:
    method, path, body = HTTP_CALLS[endpoint]
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    request = urllib.request.Request(url + path, data=body, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code


def grpc_call(target: str, endpoint: str, token: str | None) -> grpc.StatusCode:
    path, request, response = GRPC_CALLS[endpoint]
    metadata = () if token is None else (("authorization", f"Bearer {token}"),)
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary(
            path,
            request_serializer=_serialize,
            response_deserializer=response.FromString,
        )
        try:
            call(request, metadata=metadata, timeout=60)
        except grpc.RpcError as exc:
            code: grpc.StatusCode = exc.code()
            return code
    return grpc.StatusCode.OK


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()


def _cells() -> Iterator[tuple[str, str, str, str]]:
    for kind in GATEWAYS:
        for door in ("http", "grpc"):
            for endpoint in ENDPOINTS:
                for credential in CREDENTIALS:
                    yield kind, door, endpoint, credential


@pytest.mark.parametrize(("kind", "door", "endpoint", "credential"), list(_cells()))
def test_role_matrix(
    gateways: dict[str, GatewayProc], kind: str, door: str, endpoint: str, credential: str
) -> None:
    gateway, token = gateways[kind], CREDENTIALS[credential]
    want = EXPECTED[kind, endpoint][credential]
    if door == "http":
        assert http_call(gateway.url, endpoint, token) == want
    else:
        assert gateway.grpc is not None
        assert grpc_call(gateway.grpc, endpoint, token) == GRPC_CODES[want]


def test_refusals_say_what_to_configure(gateways: dict[str, GatewayProc]) -> None:
    request = urllib.request.Request(
        gateways["infer-only"].url + "/v2/repository/index", data=b"{}", method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=60)
    with caught.value as answer:
        assert answer.code == 403
        assert "no admin tokens are configured (--admin-tokens)" in answer.read().decode()
    assert "(admin closed)" in gateways["infer-only"].proc.output()
    assert "repository admin calls from loopback only" in gateways["no-tokens"].proc.output()


def test_undecodable_bearer_token_is_401(gateways: dict[str, GatewayProc]) -> None:
    """Bytes that are no UTF-8 text in the header: an unknown token, not a crash."""
    gateway = gateways["both"]
    host, port = gateway.host_port.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(
            b"GET /v2/models/mlp HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n"
            b"Connection: close\r\n\r\n"
        )
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert b"unknown bearer token" in answer


def _non_loopback_address() -> str:
    """This host's address on its default route (a UDP socket's connect sends nothing);
    the test is skipped where there is none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))
        except OSError:
            pytest.skip("no non-loopback IPv4 address to reach the gateway by")
        address: str = probe.getsockname()[0]
    if address.startswith("127."):
        pytest.skip("no non-loopback IPv4 address to reach the gateway by")
    return address


def test_without_tokens_admin_calls_are_for_loopback_only(fabric: Fabric, tmp_path: Path) -> None:
    address = _non_loopback_address()
    gateway = start_gateway(
        fabric.procs, fabric.broker, "--http", "0.0.0.0:0", "--grpc", "0.0.0.0:0",
        "--insecure", name="gateway-open",
    )  # fmt: skip
    wait_ready(gateway)
    assert gateway.grpc is not None
    port, grpc_port = gateway.host_port.rsplit(":", 1)[1], gateway.grpc.rsplit(":", 1)[1]
    remote, remote_grpc = f"http://{address}:{port}", f"{address}:{grpc_port}"
    assert http_call(remote, "metadata", None) == OK
    assert http_call(remote, "repository", None) == DENIED
    assert grpc_call(remote_grpc, "metadata", None) == grpc.StatusCode.OK
    assert grpc_call(remote_grpc, "repository", None) == grpc.StatusCode.PERMISSION_DENIED
    assert http_call(f"http://127.0.0.1:{port}", "repository", None) == OK
    assert grpc_call(f"127.0.0.1:{grpc_port}", "repository", None) == grpc.StatusCode.OK
    gateway.proc.terminate()
    assert gateway.proc.wait() == 0
