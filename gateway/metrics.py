"""The gateway's metrics, correct whether one gateway process runs or several.

Names and meanings are here; the machinery is :mod:`ipuserve.metrics` (a registry of
the gateway's own, prometheus-client's families). The families are Triton's statistics
extension kept as counters (``ipuserve_gateway_inference_*``, read back by
:mod:`gateway.stats`), the inference calls each door answered and with which status
(``ipuserve_gateway_requests_total``), and the calls refused for want of a valid token
(``ipuserve_gateway_token_refusals_total``). ``GET /metrics`` on the HTTP door shows
them (docs/gateway.md).

**Several processes.** ``ipuserve gateway --processes N`` runs N gateway processes on
the same ports, and a statistics call or a scrape lands on any one of them: each must
answer for all. prometheus-client has the mechanism: when the environment has
``PROMETHEUS_MULTIPROC_DIR``, every value lives in a memory-mapped file of that
directory, one file per process and kind, and
:class:`~prometheus_client.multiprocess.MultiProcessCollector` reads them all and
merges them (counters summed; the last inference's time, a gauge, by ``max``). The
files outlive their process, so what a process counted before it died (killed -9
included) stays counted, which is what the statistics should say. Without the variable
the values live in the process, as any component's.

The library chooses between the two **when it is imported**, from the environment
(``prometheus_client.values.ValueClass``); the variable cannot be set later in the
same process. The supervisor sets it, to a private directory, in each child's
environment before starting it, so a fresh gateway process imports the library in the
right mode; the directory is fresh and empty at each start, since files left from an
earlier run would be counted too. A process whose environment names a directory but
which imported the library before the variable was set would keep its counts to itself
and answer a share of the truth: :func:`multiprocess_dir` refuses that (ConfigError)
instead.

**Cost.** Every recorded request updates a handful of values; the children of a model
version (and of a door, model and status) are looked up once and kept, since a
``labels()`` call costs about a microsecond. In multiprocess mode each update also
writes its 16 bytes into the mapped file under the library's lock (docs/gateway.md has
the measured cost per request in both modes).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, values
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from ipuserve.errors import ConfigError
from ipuserve.gateway.config import MULTIPROC_ENV
from ipuserve.metrics import Metrics, render_page

__all__ = ["DOORS", "MULTIPROC_ENV", "GatewayMetrics", "multiprocess_dir"]

#: the doors, as the ``door`` label names them
DOORS = ("http", "grpc")
PREFIX = "ipuserve_gateway_"
_MV = ("model", "version")


def multiprocess_dir() -> Path | None:
    """The directory the processes of this gateway share their values in, or None
    (one process). ConfigError if the environment names one that is not a directory,
    or if prometheus-client was imported before the variable was set (module
    docstring): both would answer a share of the counts, silently."""
    named = os.environ.get(MULTIPROC_ENV)
    if not named:
        return None
    path = Path(named)
    if not path.is_dir():
        raise ConfigError(
            f"{MULTIPROC_ENV}={named} is not a directory: create it (empty) before "
            "starting the gateway processes that share their metrics there"
        )
    if values.ValueClass is values.MutexValue:
        raise ConfigError(
            f"{MULTIPROC_ENV} was set after prometheus_client was imported in this "
            "process, so its counts would stay in the process: set it in the "
            "environment the gateway process starts with"
        )
    return path


class GatewayMetrics(Metrics):
    """The gateway's families in a registry of its own; :meth:`collector` reads them
    (every process's, in multiprocess mode)."""

    def __init__(self) -> None:
        super().__init__()
        #: where every process's values are, or None: this process's only
        self.shared_dir = multiprocess_dir()
        p = PREFIX + "inference_"
        self.inference_requests = self.counter(
            p + "requests_total",
            "Inference requests of a model version the fabric lists, run (outcome="
            "success) or failed (outcome=fail: refused by the check against the model, "
            "or by the fabric).",
            (*_MV, "outcome"),
        )
        self.inference_request_seconds = self.counter(
            p + "request_seconds_total",
            "Time the gateway waited for the fabric's answer, by model version and outcome.",
            (*_MV, "outcome"),
        )
        self.inference_queue_seconds = self.counter(
            p + "queue_seconds_total",
            "Time successful requests spent in the broker's and the worker's queues.",
            _MV,
        )
        self.inference_compute_input_seconds = self.counter(
            p + "compute_input_seconds_total",
            "Worker time of successful requests other than the device (validation, "
            "packing, copies).",
            _MV,
        )
        self.inference_compute_infer_seconds = self.counter(
            p + "compute_infer_seconds_total", "Device time of successful requests.", _MV
        )
        self.inference_samples = self.counter(
            p + "samples_total",
            "Samples (the batching dimension) of successful requests: Triton's inference_count.",
            _MV,
        )
        self.inference_last = self.gauge(
            p + "last_timestamp_seconds",
            "Unix time of the model version's last request, successful or not.",
            _MV,
            multiprocess_mode="max",
        )
        self.requests = self.counter(
            PREFIX + "requests_total",
            'Inference calls answered, by door (http, grpc), model ("" for one the '
            "fabric does not list) and the door's status (HTTP code or gRPC code name).",
            ("door", "model", "code"),
        )
        self.token_refusals = self.counter(
            PREFIX + "token_refusals_total",
            "Calls refused without a valid bearer token, by door.",
            ("door",),
        )
        for door in DOORS:  # 0 from the start, so that a rate has a beginning
            self.token_refusals.labels(door)
        self._answered: dict[tuple[str, str, str], Counter] = {}

    def answered(self, door: str, model: str, code: str, known: Callable[[str], bool]) -> None:
        """Count an inference call ``door`` answered with ``code``. ``model`` is
        counted under its name if ``known(model)``, else under "": a made-up name adds
        no series (nor an entry to the cache of children)."""
        child = self._answered.get((door, model, code))
        if child is None:
            label = model if known(model) else ""
            child = self.requests.labels(door, label, code)
            if label:
                self._answered[door, model, code] = child
        child.inc()

    def collector(self) -> Collector:
        """What a read sees: this process's registry, or in multiprocess mode every
        process's values merged, read afresh from the shared directory."""
        if self.shared_dir is None:
            return self.registry
        merged = CollectorRegistry(auto_describe=False)
        MultiProcessCollector(merged, str(self.shared_dir))  # type: ignore[no-untyped-call]
        return merged

    def page(self, accept: str = "") -> tuple[bytes, str]:
        """The ``/metrics`` page in the exposition ``accept`` asks for, and its type."""
        return render_page(self.collector(), accept)
