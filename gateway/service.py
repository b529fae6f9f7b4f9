"""The protocol-neutral front door: what both the HTTP and the gRPC door call.

The doors parse their wire into an :class:`InferRequest` of :class:`Tensor` (numpy
arrays, views of the received bytes where the wire allows) and render what comes back;
everything else is here: model metadata (from the :class:`~gateway.catalog.Catalog`),
the call through one :class:`~ipuserve.client.AsyncClient`, and the statistics. Errors
are ipuserve's (:mod:`ipuserve.errors`); :mod:`gateway.status` maps them to each door's
status.

The gateway asks the fabric rather than deciding again what the fabric decides: a
request naming a version goes to it, one naming none goes to the broker without one,
and the broker picks the model's default and checks the inputs against that version's
schema (its refusals, UNKNOWN_MODEL and INVALID_INPUT, are 404 and 400); every response
says which version answered (the fabric's reply says; ``model_version``). The gateway
checks only what its own wire can get wrong -- the encoding, the datatypes, each
tensor's bytes against its declared shape (the doors' codecs), an input named twice
(:func:`fabric_inputs`) -- so a request is checked and run against one version.
Metadata names the default by the broker's own rule (:mod:`ipuserve.versions`). The
model repository extension (load, unload, index) is :mod:`gateway.repository`'s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ipuserve import protocol as wire
from ipuserve._version import __version__
from ipuserve.client import AsyncClient
from ipuserve.errors import InvalidInputError, UnavailableError, UnknownModelError
from ipuserve.gateway.catalog import Catalog
from ipuserve.gateway.metrics import GatewayMetrics
from ipuserve.gateway.repository import ModelRepository
from ipuserve.gateway.stats import Duration, ModelStatistics, Snapshot, Statistics
from ipuserve.gateway.tensors import Tensor, clip, shown, to_datatype

Array = np.ndarray[Any, Any]

__all__ = [
    "EXTENSIONS",
    "Duration",
    "InferRequest",
    "InferResponse",
    "InferenceService",
    "ModelMetadata",
    "ModelStatistics",
    "ServerMetadata",
    "TensorMetadata",
]

PLATFORM = "ipuserve"
#: the protocol extensions the gateway supports (docs/gateway.md)
EXTENSIONS = ("binary_tensor_data", "statistics", "model_repository")


@dataclass(frozen=True)
class TensorMetadata:
    """An input or output: -1 on the batching dimension (any size >= 1)."""

    name: str
    datatype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ModelMetadata:
    name: str
    versions: tuple[str, ...]
    platform: str
    inputs: tuple[TensorMetadata, ...]
    outputs: tuple[TensorMetadata, ...]


@dataclass(frozen=True)
class ServerMetadata:
    name: str
    version: str
    extensions: tuple[str, ...]


@dataclass(frozen=True)
class InferRequest:
    model: str
    version: str | None
    id: str | None
    inputs: tuple[Tensor, ...]
    #: the outputs asked for; None: all of them
    outputs: tuple[str, ...] | None
    timeout_s: float | None


@dataclass(frozen=True)
class InferResponse:
    model: str
    version: str
    id: str | None
    outputs: tuple[Tensor, ...]


#: request parameters of Triton's sequence batcher and schedule policy that the fabric
#: does not honour: refused rather than ignored (a client relying on one must know)
UNSUPPORTED_PARAMETERS: dict[str, str] = {
    "sequence_id": "the fabric has no sequence batching",
    "sequence_start": "the fabric has no sequence batching",
    "sequence_end": "the fabric has no sequence batching",
    "priority": "the fabric does not order requests by priority",
}


def check_parameters(parameters: Iterable[tuple[str, object]]) -> None:
    """Refuse (400) a request parameter the fabric does not honour, unless its value
    is the protocol's "none" (0, false or empty, as Triton reads it)."""
    for key, value in parameters:
        why = UNSUPPORTED_PARAMETERS.get(key)
        if why is not None and value:
            raise InvalidInputError(
                f"request parameter {key!r} is not supported by the gateway: {why}"
            )


def _tensor_metadata(spec: wire.TensorSpec, batching_dim: int | None) -> TensorMetadata:
    shape = tuple(-1 if i == batching_dim else n for i, n in enumerate(spec.shape))
    return TensorMetadata(spec.name, to_datatype(spec.dtype), shape)


def model_metadata_of(spec: wire.ModelSpec, versions: tuple[str, ...] = ()) -> ModelMetadata:
    """The protocol's view of a model version's schema; ``versions``: the model's
    (default: the spec's own)."""
    dim = spec.batching_dim
    return ModelMetadata(
        name=spec.name,
        versions=versions or (spec.version,),
        platform=PLATFORM,
        inputs=tuple(_tensor_metadata(t, dim) for t in spec.inputs),
        outputs=tuple(_tensor_metadata(t, dim) for t in spec.outputs),
    )


def fabric_inputs(request: InferRequest) -> dict[str, Array]:
    """The request's inputs as the fabric takes them, ``{name: array}``; raises
    :class:`InvalidInputError` for the one mistake the gateway's wire allows and the
    fabric's cannot carry: an input named twice. The schema -- names, datatypes,
    shapes, the batch size -- is the broker's to check, against the version it runs."""
    inputs = {t.name: t.array for t in request.inputs}
    if len(inputs) != len(request.inputs):
        names = [t.name for t in request.inputs]
        twice = sorted({n for n in names if names.count(n) > 1})
        raise InvalidInputError(
            f"input {', '.join(map(shown, twice))} of model {shown(request.model)} given twice: "
            "name each input once"
        )
    return inputs


class InferenceService:
    """The front door's logic over one :class:`AsyncClient`; see the module docstring.

    Call :meth:`start` in the running loop (the background metadata refresh) and
    :meth:`stop` before closing the client.
    """

    def __init__(
        self,
        client: AsyncClient,
        *,
        refresh_interval_s: float = 1.5,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.client = client
        self.catalog = Catalog(client, interval_s=refresh_interval_s)
        self.repository = ModelRepository(client, self.catalog)
        self.stats = Statistics(metrics)
        self.metrics = self.stats.metrics
        self._refresher: asyncio.Task[None] | None = None
        self._metadata: dict[tuple[str, str], tuple[wire.ModelSpec, ModelMetadata]] = {}

    def start(self) -> None:
        if self._refresher is None:
            self._refresher = asyncio.get_running_loop().create_task(self.catalog.run())

    async def stop(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            await asyncio.gather(self._refresher, return_exceptions=True)
            self._refresher = None

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        """A broker is connected."""
        return any(link.usable for link in self.client.links())

    def server_metadata(self) -> ServerMetadata:
        return ServerMetadata("ipuserve", __version__, EXTENSIONS)

    async def model_metadata(self, name: str, version: str | None = None) -> ModelMetadata:
        """Raises :class:`UnknownModelError` for a model (or version) nobody serves."""
        return self._metadata_of((await self._lookup(name, version)).spec)

    async def model_listing(
        self, name: str, version: str | None = None
    ) -> tuple[wire.ModelInfo, tuple[str, ...]]:
        """``name`` ``version`` as the fabric lists it, and the versions workers serve
        (Triton's model configuration is built from both: gateway/model_config.py)."""
        return await self._lookup(name, version), self._served_versions(name)

    async def _lookup(self, name: str, version: str | None) -> wire.ModelInfo:
        """``name`` ``version`` (None: the default) as the catalog lists it, else
        :class:`UnknownModelError` naming what is served."""
        info = await self.catalog.lookup(name, version or None)
        if info is not None:
            return info
        versions = self.catalog.versions(name)
        if version and versions:
            raise UnknownModelError(
                f"model {shown(name)} has no version {shown(version)} "
                f"(versions: {', '.join(versions)})"
            )
        raise UnknownModelError.nobody_serves(clip(name), ", ".join(self.catalog.names()))

    def _metadata_of(self, spec: wire.ModelSpec) -> ModelMetadata:
        """The metadata of ``spec``'s version, with the versions of its model that
        workers serve (all listed when none is served); cached while neither changes."""
        versions = self._served_versions(spec.name)
        cached = self._metadata.get(spec.key)
        fresh = cached is not None and cached[1].versions == versions
        if cached is None or not fresh or (cached[0] is not spec and cached[0] != spec):
            cached = (spec, model_metadata_of(spec, versions))
        self._metadata[spec.key] = (spec, cached[1])  # the next lookup: one `is`
        return cached[1]

    def _served_versions(self, name: str) -> tuple[str, ...]:
        versions = self.catalog.versions(name)
        served = [v for v in versions if (info := self.catalog.get(name, v)) and info.workers]
        return tuple(served or versions)

    async def model_ready(self, name: str, version: str | None = None) -> bool:
        """A worker serves the model version (as the gateway last heard)."""
        info = await self.catalog.lookup(name, version or None)
        return info is not None and bool(info.workers) and self.ready()

    async def infer(self, request: InferRequest) -> InferResponse:
        """Run ``request`` on the fabric and keep the statistics. A request that names
        no version goes without one: the broker picks the default and checks the
        inputs against that version's schema, and its reply says which version
        answered. Raises ipuserve errors (the broker's refusals as it worded them)."""
        start = time.perf_counter()
        try:
            inputs = fabric_inputs(request)
            outputs, timing = await self.client.infer_timed(
                request.model,
                inputs,
                copy=False,
                version=request.version or None,
                **({} if request.timeout_s is None else {"timeout": request.timeout_s}),
            )
        except UnknownModelError as exc:  # not counted: no version of it to count under
            raise await self._unknown(request, exc) from exc
        except Exception:
            self._failed(request, time.perf_counter() - start)
            raise
        # the version that answered, as the fabric says (a broker that does not: the
        # one asked for, else the default by the listing)
        version = outputs.version or request.version or self.catalog.default_version(request.model)
        version = version or ""
        elapsed = time.perf_counter() - start
        try:
            chosen = _chosen(request, outputs, version)
        except InvalidInputError:
            self.stats.failed(request.model, version, elapsed)
            raise
        samples = await self._samples(request.model, version, request.inputs)
        self.stats.succeeded(request.model, version, samples, elapsed, timing)
        return InferResponse(request.model, version, request.id, chosen)

    def _failed(self, request: InferRequest, elapsed: float) -> None:
        """Count a failed request of a listed model under the version it named, else
        its model's default as last listed (the fabric's refusals do not say which
        version refused; the rule is the broker's, so this is the version it picked).
        A made-up name adds no series."""
        if not self._listed(request.model):
            return
        version = request.version or self.catalog.default_version(request.model)
        if version is not None:
            self.stats.failed(request.model, version, elapsed)

    async def _unknown(self, request: InferRequest, exc: UnknownModelError) -> Exception:
        """What to answer for the fabric's UNKNOWN_MODEL: the fabric's own refusal,
        unless the gateway heard of that model version moments ago -- a broker that
        restarted lists nothing until its workers are back -- when it is a 503 to come
        back to, not a 404. Only then is the fabric asked again (a flood of requests
        for a name nobody serves costs it no listings)."""
        key = (request.model, request.version or None)
        if self.catalog.get(*key) is None:
            return exc
        await self._refresh_quietly()
        if self.catalog.get(*key) is not None:
            return UnavailableError(
                f"{exc}; it was served moments ago (a broker restarting, or its "
                "workers coming back): try again"
            )
        return exc

    async def _samples(self, name: str, version: str, inputs: tuple[Tensor, ...]) -> int:
        """Samples a request carries: its size along the version's batching dimension,
        else 1 (Triton's inference_count). The listing says which dimension that is;
        a version not listed yet (loaded moments ago) is asked for."""
        info = self.catalog.get(name, version) or await self.catalog.lookup(name, version)
        if info is None or info.spec.batching_dim is None:
            return 1
        return info.spec.samples(t.shape for t in inputs)

    async def _refresh_quietly(self) -> None:
        try:
            await self.catalog.refresh()
        except Exception:  # the request's own error is the one to report
            pass

    async def statistics(
        self, name: str | None = None, version: str | None = None
    ) -> list[ModelStatistics]:
        """Every model version's statistics, or one model's (each of its versions), or
        one version's (:class:`UnknownModelError` if the fabric does not know it and the
        gateway never served it). A model the gateway has not looked up yet is asked of
        the fabric first, for HTTP and gRPC alike: a gateway just started must not call
        a served model unknown."""
        counted = self.stats.snapshot()  # every gateway process's counts
        if name:
            served = counted.versions(name)
            if version not in served and not (served and version is None):
                await self._lookup(name, version)
            versions = [version] if version else self._versions_counted(name, counted)
            return [counted.of_version(name, v) for v in versions]
        names = sorted({*self.catalog.names(), *counted.names()})
        return [counted.of_version(n, v) for n in names for v in self._versions_counted(n, counted)]

    def _versions_counted(self, name: str, counted: Snapshot) -> list[str]:
        """The versions of ``name`` listed or served through the gateway (any of its
        processes), oldest first."""
        versions = {*self.catalog.versions(name), *counted.versions(name)}
        return sorted(versions, key=int)

    def answered(self, door: str, model: str, code: str) -> None:
        """Count an inference call ``door`` answered with status ``code`` (the model
        under "" unless the fabric lists it: a made-up name adds no series)."""
        self.metrics.answered(door, model, code, self._listed)

    def _listed(self, name: str) -> bool:
        return bool(self.catalog.versions(name))


def _chosen(
    request: InferRequest, outputs: Mapping[str, Array], version: str
) -> tuple[Tensor, ...]:
    """The outputs the request asked for (all, unless it named some), in its order;
    :class:`InvalidInputError` if it named one the version that answered has not."""
    if request.outputs is None:
        return tuple(Tensor.of(n, a) for n, a in outputs.items())
    missing = [n for n in request.outputs if n not in outputs]
    if missing:
        raise InvalidInputError(
            f"model {request.model!r} version {version} has no output "
            f"{', '.join(map(repr, missing))} (outputs: {', '.join(outputs)})"
        )
    return tuple(Tensor.of(n, outputs[n]) for n in request.outputs)
