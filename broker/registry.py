"""Registered workers, and the model versions they serve (with the schema requests must match).

Everything is keyed by a model's (name, version) (:attr:`ModelSpec.key`): each version
has its own workers, schema, queue and orphan timer. A request naming no version goes
to its model's default (:attr:`Registry.defaults`, kept by :mod:`ipuserve.versions`
whenever a worker joins or leaves, so admission reads one dict).

What the broker knows is bounded, since every worker's HELLO adds to it and every
client's MODELS reads it back in one MODELS_REPLY, whose header must fit the wire's
limit (docs/protocol.md §3): a worker serves at most MAX_WORKER_MODELS models, the
broker knows at most MAX_MODELS names, and a model is refused at HELLO (WELCOME's
``refused``, with why) when its entry would take the MODELS_REPLY past
MODELS_REPLY_BYTES. A model's name is forgotten ``orphan_ms`` after its last worker
left when room is needed for another (until then it is listed, and its requests
are answered UNAVAILABLE as an orphan's), not kept for ever.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import msgspec

from ipuserve.broker.jobs import JobEntry
from ipuserve.errors import UnknownModelError
from ipuserve.protocol import DEFAULT_LIMITS, Hello, ModelSpec, Refusals
from ipuserve.versions import Key, default_key, version_order

log = logging.getLogger(__name__)

#: The most models one worker may serve; its HELLO's others are refused.
MAX_WORKER_MODELS = 64
#: The most model names a broker knows at once (served, or orphaned lately).
MAX_MODELS = 256
#: What the entries of a MODELS_REPLY may take: the header limit, less a margin for
#: its frame ({"models":[]}) and the digits of counts that grow after registration.
MODELS_REPLY_BYTES = DEFAULT_LIMITS.max_header_bytes - (8 << 10)
#: A MODELS_REPLY model entry besides its spec
#: ({"spec":,"queued":N,"workers":[],"group_samples":N}),
#: and a worker's entry besides its id ({"worker_id":,"credit":N,...}), at most.
_MODEL_ENTRY = 110
_WORKER_ENTRY = 100


def _worker_bytes(worker_id: str) -> int:
    """The most a worker's entry under one model takes in a MODELS_REPLY."""
    return len(msgspec.json.encode(worker_id)) + _WORKER_ENTRY


def _model_bytes(spec: ModelSpec) -> int:
    """The most a model's entry, without its workers, takes in a MODELS_REPLY."""
    return len(msgspec.json.encode(spec)) + _MODEL_ENTRY


@dataclass(slots=True, eq=False)
class Worker:
    """A worker as the broker sees it. ``in_flight`` holds every job the worker still has,
    including jobs already answered another way (expired, or won by another worker's
    result): until the worker answers them they use its credit."""

    identity: bytes
    worker_id: str
    #: the (name, version) of each model it serves
    models: tuple[Key, ...]
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
        self.specs: dict[Key, ModelSpec] = {}
        self.serving: dict[Key, list[Worker]] = {}
        #: model versions whose last worker left, and when (monotonic); gone once one joins
        self.orphaned: dict[Key, float] = {}
        #: each known model name's default version: where a request naming none goes
        self.defaults: dict[str, Key] = {}
        #: the most the entries of a MODELS_REPLY take now (models, and their workers)
        self.reply_bytes = 0
        #: how long an orphaned model is kept at least (the broker's orphan_ms): its
        #: queued requests are answered by then, so it may be forgotten
        self.orphan_s = 0.0

    def get(self, identity: bytes) -> Worker | None:
        return self.workers.get(identity)

    def by_worker_id(self, worker_id: str) -> Worker | None:
        return next((w for w in self.workers.values() if w.worker_id == worker_id), None)

    def add(self, identity: bytes, hello: Hello, now: float) -> tuple[Worker, Refusals]:
        """Register a worker for each model whose schema agrees with what is known; the
        others come back with why, for the worker to hear in its WELCOME."""
        refused: list[tuple[str, str]] = []
        models: list[Key] = []
        for spec in hello.models:
            why = self._bounds(hello.worker_id, spec, models)
            if why is not None and self._forget_orphans(now):  # room made: once more
                why = self._bounds(hello.worker_id, spec, models)
            if why is None:
                why = self._refusal(hello.worker_id, spec)
            if why is None:
                models.append(spec.key)
            else:
                refused.append((spec.name, why))
        worker = Worker(identity, hello.worker_id, tuple(models), hello.credit, now)
        self.workers[identity] = worker
        for key in models:
            self.serving.setdefault(key, []).append(worker)
            self.orphaned.pop(key, None)
        self._update_defaults({name for name, _version in models})
        return worker, tuple(refused)

    def _update_defaults(self, names: set[str]) -> None:
        for name in names:
            key = default_key(name, self.specs, self.serving)
            if key is None:
                self.defaults.pop(name, None)
            else:
                self.defaults[name] = key

    def credit_changed(self, worker: Worker, before: int) -> bool:
        """``worker``'s credit changed from ``before``: whether it started or stopped
        taking jobs (draining, or back), which may move its models' defaults."""
        if (before > 0) == (worker.credit > 0):
            return False
        self._update_defaults({name for name, _version in worker.models})
        return True

    def versions(self, name: str) -> list[str]:
        """The versions of ``name`` the broker knows (served or orphaned lately), in order."""
        return sorted((v for n, v in self.specs if n == name), key=version_order)

    def known_name(self, name: str) -> bool:
        """Whether some version of ``name`` is known (served, or orphaned lately)."""
        return name in self.defaults

    def _served(self, name: str) -> bool:
        key = self.defaults.get(name)
        return key is not None and bool(self.serving.get(key))

    def _bounds(self, worker_id: str, spec: ModelSpec, accepted: list[Key]) -> str | None:
        """Why ``spec`` would pass what the broker may know (see the module's doc), else
        None; when None its bytes are counted from now on."""
        name, key = spec.name, spec.key
        known = self.specs.get(key)
        if any(n == name for n, _v in accepted):
            why = f"model {name!r} is announced twice (a worker serves one version of a name)"
        elif len(accepted) >= MAX_WORKER_MODELS:
            why = f"a worker may serve at most {MAX_WORKER_MODELS} models"
        elif known is None and len(self.specs) >= MAX_MODELS:
            why = f"the broker knows {len(self.specs)} model versions, its most (MAX_MODELS)"
        else:
            more = _worker_bytes(worker_id)
            if known is None:
                more += _model_bytes(spec)
            elif known != spec and not self.serving.get(key):  # replaces an orphan's
                more += _model_bytes(spec) - _model_bytes(known)
            if self.reply_bytes + more <= MODELS_REPLY_BYTES:
                self.reply_bytes += more
                return None
            why = (
                f"the broker's MODELS reply would pass its {DEFAULT_LIMITS.max_header_bytes} "
                "byte header limit with it: fewer models or workers, or shorter names"
            )
        log.error("worker %s: model %r refused: %s", worker_id, name, why)
        return why

    def _refusal(self, worker_id: str, spec: ModelSpec) -> str | None:
        key = spec.key
        known = self.specs.get(key)
        if known is None or known == spec or not self.serving.get(key):
            self.specs[key] = spec
            return None
        self.reply_bytes -= _worker_bytes(worker_id)  # counted by _bounds, not kept
        serving = ", ".join(w.worker_id for w in self.serving[key])
        why = (
            f"model {spec.name!r} is served by {serving} with another schema at version "
            f"{spec.version} ({known.signature()}; not {spec.signature()}); stop those "
            "workers first, or give this build another version (or the model another --name)"
        )
        log.error("worker %s refused: %s", worker_id, why)
        return why

    def unknown(self, model: str, version: str | None = None) -> UnknownModelError:
        """The error for a request to ``model`` (at ``version``), which no worker serves:
        a known model's versions, else the known models (marking those without a worker
        now)."""
        versions = self.versions(model)
        if version is not None and versions:
            served = ", ".join(
                v if self.serving.get((model, v)) else f"{v} (no worker now)" for v in versions
            )
            return UnknownModelError(
                f"model {model!r} has no version {version} (versions: {served}); name one "
                "of those, or none for the default"
            )
        names = sorted({name for name, _version in self.specs})
        known = ", ".join(
            name if self._served(name) else f"{name} (no worker now)" for name in names
        )
        return UnknownModelError.nobody_serves(model, known)

    def remove(self, worker: Worker) -> list[Key]:
        """Forget ``worker``; the model versions it was the last to serve (now orphaned)."""
        self.workers.pop(worker.identity, None)
        orphaned = []
        entry = _worker_bytes(worker.worker_id)
        for key in worker.models:
            serving = self.serving.get(key, [])
            if worker in serving:
                serving.remove(worker)
                self.reply_bytes -= entry
                if not serving:
                    self.orphaned[key] = time.monotonic()
                    orphaned.append(key)
        self._update_defaults({name for name, _version in worker.models})
        return orphaned

    def retire(self, key: Key) -> None:
        """Forget the orphaned version ``key`` now, not ``orphan_s`` later: it was
        unloaded (its last worker drained away), and nobody will bring it back: a
        request that names it is told at once that it is not there."""
        if key in self.orphaned and not self.serving.get(key):
            self.orphaned[key] = time.monotonic() - self.orphan_s
            self._forget_orphans(time.monotonic())

    def _forget_orphans(self, now: float) -> bool:
        """Forget the models orphaned for ``orphan_s`` or longer (their name, schema and
        bytes: a worker may announce them anew); whether there were any."""
        old = [key for key, since in self.orphaned.items() if now - since >= self.orphan_s]
        for key in old:
            spec = self.specs.pop(key, None)
            if spec is not None:
                self.reply_bytes -= _model_bytes(spec)
            self.serving.pop(key, None)
            del self.orphaned[key]
        self._update_defaults({name for name, _version in old})
        return bool(old)
