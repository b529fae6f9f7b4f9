"""Triton's model repository extension, over the fabric's repository commands.

Both doors call :class:`ModelRepository` (HTTP ``POST /v2/repository/index``,
``/v2/repository/models/{name}/load`` and ``/unload``; gRPC ``RepositoryIndex``,
``RepositoryModelLoad`` and ``RepositoryModelUnload``), with an ``admin`` token when
tokens are configured. The gateway's :class:`~ipuserve.client.AsyncClient` asks the
brokers, so it needs the admin role there too: with CURVE, the gateway's key must be
in the broker's ``--admin-keys`` folder; in protected mode, a gateway on the broker's
host is an admin already (docs/gateway.md, docs/repository.md).

Triton's meanings, kept:

* **load** with a model config whose ``version_policy`` names versions
  (``{"specific": {"versions": [2]}}``; also ``{"latest": {"num_versions": N}}`` and
  ``{"all": {}}``) makes exactly those versions served: it loads each that is not READY
  and, once they are, unloads the model's other versions. Without a config it loads
  the latest version of the repository, unless it is READY already. Either way the
  call returns once the versions are READY (or raises why not).
* **unload** unloads every version of the model and returns once they are gone; a
  model in the repository with nothing loaded is unloaded already (no error).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from ipuserve.client import AsyncClient, RepositoryIndex
from ipuserve.errors import InvalidInputError
from ipuserve.gateway.catalog import Catalog
from ipuserve.limits import version_problem

__all__ = ["IndexEntry", "ModelRepository", "versions_of_config"]

_HOSTED = ("READY", "LOADING", "UNLOADING")


@dataclass(frozen=True)
class IndexEntry:
    """One row of Triton's repository index."""

    name: str
    version: str
    state: str
    reason: str

    def to_json(self) -> dict[str, str]:
        return dataclasses.asdict(self)


class ModelRepository:
    """The repository extension's three calls; see the module docstring."""

    def __init__(self, client: AsyncClient, catalog: Catalog) -> None:
        self._client = client
        self._catalog = catalog

    async def index(self, *, ready: bool = False) -> list[IndexEntry]:
        """Every version in the workers' repositories (``ready``: the READY ones only)."""
        found = await self._client.repository_index()
        return [
            IndexEntry(v.name, v.version, v.state, v.reason)
            for v in sorted(found, key=lambda v: (v.name, int(v.version)))
            if not ready or v.state == "READY"
        ]

    async def load(self, name: str, config: str | None = None) -> None:
        """Load ``name`` as Triton does (module docstring); ``config``: the model config
        JSON a client sent (``parameters.config``), or None."""
        found = await self._client.repository_index()
        listed = [v.version for v in found.versions(name)]
        wanted = versions_of_config(config, listed)
        if wanted is None:
            if not listed or found.versions(name)[-1].state != "READY":
                await self._client.load_model(name)
        else:
            for version in wanted:
                now = found.find(name, version)
                if now is None or now.state != "READY":
                    await self._client.load_model(name, version)
            for other in found.versions(name):
                if other.version not in wanted and other.state in _HOSTED:
                    await self._client.unload_model(name, other.version)
        await self._refresh()

    async def unload(self, name: str) -> None:
        """Unload every version of ``name`` and wait until they are gone."""
        found = await self._client.repository_index()
        if _listed_but_not_hosted(found, name):
            return
        await self._client.unload_model(name)
        await self._refresh()

    async def _refresh(self) -> None:
        """The catalog learns the change at once: requests for a version just loaded go
        to it without waiting for the next background refresh."""
        try:
            await self._catalog.refresh()
        except Exception:  # the next background refresh will do
            pass


def _listed_but_not_hosted(found: RepositoryIndex, name: str) -> bool:
    versions = found.versions(name)
    return bool(versions) and not any(v.state in _HOSTED for v in versions)


def versions_of_config(config: str | None, listed: list[str]) -> list[str] | None:
    """The versions a Triton model config's ``version_policy`` names, among ``listed``
    (the repository's, oldest first); None: the config names none (no config, or no
    policy). :class:`InvalidInputError` for a config that is not such JSON."""
    if not config:
        return None
    try:
        parsed: Any = json.loads(config)
    except json.JSONDecodeError as exc:
        raise InvalidInputError(f"the model config is not JSON: {exc}") from None
    policy = parsed.get("version_policy") if isinstance(parsed, dict) else None
    if policy is None:
        return None
    if not isinstance(policy, dict) or len(policy) != 1:
        raise InvalidInputError(
            "version_policy must be one of {'specific': {'versions': [...]}}, "
            f"{{'latest': {{'num_versions': N}}}}, {{'all': {{}}}}; got {policy!r}"
        )
    ((kind, value),) = policy.items()
    if kind == "all":
        return list(listed)
    if kind == "latest":
        count = value.get("num_versions", 1) if isinstance(value, dict) else None
        if not isinstance(count, int) or count < 1:
            raise InvalidInputError(f"version_policy latest needs num_versions >= 1, got {value!r}")
        return listed[-count:]
    versions = value.get("versions") if kind == "specific" and isinstance(value, dict) else None
    if not isinstance(versions, list) or not versions:
        raise InvalidInputError(f"version_policy {kind!r}: not one this gateway knows: {policy}")
    return [_version(v) for v in versions]


def _version(value: Any) -> str:
    text = str(value) if type(value) is int else value  # JSON's 2, or "2"; never true
    if (problem := version_problem(text)) is not None:
        raise InvalidInputError(f"a version in version_policy {problem}")
    return str(text)
