"""gateway/proto: the checked-in protoc output matches the .proto, and our messages are
the specification's on the wire while sharing a process with tritonclient's."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf.descriptor import Descriptor

from ipuserve.gateway.proto import inference_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ("inference_pb2.py", "inference_pb2.pyi")


@pytest.mark.skipif(
    importlib.util.find_spec("grpc_tools") is None,
    reason="grpcio-tools (the dev extra) is not installed: cannot regenerate",
)
def test_checked_in_output_is_what_the_proto_generates(tmp_path: Path) -> None:
    subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)],
        check=True,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    for name in GENERATED:
        fresh = (tmp_path / name).read_text()
        checked_in = (ROOT / "gateway" / "proto" / name).read_text()
        assert fresh == checked_in, f"gateway/proto/{name} is stale: run scripts/gen_proto.sh"


def test_messages_live_in_their_own_package() -> None:
    """Not `inference`: tritonclient registers that package in the same global pool."""
    assert pb.DESCRIPTOR.package == "ipuserve.oip"
    assert pb.DESCRIPTOR.name == "ipuserve/oip/inference.proto"


# ---------------------------------------------------------------- against tritonclient


@pytest.fixture(scope="module")
def triton_pb() -> object:
    """tritonclient's messages, imported in the same process as ours: the import itself
    proves the two registries do not collide."""
    service_pb2 = pytest.importorskip("tritonclient.grpc.service_pb2")
    import tritonclient.grpc  # noqa: F401  (the client as a user imports it)

    return service_pb2


def _fields(message: Descriptor) -> dict[int, tuple[str, int, bool, str | None]]:
    return {
        f.number: (
            f.name,
            f.type,
            f.is_repeated,
            f.message_type.name if f.message_type is not None else None,
        )
        for f in message.fields
    }


def _walk(message: Descriptor, prefix: str = "") -> dict[str, Descriptor]:
    found = {prefix + message.name: message}
    for nested in message.nested_types:
        found.update(_walk(nested, prefix + message.name + "."))
    return found


#: ours, from gRPC's health checking protocol rather than the inference specification
HEALTH = ("HealthCheckRequest", "HealthCheckResponse")


def test_every_message_has_the_specifications_fields(triton_pb: object) -> None:
    """Each of our fields is the specification's (number, name, type): a message may
    leave out fields the gateway never fills (Triton's ModelConfig has dozens; the
    newest ModelStatistics has response_stats), never change one."""
    config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
    theirs: dict[str, Descriptor] = {}
    for module in (triton_pb, config_pb2):
        for message in module.DESCRIPTOR.message_types_by_name.values():  # type: ignore[attr-defined]
            theirs.update(_walk(message))
    ours: dict[str, Descriptor] = {}
    for message in pb.DESCRIPTOR.message_types_by_name.values():
        if message.name not in HEALTH:
            ours.update(_walk(message))
    assert len(ours) > 20
    for name, message in ours.items():
        assert name in theirs, f"{name} is not a message of the specification"
        mine, spec = _fields(message), _fields(theirs[name])
        assert {n: spec.get(n) for n in mine} == mine, name
    enums = (
        (pb.DataType.DESCRIPTOR, config_pb2.DataType.DESCRIPTOR),
        (pb.ModelInstanceGroup.Kind.DESCRIPTOR, config_pb2.ModelInstanceGroup.Kind.DESCRIPTOR),
    )
    for mine_enum, spec_enum in enums:
        values = {v.name: v.number for v in spec_enum.values}
        assert {v.name: v.number for v in mine_enum.values}.items() <= values.items()


def test_health_messages_are_grpc_health_v1s() -> None:
    """grpc/health/v1/health.proto: HealthCheckRequest.service = 1 (string),
    HealthCheckResponse.status = 1 (enum UNKNOWN 0, SERVING 1, NOT_SERVING 2,
    SERVICE_UNKNOWN 3)."""
    assert _fields(pb.HealthCheckRequest.DESCRIPTOR) == {1: ("service", 9, False, None)}
    assert _fields(pb.HealthCheckResponse.DESCRIPTOR) == {1: ("status", 14, False, None)}
    statuses = pb.HealthCheckResponse.ServingStatus.DESCRIPTOR.values
    assert [(v.name, v.number) for v in statuses] == [
        ("UNKNOWN", 0), ("SERVING", 1), ("NOT_SERVING", 2), ("SERVICE_UNKNOWN", 3)
    ]  # fmt: skip


def test_service_paths_are_the_specifications(triton_pb: object) -> None:
    theirs = triton_pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]  # type: ignore[attr-defined]
    ours = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert theirs.full_name == "inference.GRPCInferenceService"
    for method in ours.methods:
        twin = theirs.methods_by_name[method.name]
        assert method.input_type.name == twin.input_type.name
        assert method.output_type.name == twin.output_type.name


def test_a_request_crosses_byte_for_byte(triton_pb: object) -> None:
    theirs = triton_pb.ModelInferRequest(  # type: ignore[attr-defined]
        model_name="mlp", model_version="1", id="req-7"
    )
    theirs.parameters["timeout"].int64_param = 2_500_000
    tensor = theirs.inputs.add(name="input", datatype="FP32", shape=[2, 3])
    tensor.contents.fp32_contents.extend([1.5, -2.0, 0.0, 3.25, 4.0, 5.0])
    theirs.outputs.add(name="output")
    theirs.raw_input_contents.append(b"\x00\x01\x02")
    wire = theirs.SerializeToString(deterministic=True)

    ours = pb.ModelInferRequest.FromString(wire)
    assert ours.inputs[0].contents.fp32_contents[3] == 3.25
    assert ours.parameters["timeout"].int64_param == 2_500_000
    assert ours.SerializeToString(deterministic=True) == wire


def test_a_response_crosses_byte_for_byte(triton_pb: object) -> None:
    ours = pb.ModelStatisticsResponse()
    stats = ours.model_stats.add(name="mlp", version="1", inference_count=9)
    stats.inference_stats.success.count = 9
    stats.inference_stats.queue.ns = 12345
    infer = pb.ModelInferResponse(model_name="mlp", model_version="1", id="req-7")
    infer.outputs.add(name="output", datatype="INT64", shape=[1])
    infer.raw_output_contents.append((7).to_bytes(8, "little"))
    for message, twin in (
        (ours, triton_pb.ModelStatisticsResponse),  # type: ignore[attr-defined]
        (infer, triton_pb.ModelInferResponse),  # type: ignore[attr-defined]
    ):
        wire = message.SerializeToString(deterministic=True)
        assert twin.FromString(wire).SerializeToString(deterministic=True) == wire
