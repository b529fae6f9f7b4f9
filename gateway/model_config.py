"""Triton's model configuration of a model version, from what the fabric lists, and the
gRPC health checking protocol's answer.

ipuserve has no Triton ``config.pbtxt``: a model's schema and batching come from the
compiled model, as its workers report them to the brokers. Triton's tools ask for the
configuration anyway (perf_analyzer reads ``max_batch_size`` to tell the batching
dimension from the sample shape, ``input``/``output`` names, and whether
``dynamic_batching`` or ``sequence_batching`` is present; model_analyzer reads the same
and ``instance_group``), so the gateway answers the subset it can state truthfully:

- ``max_batch_size``: the compiled batch when the batching dimension is the first
  (Triton's only batching dimension), then each tensor's ``dims`` leave it out; 0 for a
  model that does not batch, or batches along another dimension (``dims`` then are the
  whole shape, -1 on that dimension);
- ``dynamic_batching``: present (empty) when ``max_batch_size`` > 0, since the fabric
  then groups requests into batches;
- ``instance_group``: one group of kind ``KIND_MODEL`` (the device is the model's own
  business) whose ``count`` is the number of workers serving the version;
- ``version_policy``: ``specific``, the versions workers serve (else the one asked).

One dict in the HTTP door's JSON shape is the source; the gRPC door's message is
parsed from it (:func:`to_proto`), so the two cannot disagree.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format

from ipuserve import protocol as wire
from ipuserve.gateway.proto import inference_pb2 as pb
from ipuserve.gateway.service import PLATFORM, model_metadata_of

#: the instance kind: the device placement is the model's (its worker's IPUs)
KIND = "KIND_MODEL"


def triton_config(info: wire.ModelInfo, versions: tuple[str, ...]) -> dict[str, Any]:
    """The model configuration of ``info``'s version, in the JSON shape of Triton's
    ``GET /v2/models/{m}/config``; ``versions``: the versions workers serve."""
    spec = info.spec
    meta = model_metadata_of(spec)
    batched = spec.batching_dim == 0
    config: dict[str, Any] = {
        "name": spec.name,
        "platform": PLATFORM,
        "backend": PLATFORM,
        "version_policy": {"specific": {"versions": [int(v) for v in versions or meta.versions]}},
        "max_batch_size": spec.batch_size if batched else 0,
        "input": [_tensor(t.name, t.datatype, t.shape, batched) for t in meta.inputs],
        "output": [_tensor(t.name, t.datatype, t.shape, batched) for t in meta.outputs],
        "instance_group": [
            {"name": f"{spec.name}_{spec.version}", "kind": KIND, "count": len(info.workers)}
        ],
    }
    if batched:
        config["dynamic_batching"] = {}
    return config


def _tensor(name: str, datatype: str, shape: tuple[int, ...], batched: bool) -> dict[str, Any]:
    dims = list(shape[1:] if batched else shape)
    return {"name": name, "data_type": f"TYPE_{datatype}", "dims": dims}


def to_proto(config: dict[str, Any]) -> pb.ModelConfigResponse:
    """The gRPC door's ModelConfigResponse for :func:`triton_config`'s dict."""
    response = pb.ModelConfigResponse()
    json_format.ParseDict(config, response.config)
    return response


def health(ready: bool) -> pb.HealthCheckResponse:
    """grpc.health.v1's answer: SERVING once a broker is connected (the gateway can
    serve inferences), NOT_SERVING before."""
    status = pb.HealthCheckResponse.SERVING if ready else pb.HealthCheckResponse.NOT_SERVING
    return pb.HealthCheckResponse(status=status)
