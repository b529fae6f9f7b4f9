"""The protocol-neutral front door: what both the HTTP and the gRPC door call.

The doors parse their wire into an :class:`InferRequest` of :class:`Tensor` (numpy
arrays, views of the received bytes where the wire allows) and render what comes back;
everything else is here: model metadata (from the :class:`~gateway.catalog.Catalog`),
checking a request against the model before anything reaches a broker, the call through
one :class:`~ipuserve.client.AsyncClient`, and the statistics. Errors are ipuserve's
(:mod:`ipuserve.errors`); :mod:`gateway.status` maps them to each door's status.

Every model version the fabric lists is its own catalog entry: a request naming a
version goes to it, one naming none to the model's default
(:meth:`~gateway.catalog.Catalog.default_version`), and every response says which
version answered (the fabric's reply says; ``model_version``). The model repository
extension (load, unload, index) is :mod:`gateway.repository`'s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass

from ipuserve import protocol as wire
from ipuserve._version import __version__
from ipuserve.client import AsyncClient
from ipuserve.errors import InvalidInputError, UnavailableError, UnknownModelError
from ipuserve.gateway.catalog import Catalog
from ipuserve.gateway.metrics import GatewayMetrics
from ipuserve.gateway.repository import ModelRepository
from ipuserve.gateway.stats import Duration, ModelStatistics, Snapshot, Statistics
from ipuserve.gateway.tensors import Tensor, clip, shown, to_datatype

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


def check_request(meta: ModelMetadata, request: InferRequest) -> None:
    """Raise :class:`InvalidInputError` unless the request's inputs are the model's
    (names, datatypes, shapes; -1 any size >= 1, the same across inputs) and its
    requested outputs exist."""
    where = f"model {shown(meta.name)}"
    want = {t.name: t for t in meta.inputs}
    given = [t.name for t in request.inputs]
    unknown = [n for n in given if n not in want]
    if unknown:
        raise InvalidInputError(
            f"{where} has no input {', '.join(map(shown, unknown[:3]))} (inputs: {', '.join(want)})"
        )
    missing = [n for n in want if n not in given]
    if missing or len(set(given)) != len(given):
        what = f"missing: {', '.join(missing)}" if missing else "an input given twice"
        raise InvalidInputError(f"{where} needs inputs {', '.join(want)} ({what})")
    batch: set[int] = set()
    for tensor in request.inputs:
        batch |= _check_tensor(where, want[tensor.name], tensor)
    if len(batch) > 1:
        raise InvalidInputError(f"inputs of {where} disagree on the batch size: {sorted(batch)}")
    if request.outputs is not None:
        outputs = [t.name for t in meta.outputs]
        bad = [n for n in request.outputs if n not in outputs]
        if bad:
            raise InvalidInputError(
                f"{where} has no output {', '.join(map(shown, bad[:3]))} "
                f"(outputs: {', '.join(outputs)})"
            )


def _check_tensor(where: str, want: TensorMetadata, got: Tensor) -> set[int]:
    """The batch size ``got`` carries (empty set: no batching dimension)."""
    name = f"input {shown(got.name)} of {where}"
    if got.datatype != want.datatype:
        raise InvalidInputError(f"{name} must be {want.datatype}, got {got.datatype}")
    fits = len(got.shape) == len(want.shape) and all(
        g == w or (w == -1 and g >= 1) for g, w in zip(got.shape, want.shape, strict=True)
    )
    if not fits:
        raise InvalidInputError(
            f"{name} must have shape {list(want.shape)} (-1: any size >= 1), got {list(got.shape)}"
        )
    return {g for g, w in zip(got.shape, want.shape, strict=True) if w == -1}


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
        """Check ``request`` against the model, run it on the fabric, keep the
        statistics. Raises ipuserve errors."""
        spec = (await self._lookup(request.model, request.version)).spec
        meta = self._metadata_of(spec)
        start = time.perf_counter()
        try:
            check_request(meta, request)
        except InvalidInputError:  # counted as Triton counts a request it rejects
            self.stats.failed(request.model, spec.version, time.perf_counter() - start)
            raise
        try:
            outputs, timing = await self.client.infer_timed(
                request.model,
                {t.name: t.array for t in request.inputs},
                copy=False,
                version=request.version or None,
                **({} if request.timeout_s is None else {"timeout": request.timeout_s}),
            )
        except UnknownModelError as exc:
            self.stats.failed(request.model, spec.version, time.perf_counter() - start)
            await self._refresh_quietly()  # the fabric knows better: our picture is stale
            if self.catalog.get(request.model) is not None:  # served now or lately
                raise UnavailableError(
                    f"{exc}; it was served moments ago (a broker restarting, or its "
                    "workers coming back): try again"
                ) from exc
            raise
        except InvalidInputError:
            self.stats.failed(request.model, spec.version, time.perf_counter() - start)
            await self._refresh_quietly()  # the fabric knows better: our picture is stale
            raise
        except Exception:
            self.stats.failed(request.model, spec.version, time.perf_counter() - start)
            raise
        # the version that answered, as the fabric says (a broker that does not: the
        # one the gateway took for it)
        answered = outputs.version or spec.version
        samples = _samples(meta, request.inputs)
        self.stats.succeeded(request.model, answered, samples, time.perf_counter() - start, timing)
        names = list(outputs) if request.outputs is None else request.outputs
        return InferResponse(
            model=request.model,
            version=answered,
            id=request.id,
            outputs=tuple(Tensor.of(n, outputs[n]) for n in names if n in outputs),  # as asked
        )

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


def _samples(meta: ModelMetadata, inputs: tuple[Tensor, ...]) -> int:
    """Samples a request carries: its size on the batching dimension, else 1."""
    shapes = {t.name: t.shape for t in meta.inputs}
    for tensor in inputs:
        if -1 in shapes[tensor.name]:
            return tensor.shape[shapes[tensor.name].index(-1)]
    return 1
