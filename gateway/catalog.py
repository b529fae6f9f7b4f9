"""The models the fabric serves, as the gateway last heard: what requests are checked
against before anything reaches a broker.

Refreshed in the background (every ``interval_s`` while a task runs :meth:`Catalog.run`),
on a miss, and when the service asks (the fabric answered UNKNOWN_MODEL or
INVALID_INPUT, so the gateway's picture is stale). Concurrent refreshes share one
question to the fabric, and on-demand ones are spaced by ``min_gap_s`` so a flood of
requests for a model nobody serves cannot turn into a flood of listings.
"""

from __future__ import annotations

import asyncio
import logging
import time

from ipuserve import protocol as wire
from ipuserve.client import AsyncClient
from ipuserve.errors import IpuserveError

log = logging.getLogger(__name__)


class Catalog:
    """Model name -> :class:`~ipuserve.protocol.ModelInfo`, kept fresh."""

    def __init__(
        self,
        client: AsyncClient,
        *,
        interval_s: float = 1.5,
        min_gap_s: float = 0.25,
        ask_timeout_s: float = 5.0,
        keep_gone_s: float = 60.0,
    ) -> None:
        """``keep_gone_s``: how long a model the fabric stopped listing is still known
        (its schema kept, no workers) before it is forgotten."""
        self._client = client
        self._interval_s = interval_s
        self._min_gap_s = min_gap_s
        self._ask_timeout_s = ask_timeout_s
        self._keep_gone_s = keep_gone_s
        self._models: dict[str, wire.ModelInfo] = {}
        #: models the fabric stopped listing, and since when (monotonic seconds)
        self._gone_since: dict[str, float] = {}
        self._refreshing: asyncio.Task[None] | None = None
        self._refreshed_at = -float("inf")
        #: bumped whenever a model's schema, or the set of models, changes
        self.generation = 0

    def get(self, name: str) -> wire.ModelInfo | None:
        return self._models.get(name)

    def names(self) -> list[str]:
        return sorted(self._models)

    async def lookup(self, name: str) -> wire.ModelInfo | None:
        """``name``'s entry, asking the fabric first on a miss."""
        info = self._models.get(name)
        if info is None:
            await self.refresh(eager=False)
            info = self._models.get(name)
        return info

    async def refresh(self, *, eager: bool = True) -> None:
        """Ask the fabric for its models (sharing a question under way). Not ``eager``:
        skip it if the last answer is younger than ``min_gap_s``. Raises what the
        client raised (no broker: UnavailableError / DeadlineExceeded)."""
        if not eager and time.monotonic() - self._refreshed_at < self._min_gap_s:
            return
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self._ask())
            # retrieved even when every waiter was cancelled (no "never retrieved" log)
            self._refreshing.add_done_callback(_retrieve)
        await asyncio.shield(self._refreshing)

    async def _ask(self) -> None:
        models = await self._client.models(timeout=self._ask_timeout_s)
        fresh = {info.spec.name: info for info in models}
        old = {name: info.spec for name, info in self._models.items()}
        # A model listed before and not now keeps its schema for ``keep_gone_s``, with
        # no workers (not ready): a broker just restarted lists nothing until the
        # workers are back, so requests still go to the fabric, and the service tells
        # their callers to come back (503), not that the model does not exist (404).
        now = time.monotonic()
        for name in fresh:
            self._gone_since.pop(name, None)
        for name, spec in old.items():
            if name in fresh:
                continue
            since = self._gone_since.setdefault(name, now)
            if now - since < self._keep_gone_s:
                fresh[name] = wire.ModelInfo(spec, 0, ())
            else:
                del self._gone_since[name]
        if old != {name: info.spec for name, info in fresh.items()}:
            self.generation += 1
            log.info("models now: %s", ", ".join(sorted(fresh)) or "none")
        self._models = fresh
        self._refreshed_at = time.monotonic()

    async def run(self) -> None:
        """Refresh every ``interval_s`` until cancelled; a failed refresh keeps the old
        picture (requests then fail or succeed at the fabric, which is the judge)."""
        while True:
            if any(link.usable for link in self._client.links()):
                try:
                    await self.refresh(eager=False)
                except IpuserveError as exc:
                    log.debug("model refresh failed: %s", exc)
            # until the first answer, look again soon: a gateway just started knows no
            # model, and what does not ask on a miss (statistics) would say so
            heard = self._refreshed_at > -float("inf")
            await asyncio.sleep(self._interval_s if heard else min(0.05, self._interval_s))


def _retrieve(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()
