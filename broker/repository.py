"""The model repository's control plane at the broker: hosts' reports, the index, an
admin's load and unload, and placing again what a dead host held.

The workers hold the truth: each repository worker (a *host*, :mod:`ipuserve.broker.
hosts`) reports what its repository has and what it hosts, and this broker derives
its index from those reports and from its own registry (which versions have a
worker now). A load is placed on hosts with room, least loaded first; the broker
sends them LOAD and answers at once with the index (the caller waits for READY by
asking ``index`` again). When a host dies, the versions it held whose wanted number
of workers the hosts left no longer meet are placed again on hosts with room, or
listed UNAVAILABLE saying why. docs/repository.md has the states and how several
brokers agree.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec

from ipuserve import protocol as wire
from ipuserve.broker.backlog import Backlog
from ipuserve.broker.hosts import HostView, fitting
from ipuserve.broker.metrics import BrokerMetrics
from ipuserve.broker.registry import Registry, Worker
from ipuserve.errors import (
    IpuserveError,
    NoRoomError,
    PermissionDeniedError,
    UnknownModelError,
)
from ipuserve.protocol.control import State
from ipuserve.versions import Key, latest, version_order

log = logging.getLogger(__name__)

#: Room kept in a REPOSITORY_REPLY's header for its message and the JSON around the list.
_REPLY_SLACK = 8 << 10

#: Why a host was dropped, when its versions are to be placed again at once: it died
#: (silent, unreachable). One that left (BYE) took its versions with it on purpose.
DEATHS = frozenset({"silent", "unreachable"})
#: Why a host was dropped when it registered again at once (a new connection under its
#: id, or this one again): a reconnect keeps its versions, a restart loses them, and
#: only its next report tells which, so what it held is compared with that report.
RETURNS = frozenset({"restarted", "re-registered"})
NOT_LOADED = "not loaded"


class RepositoryControl:
    """Hosts' reports, and the REPOSITORY commands and re-placement they serve."""

    def __init__(self, registry: Registry, backlog: Backlog, metrics: BrokerMetrics) -> None:
        self._registry = registry
        self._backlog = backlog
        self._metrics = metrics
        self.hosts: dict[bytes, HostView] = {}
        #: versions whose holders died and that could not be placed again: why
        self.lost: dict[Key, str] = {}
        #: hosts dropped as they registered again, by id, until their next report
        self._returning: dict[str, HostView] = {}
        #: versions a host reported gone after UNLOADING, until one is hosted again: the
        #: host's report may come before the BYE of the version's last worker
        self._unloaded: set[Key] = set()

    # ------------------------------------------------------------ hosts

    def on_host(self, worker: Worker, report: wire.Host) -> None:
        """A host's report: kept (it replaces the last), what it holds no longer lost."""
        host = self.hosts.get(worker.identity)
        if host is None or host.worker is not worker:
            host = self.hosts[worker.identity] = HostView(worker, report)
            log.info(
                "repository worker %s: %d of %d IPU(s) free, %d entr(ies), %d hosted",
                worker.worker_id,
                report.free_ipus,
                report.ipus,
                len(report.repository),
                len(report.hosted),
            )
        now_hosted = {(h.name, h.version) for h in report.hosted}
        gone = {k for k in host.hosted() if host.state_name(k) == "UNLOADING"} - now_hosted
        host.heard(report)
        self._unloaded = (self._unloaded | gone) - now_hosted
        for key in now_hosted:
            self.lost.pop(key, None)
        self._metrics.hosts.set(len(self.hosts))
        before = self._returning.pop(worker.worker_id, None)
        if before is not None:  # what it held before it came back and holds no longer
            self._replace_all(before, lambda key: not host.holds(key))

    def unloading(self, key: Key) -> bool:
        """Whether ``key`` is being (or was just) unloaded: this broker told a host to,
        or a host reported it UNLOADING (another broker did), or gone after that."""
        if key in self._unloaded:
            return True
        return any(h.state_name(key) == "UNLOADING" for h in self.hosts.values())

    def worker_gone(self, worker: Worker, reason: str) -> None:
        """A worker was dropped: if it was a host that died, place again what it held."""
        host = self.hosts.get(worker.identity)
        if host is None or host.worker is not worker:
            return
        del self.hosts[worker.identity]
        self._metrics.hosts.set(len(self.hosts))
        if reason in DEATHS:
            self._replace_all(host, lambda _key: True)
        elif reason in RETURNS:
            self._returning[host.worker_id] = host

    def _replace_all(self, host: HostView, lost: Callable[[Key], bool]) -> None:
        for key, (replicas, wanted) in sorted(host.placed().items()):
            if lost(key):
                self._replace(key, replicas, wanted, host.worker_id)

    def _replace(self, key: Key, replicas: int, wanted: int, dead: str) -> None:
        holders = [h for h in self.hosts.values() if h.holds(key)]
        need = wanted - len(holders)
        if need <= 0:
            return
        room, why_not = fitting(list(self.hosts.values()), key, replicas)
        chosen = room[:need]
        for host, ipus in chosen:
            self._load(host, key, ipus, wanted, "replacement")
        if chosen:
            log.warning(
                "repository worker %s lost model %r version %s: placed again on %s",
                dead,
                *key,
                ", ".join(h.worker_id for h, _ in chosen),
            )
        if not holders and not chosen:
            why = "; ".join(why_not) or "no other worker's repository has it"
            self.lost[key] = f"its workers left and no worker has room: {why}"
            log.error("model %r version %s is UNAVAILABLE: %s", *key, self.lost[key])

    def _load(self, host: HostView, key: Key, replicas: int, wanted: int, why: str) -> None:
        self._unloaded.discard(key)
        load = wire.Load(key[0], key[1], replicas, wanted)
        if self._backlog.to_worker(host.worker.identity, load.encode()):
            host.loading[key] = load
            host.unloading.discard(key)
            self._metrics.loads_sent.labels(why).inc()

    # ------------------------------------------------------------ commands

    def command(self, message: wire.RepositoryCommand, admin: bool) -> wire.RepositoryReply:
        """Answer an admin's command with the index after it; IpuserveError (counted
        by its code) for a refusal."""
        try:
            if not admin:
                raise PermissionDeniedError(
                    f"repository {message.action} needs the admin role: this client's key "
                    "is not in the broker's admin allow-list (docs/security.md)"
                )
            said = self._act(message)
        except IpuserveError as exc:
            self._metrics.repository_refused.labels(exc.code).inc()
            log.warning("repository %s refused: %s", message.action, exc)
            raise
        self._metrics.repository_commands.labels(message.action).inc()
        models, said = _fitting(self.index(), said)
        return wire.RepositoryReply(message.request_id, models, said)

    def _act(self, message: wire.RepositoryCommand) -> str:
        if message.action == "load":
            assert message.model is not None  # the decoder checked it
            return self._load_command(message.model, message)
        if message.action == "unload":
            assert message.model is not None
            return self._unload_command(message.model, message.version)
        return ""

    def _load_command(self, name: str, message: wire.RepositoryCommand) -> str:
        versions = self._in_repositories(name)
        if not versions:
            raise UnknownModelError(
                f"no worker's repository holds model {name!r} (they hold: "
                f"{self._repository_listing() or 'nothing'}); add it with `ipuserve model "
                "example ... --repository REPO --version V`, or check the name"
            )
        version = message.version or latest(versions)
        assert version is not None
        if version not in versions:
            raise UnknownModelError(
                f"no worker's repository holds version {version} of model {name!r} "
                f"(versions: {', '.join(sorted(versions, key=version_order))})"
            )
        key = (name, version)
        wanted = message.workers or self._default_workers(key)
        holders = [h for h in self.hosts.values() if h.holds(key)]
        need = wanted - len(holders)
        self.lost.pop(key, None)
        if need <= 0:
            on = ", ".join(h.worker_id for h in holders)
            return f"model {name!r} version {version} is loaded (or loading) on {on} already"
        room, why_not = fitting(list(self.hosts.values()), key, message.replicas)
        if len(room) < need:
            has = ", ".join(h.worker_id for h, _ in room) or "none"
            raise NoRoomError(
                f"model {name!r} version {version} wants {need} more worker(s); "
                f"{len(room)} ha(s) room ({has}); the others: {'; '.join(why_not) or 'none'}"
            )
        chosen = room[:need]
        for host, replicas in chosen:
            self._load(host, key, replicas, wanted, "command")
        on = ", ".join(f"{h.worker_id} ({n} replica(s))" for h, n in chosen)
        return f"loading model {name!r} version {version} on {on}"

    def _default_workers(self, key: Key) -> int:
        """The workers a load of ``key`` wants when the command says not: its config's
        ``workers`` as the repositories report it (the most any of them says)."""
        entries = [e for h in self.hosts.values() if (e := h.entry(key)) is not None]
        return max((e.workers for e in entries), default=1)

    def _unload_command(self, name: str, version: str | None) -> str:
        targets = [
            (host, key)
            for host in self.hosts.values()
            for key in [*host.hosted(), *host.loading]
            if key[0] == name and version in (None, key[1]) and key not in host.unloading
        ]
        if not targets:
            return self._nothing_to_unload(name, version)
        for host, key in targets:
            if self._backlog.to_worker(host.worker.identity, wire.Unload(*key).encode()):
                host.unloading.add(key)
                host.loading.pop(key, None)
                self.lost.pop(key, None)
        return "unloading " + ", ".join(
            f"model {k[0]!r} version {k[1]} on {h.worker_id}" for h, k in targets
        )

    def _nothing_to_unload(self, name: str, version: str | None) -> str:
        """What an unload of a version no host holds answers: UNKNOWN_MODEL for one
        nobody knows, else what is the matter."""
        known = self._in_repositories(name) | {
            v for (n, v), workers in self._registry.serving.items() if n == name and workers
        }
        if not known or (version is not None and version not in known):
            which = f"version {version} of model {name!r}" if version else f"model {name!r}"
            listing = ", ".join(sorted(known, key=version_order)) or "none"
            raise UnknownModelError(
                f"no worker holds {which}, and no repository has it (versions: {listing})"
            )
        plain = [
            w.worker_id
            for (n, v), workers in self._registry.serving.items()
            if n == name and version in (None, v)
            for w in workers
        ]
        if plain:
            return (
                f"model {name!r} is served by worker(s) not from a repository "
                f"({', '.join(plain)}): stop them to take it away"
            )
        return f"model {name!r}{f' version {version}' if version else ''} is not loaded"

    def _in_repositories(self, name: str) -> set[str]:
        return {
            e.version for h in self.hosts.values() for e in h.report.repository if e.name == name
        }

    def _repository_listing(self) -> str:
        names = {e.name for h in self.hosts.values() for e in h.report.repository}
        return ", ".join(sorted(names))

    # ------------------------------------------------------------ the index

    def index(self) -> tuple[wire.VersionState, ...]:
        """Every version a repository holds or a worker serves, with its state."""
        keys: set[Key] = set(self.lost)
        for host in self.hosts.values():
            keys.update((e.name, e.version) for e in host.report.repository)
            keys.update(host.hosted())
            keys.update(host.loading)
        keys.update(k for k, workers in self._registry.serving.items() if workers)
        ordered = sorted(keys, key=lambda k: (k[0], version_order(k[1])))
        return tuple(self._state(key) for key in ordered)

    def _state(self, key: Key) -> wire.VersionState:
        served = self._registry.serving.get(key, [])
        hosted = [s for h in self.hosts.values() if (s := h.state(key)) is not None]
        names = [s.state if isinstance(s, wire.Hosted) else s for s in hosted]
        host_ids = {h.worker_id for v in self.hosts.values() for h in v.report.hosted}
        plain = any(w.worker_id not in host_ids for w in served)
        default = bool(served) and self._registry.defaults.get(key[0]) == key
        workers = tuple(w.worker_id for w in served)
        state: State
        if plain or (served and "READY" in names):
            state, reason = "READY", ""
        elif "READY" in names or "LOADING" in names:
            state, reason = "LOADING", ""
        elif "UNLOADING" in names:
            state, reason = "UNLOADING", ""
        else:
            state, reason = "UNAVAILABLE", self._why_unavailable(key, hosted)
        return wire.VersionState(key[0], key[1], state, reason, workers, default)

    def _why_unavailable(self, key: Key, hosted: list[wire.Hosted | str]) -> str:
        failed = [s.reason for s in hosted if isinstance(s, wire.Hosted) and s.reason]
        if failed:
            return failed[0]
        if key in self.lost:
            return self.lost[key]
        entries = [e for h in self.hosts.values() if (e := h.entry(key)) is not None]
        if entries and all(e.problem for e in entries):
            return entries[0].problem
        return NOT_LOADED


def _fitting(
    models: tuple[wire.VersionState, ...], said: str
) -> tuple[tuple[wire.VersionState, ...], str]:
    """The index cut to what a REPOSITORY_REPLY's header can carry: hosts' reports each
    fit the header limit, but the index of several (or of one, with each entry's state
    and reason added) need not, and a reply over the limit is one no client can read."""
    room = wire.DEFAULT_LIMITS.max_header_bytes - _REPLY_SLACK
    used = 0
    for count, version in enumerate(models):
        used += len(msgspec.json.encode(version)) + 1
        if used > room:
            left = len(models) - count
            note = f"the index lists {count} of {len(models)} versions ({left} more do not fit)"
            return models[:count], f"{said}; {note}" if said else note
    return models, said
