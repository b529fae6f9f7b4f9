"""Registered workers, and the models they serve (with the schema requests must match)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from ipuserve.broker.jobs import JobEntry
from ipuserve.errors import UnknownModelError
from ipuserve.protocol import Hello, ModelSpec, Refusals

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class Worker:
    """A worker as the broker sees it. ``in_flight`` holds every job the worker still has,
    including jobs already answered another way (expired, or won by another worker's
    result): until the worker answers them they use its credit."""

    identity: bytes
    worker_id: str
    models: tuple[str, ...]
    credit: int
    last_seen: float
    in_flight: dict[bytes, JobEntry] = field(default_factory=dict)

    @property
    def spare(self) -> int:
        return self.credit - len(self.in_flight)

    @property
    def requests_in_flight(self) -> int:
        """The clients' requests in ``in_flight`` (a group job holds several); credit
        counts jobs, operators count requests."""
        return sum(len(job.request_ids) for job in self.in_flight.values())

    @property
    def load(self) -> float:
        return len(self.in_flight) / self.credit if self.credit else float("inf")


class Registry:
    def __init__(self) -> None:
        self.workers: dict[bytes, Worker] = {}
        self.specs: dict[str, ModelSpec] = {}
        self.serving: dict[str, list[Worker]] = {}
        #: models whose last worker left, and when (monotonic); gone once one joins
        self.orphaned: dict[str, float] = {}

    def get(self, identity: bytes) -> Worker | None:
        return self.workers.get(identity)

    def by_worker_id(self, worker_id: str) -> Worker | None:
        return next((w for w in self.workers.values() if w.worker_id == worker_id), None)

    def add(self, identity: bytes, hello: Hello, now: float) -> tuple[Worker, Refusals]:
        """Register a worker for each model whose schema agrees with what is known; the
        others come back with why, for the worker to hear in its WELCOME."""
        refused = tuple(
            (spec.name, why)
            for spec in hello.models
            if (why := self._refusal(hello.worker_id, spec)) is not None
        )
        names = {name for name, _why in refused}
        models = tuple(spec.name for spec in hello.models if spec.name not in names)
        worker = Worker(identity, hello.worker_id, models, hello.credit, now)
        self.workers[identity] = worker
        for name in models:
            self.serving.setdefault(name, []).append(worker)
            self.orphaned.pop(name, None)
        return worker, refused

    def _refusal(self, worker_id: str, spec: ModelSpec) -> str | None:
        known = self.specs.get(spec.name)
        if known is None or known == spec or not self.serving.get(spec.name):
            self.specs[spec.name] = spec
            return None
        serving = ", ".join(w.worker_id for w in self.serving[spec.name])
        why = (
            f"model {spec.name!r} is served by {serving} with another schema "
            f"({known.signature()}; not {spec.signature()}); stop those workers first, or "
            "give this model another --name"
        )
        log.error("worker %s refused: %s", worker_id, why)
        return why

    def unknown(self, model: str) -> UnknownModelError:
        """The error for a request to ``model``, which no worker serves, listing those
        that are known (marking the ones without a worker now)."""
        known = ", ".join(
            name if self.serving.get(name) else f"{name} (no worker now)"
            for name in sorted(self.specs)
        )
        return UnknownModelError.nobody_serves(model, known)

    def remove(self, worker: Worker) -> list[str]:
        """Forget ``worker``; the models it was the last to serve (now orphaned)."""
        self.workers.pop(worker.identity, None)
        orphaned = []
        for name in worker.models:
            serving = self.serving.get(name, [])
            if worker in serving:
                serving.remove(worker)
                if not serving:
                    self.orphaned[name] = time.monotonic()
                    orphaned.append(name)
        return orphaned
