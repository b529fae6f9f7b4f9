"""ModelHost: a repository worker's IPUs and the model versions it hosts.

``ipuserve worker --repository DIR --ipus N`` runs one. Told to LOAD a version (by a
broker, or ``--load`` at start), the host checks the repository entry and its free
IPUs and, if there is room, builds a :class:`~ipuserve.worker.runner_backend.RunnerBackend`
on a thread of its own and serves it through a
:class:`~ipuserve.worker.brokers.BrokerNodes` with worker id ``HOST_ID/NAME/VERSION``:
to each broker it is an ordinary worker, with its own HELLO (the spec names the
version, and the config's pinned default) and credit. A version is LOADING until one
of its nodes joined a broker, then READY; a load that cannot be done (no such entry, a
broken one, no room, the runtime refused) leaves it UNAVAILABLE with the reason.

UNLOAD drains it exactly as SIGTERM drains a worker (``BrokerNodes.request_stop``:
credit 0, finish what runs, BYE with the unstarted jobs handed back); once its nodes
ended the backend is closed, which frees its IPUs, and it leaves the report.

The host is the :class:`~ipuserve.worker.control.Control` of its host nodes
(:mod:`ipuserve.worker.host_node`): every change bumps :attr:`ModelHost.seq` and rings
their doorbells, and each sends the new :meth:`ModelHost.report` (HOST) to its broker.
The workers hold the truth: brokers derive their index from these reports.

Threads: LOAD and UNLOAD arrive on the host nodes' threads and never block them; each
hosted version's load and serving run on a thread of its own. One lock guards the
hosted versions; it is never held while a backend is built or closed.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ipuserve import protocol as wire
from ipuserve.errors import IpuserveError
from ipuserve.limits import name_problem
from ipuserve.protocol.control import State
from ipuserve.protocol.envelope import bounded
from ipuserve.worker.backend import Backend
from ipuserve.worker.brokers import BrokerNodes
from ipuserve.worker.config import WorkerConfig
from ipuserve.worker.repository import RepoEntry, Repository

if TYPE_CHECKING:
    from ipuserve.worker.metrics import WorkerFamilies

log = logging.getLogger(__name__)

Key = tuple[str, str]
#: why a version whose worker nodes ended by themselves is UNAVAILABLE
_STOPPED = (
    "its worker stopped: a broker refused it (its log says why: e.g. the broker serves "
    "this name with another schema) or its loop crashed"
)
#: builds a backend for an entry on ``replicas`` IPUs (a test may give its own)
MakeBackend = Callable[[RepoEntry, int], Backend]


class RepositoryMetricsHook(Protocol):
    """What the host tells its metrics (worker/metrics.py's RepositoryMetrics, issue 22)."""

    def loaded(self, model: str, version: str, seconds: float) -> None: ...

    def unloaded(self, model: str, version: str, seconds: float) -> None: ...

    def free_ipus(self, count: int) -> None: ...

    def load_failed(self, model: str, version: str) -> None: ...


@dataclass(slots=True)
class HostedVersion:
    """A version this host loads, serves or drains (guarded by the host's lock)."""

    name: str
    version: str
    worker_id: str
    replicas: int
    wanted_workers: int
    #: IPUs it holds: from the load's start until its backend is closed
    ipus: int
    state: State = "LOADING"
    reason: str = ""
    nodes: BrokerNodes | None = None
    thread: threading.Thread | None = None
    #: when the load (READY: loaded seconds) or the unload (freed: unloaded seconds) began
    since: float = 0.0
    unloading: bool = False
    #: a LOAD that came while it drained: (replicas, wanted_workers), loaded once freed
    reload: tuple[int, int] | None = None

    def wire(self) -> wire.Hosted:
        return wire.Hosted(
            self.name,
            self.version,
            self.state,
            self.worker_id,
            self.replicas,
            self.wanted_workers,
            bounded(self.reason),
        )


class ModelHost:
    """The versions hosted on ``ipus`` simulated IPUs, loaded from ``repository`` and
    served to every broker ``endpoints`` stand for."""

    def __init__(
        self,
        repository: Repository,
        ipus: int,
        config: WorkerConfig,
        endpoints: Sequence[str],
        *,
        make_backend: MakeBackend | None = None,
        on_joined: Callable[[str], None] | None = None,
        metrics: RepositoryMetricsHook | None = None,
        families: WorkerFamilies | None = None,
        look_ahead: str = "0",
    ) -> None:
        """``config`` is the host's (its ``worker_id`` is HOST_ID); each hosted version
        serves with a copy that names it and carries its model's credit. ``families``:
        the job metrics every hosted version's backend reports to (a series each)."""
        self.repository = repository
        self.ipus = ipus
        self._config = config
        self._endpoints = list(endpoints)
        self._make_backend = make_backend or _runner_backend(look_ahead, families)
        self._on_joined = on_joined
        self._metrics = metrics
        self._lock = threading.Lock()
        self._hosted: dict[Key, HostedVersion] = {}
        self._seq = 0
        self._wakes: list[Callable[[], None]] = []
        self._closing = False
        repository.scan()

    # ------------------------------------------------------------ Control (host nodes)

    @property
    def seq(self) -> int:
        return self._seq

    def report(self) -> wire.Host:
        """The HOST report: IPUs, the repository's entries, the hosted versions."""
        with self._lock:
            hosted = tuple(h.wire() for h in self._hosted.values())
            free = self._free()
        entries = tuple(e.wire() for e in self.repository.entries)
        return wire.Host(ipus=self.ipus, free_ipus=free, repository=entries, hosted=hosted)

    def handle(self, message: wire.Load | wire.Unload) -> None:
        try:
            if isinstance(message, wire.Load):
                self.load(message.name, message.version, message.replicas, message.wanted_workers)
            else:
                self.unload(message.name, message.version)
        except Exception:  # the host node's loop must go on: its broker still needs reports
            log.exception("%s %s:%s failed", message.COMMAND.name, message.name, message.version)

    def watch(self, wake: Callable[[], None]) -> None:
        with self._lock:
            self._wakes.append(wake)

    def unwatch(self, wake: Callable[[], None]) -> None:
        with self._lock:
            if wake in self._wakes:
                self._wakes.remove(wake)

    # ------------------------------------------------------------ load and unload

    def load(
        self, name: str, version: str | None, replicas: int | None = None, wanted_workers: int = 1
    ) -> None:
        """Host ``name`` ``version`` (None: the latest in the repository) on ``replicas``
        IPUs (None: its config's); never blocks, never raises: the report says how it
        went. Hosted or on its way already: nothing more (several brokers may ask)."""
        self.repository.scan()  # a version added since is loadable now
        version = version or self.repository.latest(name) or "1"
        entry = self.repository.get(name, version)
        with self._lock:
            current = self._hosted.get((name, version))
            if current is not None and current.state != "UNAVAILABLE":
                if current.unloading:  # load it again once it drained
                    current.reload = (replicas or current.replicas, wanted_workers)
                self._changed()
                return
            hosted = self._admit(name, version, entry, replicas, wanted_workers)
            self._hosted[(name, version)] = hosted
            if hosted.state == "LOADING" and entry is not None:
                hosted.thread = threading.Thread(
                    target=self._serve,
                    args=(hosted, entry),
                    name=f"host-{name}-{version}",
                    daemon=True,
                )
                hosted.thread.start()
            self._changed()

    def unload(self, name: str, version: str) -> None:
        """Drain ``name`` ``version`` and free its IPUs (its thread does, once drained);
        a version not hosted: nothing, a report."""
        with self._lock:
            hosted = self._hosted.get((name, version))
            if hosted is not None and hosted.state == "UNAVAILABLE":
                del self._hosted[(name, version)]
            elif hosted is not None and not hosted.unloading:
                log.info("unloading %s version %s: draining", name, version)
                hosted.state, hosted.unloading, hosted.reload = "UNLOADING", True, None
                hosted.since = time.monotonic()
                if hosted.nodes is not None:
                    hosted.nodes.request_stop()
            elif hosted is not None:
                hosted.reload = None
            self._changed()

    def close(self) -> None:
        """Unload everything (each drains) and wait until every IPU is free."""
        with self._lock:
            self._closing = True
            keys = list(self._hosted)
        for key in keys:
            self.unload(*key)
        with self._lock:
            threads = [h.thread for h in self._hosted.values() if h.thread is not None]
        for thread in threads:
            thread.join()

    # ------------------------------------------------------------ internals

    def _admit(
        self,
        name: str,
        version: str,
        entry: RepoEntry | None,
        replicas: int | None,
        wanted: int,
    ) -> HostedVersion:
        """A new hosted version: LOADING with its IPUs counted, or UNAVAILABLE and why."""
        replicas = replicas or (entry.config.replicas if entry is not None else 1)
        hosted = HostedVersion(
            name, version, f"{self._config.worker_id}/{name}/{version}", replicas, wanted, 0
        )
        hosted.since = time.monotonic()
        need = replicas * (entry.ipus_per_replica if entry is not None else 1)
        free = self._free()
        if self._closing:
            why = "this worker is shutting down"
        elif (problem := name_problem(hosted.worker_id)) is not None:
            why = f"its worker id {hosted.worker_id[:40]!r}... {problem}: a shorter --worker-id"
        elif entry is None:
            held = ", ".join(f"{e.name}:{e.version}" for e in self.repository.entries)
            why = f"not in this worker's repository (it holds: {held or 'nothing'})"
        elif entry.problem:
            why = entry.problem
        elif need > free:
            why = f"no room: it needs {need} IPU(s), this worker has {free} of {self.ipus} free"
        else:
            hosted.ipus = need
            log.info("loading %s version %s on %d IPU(s)", name, version, need)
            return hosted
        log.error("cannot load %s version %s: %s", name, version, why)
        hosted.state, hosted.reason = "UNAVAILABLE", why
        return hosted

    def _serve(self, hosted: HostedVersion, entry: RepoEntry) -> None:
        """The version's thread: build its backend, serve it until unloaded, free it."""
        try:
            backend = self._make_backend(entry, hosted.replicas)
        except Exception as exc:  # the runtime's refusal, or a file gone since the scan
            why = str(exc) if isinstance(exc, IpuserveError) else f"{type(exc).__name__}: {exc}"
            why = self.repository.relative(why)  # reported to the brokers: no local paths
            log.error("loading %s version %s failed: %s", hosted.name, hosted.version, why)
            if self._metrics is not None:
                self._metrics.load_failed(hosted.name, hosted.version)
            self._ended(hosted, f"its load failed: {why}")
            return
        config = dataclasses.replace(
            self._config, worker_id=hosted.worker_id, credit=entry.config.credit
        )
        nodes = BrokerNodes(
            backend, config, self._endpoints, on_joined=lambda line: self._joined(hosted, line)
        )
        with self._lock:
            hosted.nodes = nodes
            if hosted.unloading:  # unloaded while it loaded: drains at once
                nodes.request_stop()
        code = nodes.run()  # closes the backend once its nodes ended: the IPUs are free
        self._ended(hosted, "" if code == 0 else _STOPPED)

    def _joined(self, hosted: HostedVersion, line: str) -> None:
        if self._on_joined is not None:
            self._on_joined(line)
        with self._lock:
            if hosted.state != "LOADING":
                return
            hosted.state = "READY"
            seconds = time.monotonic() - hosted.since
            self._changed()
        log.info("%s version %s is READY (%.2f s)", hosted.name, hosted.version, seconds)
        if self._metrics is not None:
            self._metrics.loaded(hosted.name, hosted.version, seconds)

    def _ended(self, hosted: HostedVersion, failure: str) -> None:
        """Its IPUs are free: gone from the report if unloaded, else UNAVAILABLE (why)."""
        with self._lock:
            hosted.ipus, hosted.nodes, reload = 0, None, hosted.reload
            if hosted.unloading or not failure:
                if self._hosted.get((hosted.name, hosted.version)) is hosted:
                    del self._hosted[(hosted.name, hosted.version)]
            else:
                hosted.state, hosted.reason = "UNAVAILABLE", failure
            seconds = time.monotonic() - hosted.since
            self._changed()
        if hosted.unloading:
            log.info("%s version %s unloaded (%.2f s)", hosted.name, hosted.version, seconds)
            if self._metrics is not None:
                self._metrics.unloaded(hosted.name, hosted.version, seconds)
        if reload is not None and not self._closing:
            self.load(hosted.name, hosted.version, *reload)

    def _free(self) -> int:
        return self.ipus - sum(h.ipus for h in self._hosted.values())

    def _changed(self) -> None:
        """Lock held: a new report; the host nodes are told to send it."""
        self._seq += 1
        if self._metrics is not None:
            self._metrics.free_ipus(self._free())
        for wake in self._wakes:
            wake()


def _runner_backend(look_ahead: str, families: WorkerFamilies | None) -> MakeBackend:
    def make(entry: RepoEntry, replicas: int) -> Backend:
        from ipuserve.worker.runner_backend import RunnerBackend

        config = entry.config
        return RunnerBackend(
            [str(p) for p in entry.files],
            name=entry.name,
            replicas=replicas,
            batching_dim=config.batching_dim,
            batch_policy=config.batch_policy,
            batch_timeout_ms=config.batch_timeout_ms,
            look_ahead=look_ahead,
            credit=config.credit,
            version=entry.version,
            default_version=config.pinned,
            families=families,
        )

    return make
