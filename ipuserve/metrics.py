"""Counters, gauges and latency histograms in the Prometheus text format, and an endpoint.

Shared by the broker and the worker (each defines its own metric names on a
:class:`Registry`). The owner's threads update the metrics; the HTTP thread
renders them. Rendering copies each family's samples first (a C-level dict copy
under the GIL), so a scrape never sees a dict change size under it.
"""

from __future__ import annotations

import bisect
import http.server
import logging
import threading
from collections.abc import Iterable
from typing import Protocol

from ipuserve import probes as health
from ipuserve.errors import ConfigError

log = logging.getLogger(__name__)

Labels = tuple[tuple[str, str], ...]

LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


class Family:
    """Counters or gauges of one name, one sample per label set."""

    def __init__(self, name: str, help_: str, kind: str = "counter") -> None:
        self.name, self.help, self.kind = name, help_, kind
        self.samples: dict[Labels, float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(labels.items())
        self.samples[key] = self.samples.get(key, 0.0) + amount

    def set(self, value: float, **labels: str) -> None:
        self.samples[tuple(labels.items())] = value

    def value(self, **labels: str) -> float:
        return self.samples.get(tuple(labels.items()), 0.0)

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} {self.kind}"
        for labels, value in dict(self.samples).items():
            yield f"{self.name}{_labels(labels)} {value:g}"


class Histogram:
    def __init__(self, name: str, help_: str, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.name, self.help, self.buckets = name, help_, buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, seconds: float, count: int = 1) -> None:
        """``count`` observations of ``seconds`` (the requests of a group share theirs)."""
        self.counts[bisect.bisect_left(self.buckets, seconds)] += count
        self.sum += seconds * count

    @property
    def count(self) -> int:
        return sum(self.counts)

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} histogram"
        counts, cumulative = list(self.counts), 0
        for bound, count in zip((*self.buckets, float("inf")), counts, strict=True):
            cumulative += count
            le = "+Inf" if bound == float("inf") else f"{bound:g}"
            yield f'{self.name}_bucket{{le="{le}"}} {cumulative}'
        yield f"{self.name}_sum {self.sum:g}"
        yield f"{self.name}_count {cumulative}"


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    escaped = (v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for _, v in labels)
    return "{" + ",".join(f'{k}="{v}"' for (k, _), v in zip(labels, escaped, strict=True)) + "}"


class Renderable(Protocol):
    def render(self) -> str: ...


class Registry:
    """A set of metric families; subclasses declare them as attributes."""

    def families(self) -> list[Family | Histogram]:
        return [v for v in vars(self).values() if isinstance(v, Family | Histogram)]

    def render(self) -> str:
        return "\n".join(line for f in self.families() for line in f.render()) + "\n"


class Combined:
    """Several registries behind one endpoint (a worker's jobs, and its credit pool)."""

    def __init__(self, *parts: Renderable) -> None:
        self._parts = parts

    def render(self) -> str:
        return "".join(part.render() for part in self._parts)


class MetricsServer:
    """GET /metrics on its own thread, and the owner's health probes (/healthz, /ready)."""

    def __init__(
        self,
        metrics: Renderable,
        host: str,
        port: int,
        probes: health.Probes | None = None,
    ) -> None:
        """Raises ConfigError when ``host:port`` cannot be bound (in use, not this host's).
        ``probes`` maps paths to :data:`ipuserve.probes.Probe`; it is read at each
        request, so an owner may fill a dict it passed once it knows its state."""
        handler = _handler(metrics, {} if probes is None else probes)
        try:
            self._server = http.server.ThreadingHTTPServer((host, port), handler)
        except OSError as exc:
            raise ConfigError(
                f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}"
            ) from None
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="metrics", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def _handler(
    metrics: Renderable, probes: health.Probes
) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = self._page()
            if body is not None:
                self.wfile.write(body)

        def do_HEAD(self) -> None:  # what some health checkers send
            self._page()

        def _page(self) -> bytes | None:
            """Send the status and headers; the body to write, if any."""
            path = self.path.split("?")[0]
            probe = probes.get(path)
            if probe is not None:
                status, reason = health.answer(probe)
                body = (reason + "\n").encode(errors="backslashreplace")
                return self._send(status, body, "text/plain; charset=utf-8")
            if path not in ("/metrics", "/"):
                self.send_error(404)
                return None
            body = metrics.render().encode(errors="backslashreplace")  # never a 500
            return self._send(200, body, "text/plain; version=0.0.4; charset=utf-8")

        def _send(self, status: int, body: bytes, content_type: str) -> bytes:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            return body

        def log_message(self, format: str, *args: object) -> None:
            log.debug("metrics: " + format, *args)

    return Handler
