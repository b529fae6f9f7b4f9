"""The fleet as one: the models of several brokers merged into one list.

Each broker lists the workers registered with it (MODELS_REPLY); a worker that
serves several brokers is in each list. :func:`merge_models` shows each model once
and each worker once, by ``worker_id``, with the brokers it is registered with and
its credit, jobs and requests added up over them (what it holds in all). Queued
requests add up over the brokers too. A broker that did not answer is left out (the
caller says so).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ipuserve import protocol as wire


@dataclass(frozen=True)
class FleetWorker:
    """One worker of a model, over every broker it is registered with."""

    worker_id: str
    credit: int
    in_flight: int
    requests: int
    brokers: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            "credit": self.credit,
            "in_flight": self.in_flight,
            "requests": self.requests,
            "brokers": list(self.brokers),
        }


@dataclass(frozen=True)
class FleetModel:
    """One model over the fleet: its spec (the first broker's), queued requests
    over every broker, its workers once each, and the brokers that list it."""

    spec: wire.ModelSpec
    queued: int
    workers: tuple[FleetWorker, ...]
    brokers: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "spec": self.spec.to_json(),
            "queued": self.queued,
            "workers": [worker.to_json() for worker in self.workers],
            "brokers": list(self.brokers),
        }

    def info(self) -> wire.ModelInfo:
        """As one broker's listing would show it (brokers left out)."""
        loads = (
            wire.WorkerLoad(w.worker_id, w.credit, w.in_flight, w.requests) for w in self.workers
        )
        return wire.ModelInfo(self.spec, self.queued, tuple(loads))


def merge_models(by_broker: Mapping[str, Sequence[wire.ModelInfo]]) -> list[FleetModel]:
    """Each model version once, each of its workers once (by id), in the order first
    seen."""
    specs: dict[tuple[str, str], wire.ModelSpec] = {}
    queued: dict[tuple[str, str], int] = {}
    model_brokers: dict[tuple[str, str], list[str]] = {}
    workers: dict[tuple[str, str], dict[str, list[tuple[str, wire.WorkerLoad]]]] = {}
    for broker, infos in by_broker.items():
        for info in infos:
            name = info.spec.key
            specs.setdefault(name, info.spec)
            queued[name] = queued.get(name, 0) + info.queued
            model_brokers.setdefault(name, []).append(broker)
            by_id = workers.setdefault(name, {})
            for load in info.workers:
                by_id.setdefault(load.worker_id, []).append((broker, load))
    return [
        FleetModel(
            specs[name],
            queued[name],
            tuple(_merged(worker_id, seen) for worker_id, seen in workers[name].items()),
            tuple(model_brokers[name]),
        )
        for name in specs
    ]


def _merged(worker_id: str, seen: list[tuple[str, wire.WorkerLoad]]) -> FleetWorker:
    return FleetWorker(
        worker_id,
        sum(load.credit for _, load in seen),
        sum(load.in_flight for _, load in seen),
        sum(load.requests for _, load in seen),
        tuple(dict.fromkeys(broker for broker, _ in seen)),
    )
