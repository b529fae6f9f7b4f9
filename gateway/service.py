"""The protocol-neutral front door: what both the HTTP and the gRPC door call.

The doors parse their wire into an :class:`InferRequest` of :class:`Tensor` (numpy
arrays, views of the received bytes where the wire allows) and render what comes back;
everything else is here: model metadata (from the :class:`~gateway.catalog.Catalog`),
checking a request against the model before anything reaches a broker, the call through
one :class:`~ipuserve.client.AsyncClient`, and the statistics. Errors are ipuserve's
(:mod:`ipuserve.errors`); :mod:`gateway.status` maps them to each door's status.

Models have one version, ``"1"``, until the fleet has versions (issue 22).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from ipuserve import protocol as wire
from ipuserve._version import __version__
from ipuserve.client import AsyncClient
from ipuserve.errors import InvalidInputError, UnavailableError, UnknownModelError
from ipuserve.gateway.catalog import Catalog
from ipuserve.gateway.stats import Duration, ModelStatistics, Statistics
from ipuserve.gateway.tensors import Tensor, to_datatype

__all__ = [
    "EXTENSIONS",
    "VERSION",
    "Duration",
    "InferRequest",
    "InferResponse",
    "InferenceService",
    "ModelMetadata",
    "ModelStatistics",
    "ServerMetadata",
    "TensorMetadata",
]

#: the one version every model has for now
VERSION = "1"
PLATFORM = "ipuserve"
#: the protocol extensions the gateway supports (docs/gateway.md)
EXTENSIONS = ("binary_tensor_data", "statistics")


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


def _tensor_metadata(spec: wire.TensorSpec, batching_dim: int | None) -> TensorMetadata:
    shape = tuple(-1 if i == batching_dim else n for i, n in enumerate(spec.shape))
    return TensorMetadata(spec.name, to_datatype(spec.dtype), shape)


def model_metadata_of(spec: wire.ModelSpec) -> ModelMetadata:
    """The protocol's view of a model's schema."""
    dim = spec.batching_dim
    return ModelMetadata(
        name=spec.name,
        versions=(VERSION,),
        platform=PLATFORM,
        inputs=tuple(_tensor_metadata(t, dim) for t in spec.inputs),
        outputs=tuple(_tensor_metadata(t, dim) for t in spec.outputs),
    )


def _check_version(name: str, version: str | None) -> None:
    if version not in (None, "", VERSION):
        raise UnknownModelError(f"model {name!r} has no version {version!r} (versions: {VERSION})")


def check_request(meta: ModelMetadata, request: InferRequest) -> None:
    """Raise :class:`InvalidInputError` unless the request's inputs are the model's
    (names, datatypes, shapes; -1 any size >= 1, the same across inputs) and its
    requested outputs exist."""
    where = f"model {meta.name!r}"
    want = {t.name: t for t in meta.inputs}
    given = [t.name for t in request.inputs]
    unknown = [n for n in given if n not in want]
    if unknown:
        raise InvalidInputError(
            f"{where} has no input {', '.join(map(repr, unknown))} (inputs: {', '.join(want)})"
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
                f"{where} has no output {', '.join(map(repr, bad))} (outputs: {', '.join(outputs)})"
            )


def _check_tensor(where: str, want: TensorMetadata, got: Tensor) -> set[int]:
    """The batch size ``got`` carries (empty set: no batching dimension)."""
    name = f"input {got.name!r} of {where}"
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

    def __init__(self, client: AsyncClient, *, refresh_interval_s: float = 1.5) -> None:
        self.client = client
        self.catalog = Catalog(client, interval_s=refresh_interval_s)
        self.stats = Statistics()
        self._refresher: asyncio.Task[None] | None = None
        self._metadata: dict[str, tuple[wire.ModelSpec, ModelMetadata]] = {}

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
        _check_version(name, version)
        info = await self.catalog.lookup(name)
        if info is None:
            raise UnknownModelError.nobody_serves(name, ", ".join(self.catalog.names()))
        return self._metadata_of(info.spec)

    def _metadata_of(self, spec: wire.ModelSpec) -> ModelMetadata:
        cached = self._metadata.get(spec.name)
        if cached is None or (cached[0] is not spec and cached[0] != spec):
            cached = (spec, model_metadata_of(spec))
        self._metadata[spec.name] = (spec, cached[1])  # the next lookup: one `is`
        return cached[1]

    async def model_ready(self, name: str, version: str | None = None) -> bool:
        """A worker serves the model (as the gateway last heard)."""
        try:
            _check_version(name, version)
        except UnknownModelError:
            return False
        info = await self.catalog.lookup(name)
        return info is not None and bool(info.workers) and self.ready()

    async def infer(self, request: InferRequest) -> InferResponse:
        """Check ``request`` against the model, run it on the fabric, keep the
        statistics. Raises ipuserve errors."""
        meta = await self.model_metadata(request.model, request.version)
        check_request(meta, request)
        start = time.perf_counter()
        try:
            outputs, timing = await self.client.infer_timed(
                request.model,
                {t.name: t.array for t in request.inputs},
                copy=False,
                **({} if request.timeout_s is None else {"timeout": request.timeout_s}),
            )
        except UnknownModelError as exc:
            self.stats.failed(request.model, time.perf_counter() - start)
            await self._refresh_quietly()  # the fabric knows better: our picture is stale
            if self.catalog.get(request.model) is not None:  # served now or lately
                raise UnavailableError(
                    f"{exc}; it was served moments ago (a broker restarting, or its "
                    "workers coming back): try again"
                ) from exc
            raise
        except InvalidInputError:
            self.stats.failed(request.model, time.perf_counter() - start)
            await self._refresh_quietly()  # the fabric knows better: our picture is stale
            raise
        except Exception:
            self.stats.failed(request.model, time.perf_counter() - start)
            raise
        samples = _samples(meta, request.inputs)
        self.stats.succeeded(request.model, samples, time.perf_counter() - start, timing)
        names = list(outputs) if request.outputs is None else request.outputs
        return InferResponse(
            model=request.model,
            version=VERSION,
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
        """Every model's statistics, or one's (:class:`UnknownModelError` if the fabric
        does not know it and the gateway never served it). A model the gateway has not
        looked up yet is asked of the fabric first, for HTTP and gRPC alike: a gateway
        just started must not call a served model unknown."""
        if name:
            _check_version(name, version)
            if name not in self.stats.names():
                await self.model_metadata(name, version)
            if self.catalog.get(name) is None and name not in self.stats.names():
                raise UnknownModelError.nobody_serves(name, ", ".join(self.catalog.names()))
            return [self.stats.of(name, VERSION)]
        names = sorted({*self.catalog.names(), *self.stats.names()})
        return [self.stats.of(n, VERSION) for n in names]


def _samples(meta: ModelMetadata, inputs: tuple[Tensor, ...]) -> int:
    """Samples a request carries: its size on the batching dimension, else 1."""
    shapes = {t.name: t.shape for t in meta.inputs}
    for tensor in inputs:
        if -1 in shapes[tensor.name]:
            return tensor.shape[shapes[tensor.name].index(-1)]
    return 1
