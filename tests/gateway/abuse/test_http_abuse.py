"""The HTTP door against a hostile or careless client, one body at a time: each case's
answer (status and what the message names), what it cost the gateway's memory and
descriptors, and that an honest probe and an honest infer client beside it kept being
served (:mod:`tests.gateway.abuse.watch`). Raw sockets, so the bytes are the test's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from tests.gateway.abuse import payloads as p
from tests.gateway.abuse.watch import Watch
from tests.gateway.conftest import GatewayProc

pytestmark = pytest.mark.slow

INFER = "/v2/models/mlp/infer"
#: what the mlp's [1, 64] FP32 input declares
DECLARED = 64 * 4
#: the longest refusal message a client may be sent
MESSAGE_LIMIT = 1000


@dataclass(frozen=True)
class Case:
    name: str
    request: Callable[[], tuple[bytes, bytes]]  # (head, body)
    status: int | tuple[int, ...]
    says: str  # a fragment of the message, lower case
    declared: int = DECLARED


def _infer(body: bytes, *headers: str, path: str = INFER) -> Callable[[], tuple[bytes, bytes]]:
    return lambda: (p.post(path, *headers), body)


def _lazy(build: Callable[[], bytes], *headers: str) -> Callable[[], tuple[bytes, bytes]]:
    return lambda: (p.post(INFER, *headers), build())


def _binary_lie() -> tuple[bytes, bytes]:
    header, body = p.binary_lie()
    return p.post(INFER, f"Inference-Header-Content-Length: {len(header)}"), body


def _gzip_binary_lie() -> tuple[bytes, bytes]:
    header, body = p.gzip_binary_lie(40 * p.MIB)
    length = f"Inference-Header-Content-Length: {len(header)}"
    return p.post(INFER, length, "Content-Encoding: gzip"), body


GZIP = "Content-Encoding: gzip"
ONE = [1, p.FEATURES]
ZEROS = "[" + ",".join(["0"] * p.FEATURES) + "]"

CASES = [
    Case("nested-json-gzip-60MiB", _lazy(p.nested_gzip_bomb, GZIP), 413, "compression bomb"),
    Case("flat-json-60MiB", _lazy(p.flat_list), 413, "--max-json-bytes"),
    Case("nested-json-12MiB", _lazy(p.nested_list), 400, "input"),
    Case("binary-size-lie-60MiB", _binary_lie, 400, "binary_data_size"),
    Case("gzip-binary-size-lie-40MiB", _gzip_binary_lie, 400, "binary_data_size"),
    Case("gzip-bomb-1GiB", _lazy(p.gzip_bomb, GZIP), 413, "compression bomb"),
    Case("not-gzip", _infer(b"this is not gzip", GZIP), 400, "gzip"),
    Case("json-100000-deep", _lazy(p.deep_json), 400, ""),
    Case("shape-65-dims", _infer(p.infer_json(ZEROS, [1] * 64 + [p.FEATURES])), 400, "shape"),
    Case("shape-2**70", _infer(p.infer_json("[]", [0, 2**70])), 400, "shape"),
    Case("shape-negative", _infer(p.infer_json(ZEROS, [-1, p.FEATURES])), 400, "shape"),
    Case("fp32-null", _infer(p.infer_json(ZEROS.replace("0", "null", 1), ONE)), 400, "input"),
    Case("fp32-string", _infer(p.infer_json(ZEROS.replace("0", '"0.5"', 1), ONE)), 400, "input"),
    Case("fp32-true", _infer(p.infer_json(ZEROS.replace("0", "true", 1), ONE)), 400, "input"),
    Case(
        "header-length-underscore",
        _infer(p.infer_json(ZEROS, ONE), "Inference-Header-Content-Length: 1_12"),
        400,
        "inference-header-content-length",
    ),
    Case(
        "version-arabic-digit",
        _infer(p.infer_json(ZEROS, ONE), path="/v2/models/mlp/versions/%D9%A1/infer"),
        400,
        "version",
    ),
    Case(
        "priority",
        _infer(p.infer_json(ZEROS, ONE, extra=',"parameters":{"priority":1}')),
        400,
        "priority",
    ),
    Case(
        "sequence-id",
        _infer(p.infer_json(ZEROS, ONE, extra=',"parameters":{"sequence_id":7}')),
        400,
        "sequence",
    ),
    Case("not-json", _infer(b"\xff\xfe{{{"), 400, "json"),
    Case("inputs-not-a-list", _infer(b'{"inputs": {"a": 1}}'), 400, "inputs"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_an_abusive_body_is_refused_at_its_cost(
    case: Case, target: GatewayProc, watch: Watch
) -> None:
    host, port = target.host_port.rsplit(":", 1)
    head, body = case.request()
    with watch.case(case.name, case.declared):
        answer = p.exchange(host, int(port), head, body)
    statuses = case.status if isinstance(case.status, tuple) else (case.status,)
    assert answer.status in statuses, (answer.status, answer.body[:300])
    message = answer.error()
    assert len(message) <= MESSAGE_LIMIT, message[:300]
    assert case.says in message.lower(), message
    assert "/" + "tmp" not in message and "Traceback" not in message, message


def test_the_server_header_names_ipuserve_only(target: GatewayProc) -> None:
    host, port = target.host_port.rsplit(":", 1)
    answer = p.exchange(host, int(port), b"GET /v2/health/live HTTP/1.1\r\nHost: gateway")
    assert answer.status == 200
    assert answer.headers.get("server") == "ipuserve", answer.headers
