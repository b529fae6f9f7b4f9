"""Triton's tools are welcome: tritonclient's get_model_config over both doors answers
Triton's model configuration, whose fields match the model's metadata, and gRPC probes
(grpc.health.v1) are served."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import model_config_pb2
from tritonclient.utils import InferenceServerException

from ipuserve.gateway.proto import inference_pb2 as pb
from tests.gateway.conftest import Fabric, GatewayProc

pytestmark = pytest.mark.slow


def _check_against_metadata(config: dict[str, Any], meta: dict[str, Any]) -> None:
    """What perf_analyzer relies on: with max_batch_size > 0 the metadata's first
    dimension is the batch (-1) and the config's dims are the rest."""
    assert config["name"] == meta["name"]
    assert config["platform"] == meta["platform"] == "ipuserve"
    batched = int(config.get("max_batch_size", 0)) > 0
    for key, tensors in (("input", meta["inputs"]), ("output", meta["outputs"])):
        assert [t["name"] for t in config[key]] == [t["name"] for t in tensors]
        for mine, theirs in zip(config[key], tensors, strict=True):
            assert mine["data_type"] == "TYPE_" + theirs["datatype"]
            shape = [int(n) for n in theirs["shape"]]
            if batched:
                assert shape[0] == -1
                shape = shape[1:]
            assert [int(n) for n in mine["dims"]] == shape
    assert ("dynamic_batching" in config) == batched
    [group] = config["instance_group"]
    assert group["kind"] == "KIND_MODEL" and int(group["count"]) == 1  # one worker each
    versions = config["version_policy"]["specific"]["versions"]
    assert [str(v) for v in versions] == meta["versions"]


@pytest.mark.parametrize("model", ["mlp", "simple"])
def test_get_model_config_over_http(gateway: GatewayProc, fabric: Fabric, model: str) -> None:
    with httpclient.InferenceServerClient(gateway.host_port) as client:
        config = client.get_model_config(model)
        meta = client.get_model_metadata(model)
        assert client.get_model_config(model, model_version="1") == config
    _check_against_metadata(config, meta)
    batch = {"mlp": 16, "simple": 4}[model]
    assert config["max_batch_size"] == batch


@pytest.mark.parametrize("model", ["mlp", "simple"])
def test_get_model_config_over_grpc(gateway: GatewayProc, model: str) -> None:
    assert gateway.grpc is not None
    with grpcclient.InferenceServerClient(gateway.grpc) as client:
        config = client.get_model_config(model, as_json=True)["config"]
        meta = client.get_model_metadata(model, as_json=True)
        message = client.get_model_config(model).config
    _check_against_metadata(config, meta)
    assert message.max_batch_size == {"mlp": 16, "simple": 4}[model]
    assert message.HasField("dynamic_batching")
    names = [model_config_pb2.DataType.Name(t.data_type) for t in message.input]
    assert names == [t["data_type"] for t in config["input"]]


def test_get_model_config_of_an_unknown_model_is_not_found(gateway: GatewayProc) -> None:
    with httpclient.InferenceServerClient(gateway.host_port) as client:
        with pytest.raises(InferenceServerException) as caught:
            client.get_model_config("nope")
        assert caught.value.status() == "404"
        with pytest.raises(InferenceServerException) as caught:
            client.get_model_config("mlp", model_version="7")
        assert caught.value.status() == "404" and "has no version '7'" in caught.value.message()
    assert gateway.grpc is not None
    with grpcclient.InferenceServerClient(gateway.grpc) as client:
        with pytest.raises(InferenceServerException) as caught:
            client.get_model_config("nope")
        assert caught.value.status() == "StatusCode.NOT_FOUND"


def test_grpc_health_check(gateway: GatewayProc) -> None:
    """What Kubernetes' gRPC probe calls: the server's health (service ""), the
    inference service's, and NOT_FOUND for a service not served."""
    assert gateway.grpc is not None
    with grpc.insecure_channel(gateway.grpc) as channel:
        check = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=pb.HealthCheckResponse.FromString,
        )
        for service in ("", "inference.GRPCInferenceService"):
            answer = check(pb.HealthCheckRequest(service=service), timeout=60)
            assert answer.status == pb.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as caught:
            check(pb.HealthCheckRequest(service="no.Such"), timeout=60)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
