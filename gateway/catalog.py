"""The models the fabric serves, as the gateway last heard: what requests are checked
against before anything reaches a broker.

Refreshed in the background (every ``interval_s`` while a task runs :meth:`Catalog.run`),
on a miss, and when the service asks (the fabric answered UNKNOWN_MODEL or
INVALID_INPUT, so the gateway's picture is stale). Concurrent refreshes share one
question to the fabric, and on-demand ones are spaced by ``min_gap_s`` so a flood of
requests for a model nobody serves cannot turn into a flood of listings.

One entry per model version (the fabric lists each version as its own model, told
apart by ``spec.version``). A lookup that names no version gets the model's default by
the broker's own rule (:func:`ipuserve.versions.default_key`, applied to the listing:
its workers carry their credit, so a draining version counts as the broker counts it).
Only metadata, readiness and the statistics read it: an inference request that names no
version goes to the broker without one, and the broker picks and checks.
"""

from __future__ import annotations

import asyncio
import logging
import time

from ipuserve import protocol as wire
from ipuserve.client import AsyncClient
from ipuserve.errors import IpuserveError
from ipuserve.versions import default_key, version_order

log = logging.getLogger(__name__)

#: (model name, version): what the fabric routes by
Key = tuple[str, str]


class Catalog:
    """(model name, version) -> :class:`~ipuserve.protocol.ModelInfo`, kept fresh."""

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
        self._models: dict[Key, wire.ModelInfo] = {}
        #: versions the fabric stopped listing, and since when (monotonic seconds)
        self._gone_since: dict[Key, float] = {}
        self._refreshing: asyncio.Task[None] | None = None
        self._refreshed_at = -float("inf")
        #: bumped whenever a model's schema, or the set of models, changes
        self.generation = 0

    def get(self, name: str, version: str | None = None) -> wire.ModelInfo | None:
        """``name`` ``version``'s entry (None: the model's default version)."""
        version = version or self.default_version(name)
        return None if version is None else self._models.get((name, version))

    def names(self) -> list[str]:
        return sorted({name for name, _ in self._models})

    def versions(self, name: str) -> list[str]:
        """The versions of ``name`` listed, oldest first."""
        return sorted((v for n, v in self._models if n == name), key=version_order)

    def default_version(self, name: str) -> str | None:
        """The version a request naming none goes to, by the broker's rule (module
        docstring); None: no version of ``name`` is listed."""
        mine = {key: info for key, info in self._models.items() if key[0] == name}
        specs = {key: info.spec for key, info in mine.items()}
        serving = {key: info.workers for key, info in mine.items()}
        key = default_key(name, specs, serving)
        return None if key is None else key[1]

    async def lookup(self, name: str, version: str | None = None) -> wire.ModelInfo | None:
        """``name`` ``version``'s entry (None: the default), asking the fabric first on
        a miss."""
        info = self.get(name, version)
        if info is None:
            await self.refresh(eager=False)
            info = self.get(name, version)
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
        fresh = {info.spec.key: info for info in models}
        old = {key: info.spec for key, info in self._models.items()}
        # A model listed before and not now keeps its schema for ``keep_gone_s``, with
        # no workers (not ready): a broker just restarted lists nothing until the
        # workers are back, so requests still go to the fabric, and the service tells
        # their callers to come back (503), not that the model does not exist (404).
        now = time.monotonic()
        for key in fresh:
            self._gone_since.pop(key, None)
        for key, spec in old.items():
            if key in fresh:
                continue
            since = self._gone_since.setdefault(key, now)
            if now - since < self._keep_gone_s:
                fresh[key] = wire.ModelInfo(spec, 0, ())
            else:
                del self._gone_since[key]
        if old != {key: info.spec for key, info in fresh.items()}:
            self.generation += 1
            listed = ", ".join(f"{n} v{v}" for n, v in sorted(fresh)) or "none"
            log.info("models now: %s", listed)
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
