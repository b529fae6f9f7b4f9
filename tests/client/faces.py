"""Both faces of the client behind one set of calls, so that a test of the core's
guarantees (exactly once, failover with the same ids, re-sending after a restart)
runs against :class:`Client` and :class:`AsyncClient` alike.

:class:`AsyncFace` runs a real :class:`AsyncClient` on an asyncio event loop of its
own thread and offers Client's calls: ``infer_async`` schedules ``AsyncClient.infer``
on that loop (``run_coroutine_threadsafe``) and returns a ``concurrent.futures``
future of its outputs; ``links()`` and ``stats`` are read on the loop's thread, which
alone touches the client. Nothing is faked: the requests leave from the asyncio
driver's sockets.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from concurrent.futures import Future
from types import TracebackType
from typing import Any, Protocol, TypeVar

import pytest

from ipuserve import protocol as wire
from ipuserve.client import AsyncClient, Client, ClientStats, LinkInfo, RepositoryIndex

T = TypeVar("T")


class Face(Protocol):
    """What the shared tests call."""

    def infer_async(self, model: str, inputs: Mapping[str, Any], **kwargs: Any) -> Future[Any]: ...

    def infer(self, model: str, inputs: Mapping[str, Any], **kwargs: Any) -> Any: ...

    def models(self, **kwargs: Any) -> list[wire.ModelInfo]: ...

    def links(self) -> list[LinkInfo]: ...

    def repository_index(self) -> RepositoryIndex: ...

    def load_model(self, *args: Any, **kwargs: Any) -> RepositoryIndex: ...

    def unload_model(self, *args: Any, **kwargs: Any) -> RepositoryIndex: ...

    @property
    def stats(self) -> ClientStats: ...

    def __enter__(self) -> Face: ...

    def __exit__(self, *exc: object) -> None: ...


class AsyncFace:
    """An :class:`AsyncClient` on an event loop of its own thread, called as a Client."""

    def __init__(self, address: str | Sequence[str], *args: Any, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        # made on the loop, as in a coroutine: it PINGs the brokers from the start
        self.client = self._on_loop(lambda: AsyncClient(address, *args, **kwargs))

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def _on_loop(self, call: Callable[[], T]) -> T:
        async def run() -> T:
            return call()

        return self._run(run()).result(30)

    def infer_async(self, model: str, inputs: Mapping[str, Any], **kwargs: Any) -> Future[Any]:
        return self._run(self.client.infer(model, inputs, **kwargs))

    def infer(self, model: str, inputs: Mapping[str, Any], **kwargs: Any) -> Any:
        return self.infer_async(model, inputs, copy=False, **kwargs).result()

    def models(self, **kwargs: Any) -> list[wire.ModelInfo]:
        return self._run(self.client.models(**kwargs)).result()

    def links(self) -> list[LinkInfo]:
        return self._on_loop(self.client.links)

    def repository_index(self) -> RepositoryIndex:
        return self._awaited(lambda: self.client.repository_index())

    def load_model(self, *args: Any, **kwargs: Any) -> RepositoryIndex:
        return self._awaited(lambda: self.client.load_model(*args, **kwargs))

    def unload_model(self, *args: Any, **kwargs: Any) -> RepositoryIndex:
        return self._awaited(lambda: self.client.unload_model(*args, **kwargs))

    def _awaited(self, call: Callable[[], Awaitable[T]]) -> T:
        """``call()`` made and awaited on the loop (its argument errors raised here)."""

        async def run() -> T:
            return await call()

        return self._run(run()).result()

    @property
    def stats(self) -> ClientStats:
        return self._on_loop(lambda: self.client.stats)

    def close(self) -> None:
        if self._thread.is_alive():
            self._run(self.client.aclose()).result(30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
            self._loop.close()

    def __enter__(self) -> AsyncFace:
        return self

    def __exit__(
        self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None
    ) -> None:
        self.close()


MakeClient = Callable[..., Face]


@pytest.fixture(params=["Client", "AsyncClient"])
def make_client(request: pytest.FixtureRequest) -> MakeClient:
    """``make_client(address, timeout, config=...)``: a Client, or an AsyncClient
    through :class:`AsyncFace` (the test runs once with each)."""
    face: MakeClient = Client if request.param == "Client" else AsyncFace  # type: ignore[assignment]
    return face
