"""Health probes: ``GET /healthz`` (live) and ``GET /ready`` on a component's metrics port.

A probe is a callable answering ``(ok, reason)``: the owner's view of itself, read
from the HTTP thread without a lock (each probe reads flags and references its
owner's threads set: one attribute read under the GIL). An orchestrator (Compose,
Swarm, Kubernetes) restarts what is not live and sends no work to what is not ready;
``ipuserve health URL`` (:mod:`ipuserve.face.health`) is the check a container runs.

Kept apart from the metrics exposition (:mod:`ipuserve.metrics` serves both on one
port), so that a change of exposition library leaves the probes as they are.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)

#: ``(ok, reason)``: the reason is one line, "ok" when ok.
Probe = Callable[[], tuple[bool, str]]
Probes = Mapping[str, Probe]

LIVE = "/healthz"
READY = "/ready"

OK = (True, "ok")


def answer(probe: Probe) -> tuple[int, str]:
    """The HTTP status and one-line body for ``probe``: 200 when ok, else 503. A probe
    that raises answers 503 too (a probe is never a 500: a checker reads "not ready")."""
    try:
        ok, reason = probe()
    except Exception as exc:
        log.exception("a health probe failed")
        ok, reason = False, f"the probe failed: {exc!r}"
    return (200 if ok else 503), " ".join(reason.split()) or ("ok" if ok else "not ok")


def not_yet(reason: str) -> Probe:
    """A probe answering ``reason`` (503) until its owner replaces it."""
    return lambda: (False, reason)
