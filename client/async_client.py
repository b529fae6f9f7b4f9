"""The asyncio face of the client: ``await client.infer(...)``.

::

    async with AsyncClient("tcp://broker:5555", timeout=10) as client:
        outputs = await client.infer("mlp", {"input": batch})
        outputs, timing = await client.infer_timed("mlp", {"input": batch})
        for model in await client.models():
            print(model.spec.name)

It takes what :class:`~ipuserve.client.Client` takes (one endpoint or several,
discovery, CURVE keys, a :class:`ClientConfig`) and raises the same errors
(:mod:`ipuserve.errors`). Results are read-only views of the received frames.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

import zmq

from ipuserve import protocol as wire
from ipuserve.client.client import _DEFAULT, Client
from ipuserve.client.config import ClientConfig, ClientStats
from ipuserve.client.core import LinkInfo
from ipuserve.client.pending import Arrays
from ipuserve.client.timing import Timing
from ipuserve.security import KeySource


class AsyncClient:
    """An asyncio client of one broker or several; see the module's docstring."""

    def __init__(
        self,
        address: str | Sequence[str],
        timeout: float | None = 30.0,
        *,
        config: ClientConfig | None = None,
        context: zmq.Context[Any] | None = None,
        curve_secret_key: KeySource | None = None,
        broker_public_key: KeySource | None = None,
    ) -> None:
        self._client = Client(
            address,
            timeout,
            config=config,
            context=context,
            curve_secret_key=curve_secret_key,
            broker_public_key=broker_public_key,
        )
        self.address = self._client.address
        self.timeout = self._client.timeout

    async def infer(
        self,
        model: str,
        inputs: Mapping[str, Any],
        *,
        timeout: float | None = _DEFAULT,
        copy: bool = True,
    ) -> Arrays:
        """One request's outputs, ``{output name: read-only array}``. ``copy=False``
        sends the arrays as they are: they must not change until this returns."""
        outputs, _ = await self.infer_timed(model, inputs, timeout=timeout, copy=copy)
        return outputs

    async def infer_timed(
        self,
        model: str,
        inputs: Mapping[str, Any],
        *,
        timeout: float | None = _DEFAULT,
        copy: bool = True,
    ) -> tuple[Arrays, Timing]:
        """:meth:`infer`, and where the request's time went."""
        future = self._client.infer_async(model, inputs, timeout=timeout, copy=copy)
        outputs = await asyncio.wrap_future(future)
        assert future.timing is not None
        return outputs, future.timing

    async def models(self, *, timeout: float | None = _DEFAULT) -> list[wire.ModelInfo]:
        """The fleet's models, as :meth:`Client.models` lists them."""
        return await asyncio.to_thread(self._client.models, timeout=timeout)

    def links(self) -> list[LinkInfo]:
        """The client's brokers and whether each is usable now."""
        return self._client.links()

    @property
    def stats(self) -> ClientStats:
        return self._client.stats

    async def aclose(self) -> None:
        """Fail pending requests with :class:`ClosedError` and let the brokers go."""
        self._client.close()

    def close(self) -> None:
        self._client.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"AsyncClient({self.address!r}, timeout={self.timeout})"
