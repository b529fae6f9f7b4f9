"""Metrics through prometheus-client: a registry per component, and the endpoint that
serves it beside the component's health probes.

Each component (a broker; a worker process) keeps its metrics in a
:class:`~prometheus_client.CollectorRegistry` of its own, never the library's global
default: tests build several brokers and workers in one process, and their names would
collide there. Counters, gauges and histograms are prometheus-client's; the page is its
exposition (``generate_latest``, or OpenMetrics when a scraper asks for it in
``Accept``), so what Prometheus parses is what the library writes.

:class:`Histogram` adds one thing to the library's: a weighted observation. A group
job's requests share one time, and the broker counts each request: a group of 16 would
otherwise be 16 ``observe`` calls, 8.8 µs, where one weighted observation costs 0.44
µs, less than one ``observe`` (0.54 µs: a bisect instead of its linear scan). It uses
the child's ``_sum``, ``_buckets`` and ``_upper_bounds``: private names, pinned by the
dependency's bound (``<1``) and by ``tests/test_metrics_server.py``, which checks it
against single observations.

The endpoint is our own small threading HTTP server rendering the registry, not
prometheus-client's ``start_http_server`` or WSGI app, because the port also answers
the health probes (:mod:`ipuserve.probes`: an orchestrator checks the port it
scrapes), answers ``HEAD`` like ``GET`` (what some health checkers send; the WSGI app
answers 405), answers 404 on other paths (the app serves the page on every path), and
a port that cannot be bound is a :class:`~ipuserve.errors.ConfigError` naming it, at
construction.

prometheus-client adds a ``_created`` sample to every counter and histogram (the time
it was made); no dashboard here reads them and they double the page, so they are off
for the process (:func:`prometheus_client.disable_created_metrics`, the library's
switch, process-wide).
"""

from __future__ import annotations

import bisect
import http.server
import logging
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Literal

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from ipuserve import probes as health
from ipuserve.errors import ConfigError

log = logging.getLogger(__name__)

#: how prometheus-client's multiprocess mode merges a gauge's values of several
#: processes (it ignores it in one process)
GaugeMode = Literal[
    "all", "liveall", "min", "livemin", "max", "livemax", "sum", "livesum", "mostrecent",
    "livemostrecent",
]  # fmt: skip

prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]

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


class Histogram(prometheus_client.Histogram):
    """prometheus-client's histogram, with :meth:`observe_many`."""

    def observe_many(self, amount: float, count: int) -> None:
        """``count`` observations of ``amount`` (the requests of a group share theirs),
        at the cost of one. Call it on a child (``.labels(...)``), as ``observe``."""
        if count == 1:
            self.observe(amount)
            return
        self._raise_if_not_observable()  # type: ignore[no-untyped-call]
        self._sum.inc(amount * count)
        # the first bound >= amount, as observe's "amount <= bound" scan finds it
        self._buckets[bisect.bisect_left(self._upper_bounds, amount)].inc(count)


class Metrics:
    """A component's metrics in a registry of its own; subclasses declare their
    families with :meth:`counter`, :meth:`gauge` and :meth:`histogram`."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = CollectorRegistry() if registry is None else registry

    def counter(self, name: str, help_: str, labels: Sequence[str] = ()) -> Counter:
        """``name`` ends in ``_total``, as exposed (the library appends it if not)."""
        return Counter(name, help_, labels, registry=self.registry)

    def gauge(
        self,
        name: str,
        help_: str,
        labels: Sequence[str] = (),
        *,
        multiprocess_mode: GaugeMode = "all",
    ) -> Gauge:
        """``multiprocess_mode``: how the processes' values merge where they share a
        ``PROMETHEUS_MULTIPROC_DIR`` (prometheus-client's multiprocess mode)."""
        return Gauge(
            name, help_, labels, registry=self.registry, multiprocess_mode=multiprocess_mode
        )

    def histogram(
        self,
        name: str,
        help_: str,
        labels: Sequence[str] = (),
        buckets: Sequence[float] = LATENCY_BUCKETS,
    ) -> Histogram:
        return Histogram(name, help_, labels, registry=self.registry, buckets=buckets)

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples exposed as ``name`` (``..._total``, ``..._count``)
        whose labels include ``labels``: 0 when there is none yet. For tests and
        reports; a scrape reads the page."""
        return sample_sum(self.registry, name, **labels)

    def render(self) -> str:
        """The page, as a scraper that asks for nothing in particular gets it."""
        return prometheus_client.generate_latest(self.registry).decode()


def sample_sum(collector: Collector, name: str, **labels: str) -> float:
    """The sum of ``collector``'s samples named ``name`` whose labels include ``labels``."""
    wanted = labels.items()
    return sum(
        sample.value
        for family in collector.collect()
        for sample in family.samples
        if sample.name == name and wanted <= sample.labels.items()
    )


Exposed = CollectorRegistry | Sequence[CollectorRegistry]


class _Merged(Collector):
    """Several registries as one page (a worker's jobs, its credit pool, its models).
    Describes nothing: each registry checks its own names when they are made."""

    def __init__(self, parts: Sequence[CollectorRegistry]) -> None:
        self._parts = tuple(parts)

    def collect(self) -> Iterator[prometheus_client.Metric]:
        for part in self._parts:
            yield from part.collect()

    def describe(self) -> Iterable[prometheus_client.Metric]:
        return ()


class _Legible(Collector):
    """A collector's families with every label value made encodable as UTF-8 (a lone
    surrogate written ``\\udXXX``): what a page falls back to rather than fail."""

    def __init__(self, inner: Collector) -> None:
        self._inner = inner

    def collect(self) -> Iterator[prometheus_client.Metric]:
        for family in self._inner.collect():
            legible = prometheus_client.Metric(family.name, family.documentation, family.type)
            legible.samples = [
                sample._replace(labels={k: _legible(v) for k, v in sample.labels.items()})
                for sample in family.samples
            ]
            yield legible

    def describe(self) -> Iterable[prometheus_client.Metric]:
        return ()


def _legible(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class MetricsServer:
    """GET /metrics on its own thread, and the owner's health probes (/healthz, /ready)."""

    def __init__(
        self,
        metrics: Exposed,
        host: str,
        port: int,
        probes: health.Probes | None = None,
    ) -> None:
        """``metrics``: the registry, or registries, the page shows. Raises ConfigError
        when ``host:port`` cannot be bound (in use, not this host's). ``probes`` maps
        paths to :data:`ipuserve.probes.Probe`; it is read at each request, so an owner
        may fill a dict it passed once it knows its state."""
        parts = [metrics] if isinstance(metrics, CollectorRegistry) else list(metrics)
        page = CollectorRegistry(auto_describe=False)
        page.register(_Merged(parts))
        handler = _handler(page, {} if probes is None else probes)
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


def render_page(page: Collector, accept: str = "") -> tuple[bytes, str]:
    """The exposition ``accept`` asks for (the text format by default) and its content
    type; never an error for a label that UTF-8 cannot encode."""
    encode, content_type = choose_encoder(accept)
    try:
        return encode(page), content_type
    except UnicodeEncodeError:  # a lone surrogate in a label: the page, not a 500
        return encode(_Legible(page)), content_type


def _handler(page: Collector, probes: health.Probes) -> type[http.server.BaseHTTPRequestHandler]:
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
            body, content_type = render_page(page, self.headers.get("Accept", ""))
            return self._send(200, body, content_type)

        def _send(self, status: int, body: bytes, content_type: str) -> bytes:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            return body

        def log_message(self, format: str, *args: object) -> None:
            log.debug("metrics: " + format, *args)

    return Handler
