"""What the broker knows of each repository worker (a *host*), and where a load fits.

A host is a worker whose node registered with no models and credit 0 and then sent
a HOST report: its IPUs, the entries of its repository and the versions it hosts.
The broker keeps its last report, plus what it asked of it since that the report
cannot say yet (a LOAD or UNLOAD sent after the host made its report): without
them, an index asked for right after a load would say "not loaded", and a client
waiting for READY would give up.

Choosing hosts is a pure function of those views (:func:`fitting`): least loaded
first (fewest IPUs in use), then by worker id. Every broker derives the same views
from the same reports, so brokers that place the same load at once mostly pick the
same hosts, and a host treats a second LOAD of what it has as a no-op
(docs/repository.md, "Several brokers").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ipuserve import protocol as wire
from ipuserve.broker.registry import Worker
from ipuserve.versions import Key

#: A host's states in which a version counts as placed there (a holder).
HOLDING = ("READY", "LOADING")


@dataclass(slots=True, eq=False)
class HostView:
    """One host: its registration, its last report, and what was asked of it since."""

    worker: Worker
    report: wire.Host
    #: LOADs sent that its report does not show yet
    loading: dict[Key, wire.Load] = field(default_factory=dict)
    #: UNLOADs sent while its report still shows the version not UNLOADING
    unloading: set[Key] = field(default_factory=set)

    @property
    def worker_id(self) -> str:
        return self.worker.worker_id

    def hosted(self) -> dict[Key, wire.Hosted]:
        return {(h.name, h.version): h for h in self.report.hosted}

    def entry(self, key: Key) -> wire.Entry | None:
        return next((e for e in self.report.repository if (e.name, e.version) == key), None)

    def state(self, key: Key) -> wire.Hosted | str | None:
        """Its state of ``key`` as the broker sees it: what it asked overrides a report
        made before the host heard it. The report's entry (with a reason), a state
        name, or None when it does not hold it."""
        if key in self.unloading:
            return "UNLOADING"
        hosted = self.hosted().get(key)
        if hosted is not None:
            return hosted
        return "LOADING" if key in self.loading else None

    def state_name(self, key: Key) -> str | None:
        """:meth:`state`'s name: READY, LOADING, UNLOADING, UNAVAILABLE or None."""
        state = self.state(key)
        return state.state if isinstance(state, wire.Hosted) else state

    def holds(self, key: Key) -> bool:
        """Whether ``key`` is placed here: READY or LOADING (by its report or a LOAD
        sent), not on its way out or failed."""
        return self.state_name(key) in HOLDING

    @property
    def free_ipus(self) -> int:
        """Free IPUs, less those the LOADs it has not reported yet will take."""
        return max(0, self.report.free_ipus - sum(load.replicas for load in self.loading.values()))

    @property
    def used_ipus(self) -> int:
        return self.report.ipus - self.free_ipus

    def placed(self) -> dict[Key, tuple[int, int]]:
        """What is placed here (READY or LOADING, reported or asked): key -> (replicas,
        wanted workers), for placing it again should this host die."""
        placed = {key: (load.replicas, load.wanted_workers) for key, load in self.loading.items()}
        for key, hosted in self.hosted().items():
            if self.holds(key):
                placed[key] = (hosted.replicas, hosted.wanted_workers)
        return placed

    def heard(self, report: wire.Host) -> None:
        """A new report: what it shows settles what was asked (see the module's doc)."""
        self.report = report
        hosted = self.hosted()
        for key in [k for k in self.loading if k in hosted]:
            del self.loading[key]
        self.unloading = {
            k for k in self.unloading if k in hosted and hosted[k].state != "UNLOADING"
        }


def fitting(
    hosts: list[HostView], key: Key, replicas: int | None
) -> tuple[list[tuple[HostView, int]], list[str]]:
    """The hosts ``key`` may be loaded on now, least loaded first (fewest IPUs used,
    then id), each with the replicas it would run (``replicas``, else its entry's, each
    on the entry's IPUs per replica); and,
    for the others whose repository has it, why not (for the NO_ROOM message)."""
    room: list[tuple[HostView, int]] = []
    why_not: list[str] = []
    for host in sorted(hosts, key=lambda h: (h.used_ipus, h.worker_id)):
        entry = host.entry(key)
        if entry is None or host.holds(key):
            continue
        if entry.problem:
            why_not.append(f"{host.worker_id}: its entry is broken ({entry.problem})")
            continue
        if host.state_name(key) == "UNLOADING":
            why_not.append(f"{host.worker_id}: still unloading it")
            continue
        wanted = replicas or entry.replicas
        ipus = wanted * entry.ipus_per_replica
        if host.free_ipus >= ipus:
            room.append((host, wanted))
        else:
            why_not.append(
                f"{host.worker_id}: {host.free_ipus} of {host.report.ipus} IPU(s) free, "
                f"{ipus} needed"
            )
    return room, why_not
