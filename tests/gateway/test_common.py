"""The gateway's protocol-neutral pieces on their own: datatypes, tensors from JSON and
from bytes, the request codec, the status table, the tokens, and the default version
its metadata names."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

from ipuserve import errors
from ipuserve import protocol as wire
from ipuserve.gateway.auth import Tokens, grpc_peer_host
from ipuserve.gateway.catalog import Catalog
from ipuserve.gateway.http_codec import parse_infer, render_infer
from ipuserve.gateway.metrics import GatewayMetrics
from ipuserve.gateway.service import InferResponse
from ipuserve.gateway.status import grpc_status_name, http_status
from ipuserve.gateway.tensors import (
    DATATYPES,
    Tensor,
    from_buffer,
    from_values,
    to_datatype,
    to_dtype,
)
from ipuserve.versions import default_key


def test_every_datatype_maps_both_ways() -> None:
    for datatype, dtype in DATATYPES.items():
        assert to_dtype(datatype) == dtype and dtype.byteorder in "<|="
        assert to_datatype(dtype) == datatype


@pytest.mark.parametrize(
    ("datatype", "message"),
    [
        ("BYTES", "BYTES is not supported: no ipuserve model takes strings"),
        ("FP8", "unknown datatype 'FP8'"),
    ],
)
def test_unsupported_datatypes_are_refused_by_name(datatype: str, message: str) -> None:
    with pytest.raises(errors.InvalidInputError, match=message) as caught:
        to_dtype(datatype)
    assert "FP32" in str(caught.value)  # the supported ones are listed


def test_a_tensor_from_bytes_is_a_read_only_view_without_a_copy() -> None:
    body = np.arange(6, dtype="<i4").tobytes() + b"tail"
    tensor = from_buffer("x", "INT32", [2, 3], memoryview(body)[:24])
    assert tensor.array.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert not tensor.array.flags.writeable
    assert np.shares_memory(tensor.array, np.frombuffer(body, np.uint8))
    with pytest.raises(errors.InvalidInputError, match=r"INT32\[2, 2\] is 16 bytes, got 24"):
        from_buffer("x", "INT32", [2, 2], memoryview(body)[:24])


def _from_json(datatype: str, shape: object, data: object) -> Tensor:
    document = {"inputs": [{"name": "x", "datatype": datatype, "shape": shape, "data": data}]}
    [tensor] = parse_infer(json.dumps(document).encode(), None, "m", None, 1 << 20).request.inputs
    return tensor


def test_a_tensor_from_json_takes_flat_or_nested_lists() -> None:
    flat = _from_json("FP32", [2, 2], [1, 2, 3, 4])
    nested = _from_json("FP32", [2, 2], [[1, 2], [3, 4]])
    np.testing.assert_array_equal(flat.array, nested.array)
    assert flat.array.dtype == np.dtype("<f4") and flat.shape == (2, 2)
    assert _from_json("BOOL", [2], [True, False]).array.tolist() == [True, False]
    for shape, data, message in [
        ([3], [1, 2], "holds 3 elements, data has 2"),
        ([-1], [1], "shape must be a list of integers in"),
        ([1], "abc", "data must be a list"),
        ([2, 2], [[1], [2, 3]], "lists nested as the shape"),
    ]:
        with pytest.raises(errors.InvalidInputError, match=message):
            _from_json("FP32", shape, data)


def test_typed_values_are_counted_before_they_are_converted() -> None:
    assert from_values("x", "INT8", [2], [1, -2]).array.tolist() == [1, -2]
    with pytest.raises(errors.InvalidInputError, match="holds 2 elements, data has 3"):
        from_values("x", "INT8", [2], [1, 2, 3])
    with pytest.raises(errors.InvalidInputError, match="out of INT8's range"):
        from_values("x", "INT8", [2], [1, 300])


def _binary_request(outputs: object = None, **parameters: object) -> tuple[bytes, str]:
    x = np.arange(4, dtype="<f4")
    document = {
        "id": "r1",
        "parameters": parameters,
        "inputs": [
            {
                "name": "a",
                "datatype": "FP32",
                "shape": [1, 4],
                "parameters": {"binary_data_size": 16},
            },
            {"name": "b", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]},
        ],
    }
    if outputs is not None:
        document["outputs"] = outputs
    header = json.dumps(document).encode()
    return header + x.tobytes(), str(len(header))


def test_the_codec_reads_binary_inputs_and_parameters() -> None:
    body, length = _binary_request(timeout=2_500_000, binary_data_output=True)
    parsed = parse_infer(body, length, "m", None, 1 << 20)
    request = parsed.request
    assert request.id == "r1" and request.model == "m" and request.timeout_s == 2.5
    assert [t.name for t in request.inputs] == ["a", "b"]
    assert request.inputs[0].array.tolist() == [[0, 1, 2, 3]]
    assert request.outputs is None and parsed.binary_default


def test_the_codec_writes_binary_and_json_outputs_as_asked() -> None:
    body, length = _binary_request(
        outputs=[{"name": "y", "parameters": {"binary_data": True}}, {"name": "z"}]
    )
    parsed = parse_infer(body, length, "m", "1", 1 << 20)
    assert parsed.request.outputs == ("y", "z")
    y, z = np.array([[1.5, 2.5]], "<f4"), np.array([[7]], "<i8")
    response = InferResponse("m", "1", "r1", (Tensor.of("y", y), Tensor.of("z", z)))
    payload, headers = render_infer(parsed, response)
    assert headers["Content-Type"] == "application/octet-stream"
    split = int(headers["Inference-Header-Content-Length"])
    document = json.loads(payload[:split])
    assert document["id"] == "r1" and document["model_version"] == "1"
    assert document["outputs"][0] == {
        "name": "y",
        "datatype": "FP32",
        "shape": [1, 2],
        "parameters": {"binary_data_size": 8},
    }
    assert document["outputs"][1]["data"] == [7]
    assert np.frombuffer(payload[split:], "<f4").tolist() == [1.5, 2.5]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda b, n: (b[:-1], n), "does not fit"),
        (lambda b, n: (b + b"x", n), "1 bytes of binary data follow"),
        (lambda b, n: (b, "-3"), "must be a byte count within the body"),
        (lambda b, n: (b, str(len(b) + 1)), "must be a byte count within the body"),
    ],
    ids=["short", "long", "negative-header", "header-past-the-end"],
)
def test_the_codec_refuses_sizes_that_do_not_add_up(change: object, message: str) -> None:
    body, length = _binary_request()
    body, length = change(body, length)  # type: ignore[operator]
    with pytest.raises(errors.RequestError, match=message):
        parse_infer(body, length, "m", None, 1 << 20)


def test_the_status_table() -> None:
    cases = {
        errors.UnauthenticatedError("x"): (401, "UNAUTHENTICATED"),
        errors.UnknownModelError("x"): (404, "NOT_FOUND"),
        errors.InvalidInputError("x"): (400, "INVALID_ARGUMENT"),
        errors.RequestError("x"): (400, "INVALID_ARGUMENT"),
        errors.PayloadTooLargeError("x"): (413, "RESOURCE_EXHAUSTED"),
        errors.OverloadedError("x"): (503, "UNAVAILABLE"),
        errors.BrokerShutdownError("x"): (503, "UNAVAILABLE"),
        errors.WorkerFailedError("x"): (503, "UNAVAILABLE"),
        errors.DeadlineExceeded("x"): (504, "DEADLINE_EXCEEDED"),
        errors.InferenceError("x"): (500, "INTERNAL"),
        errors.DeviceError("x"): (500, "INTERNAL"),
        ValueError("x"): (500, "INTERNAL"),
    }
    for exc, (http, grpc) in cases.items():
        assert (http_status(exc), grpc_status_name(exc)) == (http, grpc), exc
    assert errors.error_for_code("UNAUTHENTICATED", "m").__class__ is errors.UnauthenticatedError


def test_tokens_say_what_is_wrong_and_count_refusals(tmp_path: Path) -> None:
    infer, admin = tmp_path / "infer", tmp_path / "admin"
    infer.write_text("# comment\n\n  tok-1  \ntok-2\n")
    admin.write_text("boss\n")
    metrics = GatewayMetrics()
    tokens = Tokens.from_files(infer=infer, admin=admin, refusals=metrics.token_refusals)
    tokens.check("Bearer tok-1", "infer", door="http")
    tokens.check("bearer tok-2", "infer", door="http")
    tokens.check("Bearer boss", "infer", door="http")  # an admin may infer
    tokens.check("Bearer boss", "admin", door="http")
    for header, role, message in [
        (None, "infer", "missing Authorization header"),
        ("Basic abc", "infer", "not a bearer token"),
        ("Bearer ", "infer", "not a bearer token"),
        ("Bearer tok-3", "infer", "unknown bearer token for the infer role"),
        ("Bearer \udcff\udcfe", "infer", "unknown bearer token"),  # undecodable bytes
        ("Bearer \xff\xfe", "admin", "unknown bearer token for the admin role"),
    ]:
        with pytest.raises(errors.UnauthenticatedError, match=message):
            tokens.check(header, role, door="grpc")
    with pytest.raises(errors.PermissionDeniedError, match="this infer token may not make admin"):
        tokens.check("Bearer tok-1", "admin", door="grpc")  # known, but not an admin's
    assert tokens.refused == 7
    refusals = "ipuserve_gateway_token_refusals_total"
    assert metrics.value(refusals, door="grpc") == 7
    assert metrics.value(refusals, door="http") == 0


def test_roles_close_by_default(tmp_path: Path) -> None:
    """No tokens: infer open, admin on loopback only; some tokens: a role no token
    passes is closed, naming the option that would open it."""
    none = Tokens.none()
    none.check(None, "infer", door="http", peer="192.0.2.7")
    for loopback in ("127.0.0.1", "::1", "::ffff:127.0.0.1"):
        none.check(None, "admin", door="http", peer=loopback)
    for remote in ("192.0.2.7", "::ffff:192.0.2.7", None, "not-an-address"):
        with pytest.raises(errors.PermissionDeniedError, match="loopback peers only"):
            none.check(None, "admin", door="http", peer=remote)
    infer = tmp_path / "infer"
    infer.write_text("tok\n")
    infer_only = Tokens.from_files(infer=infer)
    for header in (None, "Bearer tok", "Bearer nope"):
        with pytest.raises(errors.PermissionDeniedError, match=r"no admin tokens .*--admin-tokens"):
            infer_only.check(header, "admin", door="http", peer="127.0.0.1")
    admin_only = Tokens.from_files(admin=infer)
    admin_only.check("Bearer tok", "infer", door="http")  # an admin may infer
    with pytest.raises(errors.UnauthenticatedError):
        admin_only.check(None, "infer", door="http", peer="127.0.0.1")
    assert "admin closed" in infer_only.describe()
    assert none.describe().startswith("no tokens")


def test_grpc_peer_strings() -> None:
    assert grpc_peer_host("ipv4:127.0.0.1:5000") == "127.0.0.1"
    assert grpc_peer_host("ipv6:[::1]:5000") == "::1"
    assert grpc_peer_host("unix:/tmp/x") is None
    assert grpc_peer_host(None) is None


def test_a_token_file_without_tokens_is_a_config_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    with pytest.raises(errors.ConfigError, match="holds no token"):
        Tokens.from_files(infer=empty)
    with pytest.raises(errors.ConfigError, match="cannot read token file"):
        Tokens.from_files(infer=tmp_path / "missing")


class _Listing:
    """What the catalog asks of its client: the fabric's MODELS listing."""

    def __init__(self, models: list[wire.ModelInfo]) -> None:
        self.listed = models

    async def models(self, *, timeout: float | None = None) -> list[wire.ModelInfo]:
        return self.listed


def _info(version: str, *credits: int, pin: str | None = None) -> wire.ModelInfo:
    tensor = wire.TensorSpec("x", "float32", (4,))
    spec = wire.ModelSpec("m", (tensor,), (tensor,), version=version, default_version=pin)
    workers = tuple(wire.WorkerLoad(f"w{version}-{i}", c, 0, 0) for i, c in enumerate(credits))
    return wire.ModelInfo(spec, 0, workers)


@pytest.mark.parametrize(
    ("listing", "default"),
    [
        # version 3 drains (credit 0): requests stop going to it, its pin with it
        ([_info("1", 2), _info("2", 2), _info("3", 0, pin="3")], "2"),
        # the newest served version's pin counts, not an older one's
        ([_info("1", 2, pin="1"), _info("2", 2)], "2"),
        ([_info("1", 2), _info("2", 2, pin="1")], "1"),
        # every version draining: they count; none served: the latest known
        ([_info("1", 0), _info("2", 0)], "2"),
        ([_info("1"), _info("2"), _info("10")], "10"),
    ],
)
def test_the_metadata_names_the_default_the_broker_routes_to(
    listing: list[wire.ModelInfo], default: str
) -> None:
    """The gateway's catalog applies the broker's rule (ipuserve/versions.py) to the
    broker's listing: the cases where the gateway's old rule of its own disagreed."""
    catalog = Catalog(cast(Any, _Listing(listing)))
    asyncio.run(catalog.refresh())
    specs = {info.spec.key: info.spec for info in listing}
    serving = {info.spec.key: info.workers for info in listing}
    assert catalog.default_version("m") == default
    assert default_key("m", specs, serving) == ("m", default)
    info = catalog.get("m")
    assert info is not None and info.spec.version == default
