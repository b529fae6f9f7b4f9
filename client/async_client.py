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

The same core as :class:`~ipuserve.client.Client` (:mod:`ipuserve.client.core`:
re-sending with the same ids, failover, each request settled once), driven by the
event loop instead of an I/O thread (:mod:`ipuserve.client.async_loop`): the client
belongs to the event loop it is first used on, and its methods must be called there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from types import TracebackType
from typing import TypeVar, Unpack

from ipuserve import protocol as wire
from ipuserve.client.async_loop import AsyncLoop
from ipuserve.client.base import CLIENT_TIMEOUT, ClientBase, ClientSetup, Inputs, RequestOptions
from ipuserve.client.fleet import merge_models
from ipuserve.client.pending import Outputs, Pending, parse_models, parse_reply
from ipuserve.client.repository import Pause, RepositoryIndex, Stepper, Steps
from ipuserve.client.timing import Timing
from ipuserve.errors import IpuserveError

T = TypeVar("T")


class AsyncClient(ClientBase[AsyncLoop, Awaitable[RepositoryIndex]]):
    """An asyncio client of one broker or several; see the module's docstring.

    The model repository's calls (``repository_index``, ``load_model``,
    ``unload_model``) are :class:`~ipuserve.client.Client`'s, awaited: they check
    their arguments when called and return an awaitable of the index."""

    def _start(self, setup: ClientSetup) -> AsyncLoop:
        return AsyncLoop(setup.endpoints, setup.connect, setup.config, follow=setup.follow)

    async def infer(self, model: str, inputs: Inputs, **options: Unpack[RequestOptions]) -> Outputs:
        """One request's outputs, ``{output name: read-only array}``, whose ``version``
        says which model version answered (:class:`~ipuserve.client.Outputs`). ``timeout``
        (seconds; ``None`` waits for ever) defaults to the client's; ``copy=False`` sends
        the arrays as they are: they must not change until this returns; ``version``: that
        version of the model, None its default (:class:`~ipuserve.client.RequestOptions`)."""
        outputs, _ = await self.infer_timed(model, inputs, **options)
        return outputs

    async def infer_timed(
        self, model: str, inputs: Inputs, **options: Unpack[RequestOptions]
    ) -> tuple[Outputs, Timing]:
        """:meth:`infer`, and where the request's time went."""
        message, timeout = self._new_request(model, inputs, options)
        future: asyncio.Future[Outputs] = asyncio.get_running_loop().create_future()
        pending = Pending(message, future, timeout, parse_reply)
        self._io.submit(pending)
        outputs = await self._wait(future, timeout)
        assert pending.timing is not None
        return outputs, pending.timing

    async def models(self, *, timeout: float | None = CLIENT_TIMEOUT) -> list[wire.ModelInfo]:
        """The fleet's models, as :meth:`Client.models` lists them: with several
        brokers each model once, each worker once, its numbers added up over its
        brokers; the brokers that do not answer in time are left out (the first's
        error when none does)."""
        timeout = self._call_timeout(timeout)
        if not self._io.follows:
            return await self._ask_models(None, timeout)
        endpoints = [info.endpoint for info in self.links()]
        answers = await asyncio.gather(
            *(self._ask_models(e, timeout) for e in endpoints), return_exceptions=True
        )
        found: dict[str, list[wire.ModelInfo]] = {}
        for endpoint, answer in zip(endpoints, answers, strict=True):
            if isinstance(answer, BaseException):
                if not isinstance(answer, IpuserveError):
                    raise answer
            else:
                found[endpoint] = answer
        if not found:
            raise next(a for a in answers if isinstance(a, IpuserveError))
        return [model.info() for model in merge_models(found)]

    async def _ask_models(self, to: str | None, timeout: float | None) -> list[wire.ModelInfo]:
        """A LIST_MODELS (``to``: that broker only, never moved to another)."""
        future: asyncio.Future[list[wire.ModelInfo]] = asyncio.get_running_loop().create_future()
        message = wire.ListModels(next(self._ids).to_bytes(8, "little"))
        self._io.submit(Pending(message, future, timeout, parse_models), to=to)
        return await self._wait(future, timeout)

    def _walk(self, steps: Steps) -> Awaitable[RepositoryIndex]:
        return self._walk_async(Stepper(steps))

    async def _walk_async(self, stepper: Stepper) -> RepositoryIndex:
        """The repository calls' steps, awaited (ClientBase)."""
        step = stepper.next(None)
        while step is not None:
            if isinstance(step, Pause):
                await asyncio.sleep(step.seconds)
                step = stepper.next(None)
                continue
            future: asyncio.Future[RepositoryIndex] = asyncio.get_running_loop().create_future()
            self._io.submit(self._repository_pending(step, future))
            answer: RepositoryIndex = await self._wait(future, self.timeout)
            step = stepper.next(answer)
        assert stepper.result is not None
        return stepper.result

    async def _wait(self, future: asyncio.Future[T], timeout: float | None) -> T:
        """The future's result. No timer of its own: the core fails the request at its
        deadline on this same event loop (a client's I/O thread can be blocked by a
        done-callback, which is why :class:`Client` keeps a backstop; here, a loop
        that is blocked runs no timer either)."""
        del timeout
        return await future

    async def aclose(self) -> None:
        """Fail pending requests with :class:`ClosedError` and let the brokers go."""
        self._closer()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None
    ) -> None:
        await self.aclose()
