"""The /metrics endpoint over real HTTP on loopback: GET, HEAD (what some health
checkers send; it once answered 501), and 404 elsewhere; prometheus-client's
exposition of a component's registry (or several), OpenMetrics when asked for; and
the weighted observation ipuserve adds to its histogram."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter

from ipuserve.metrics import Histogram, Metrics, MetricsServer
from tests.helpers import (
    Processes,
    processes,  # noqa: F401  (a fixture)
    start_broker,
)

PAGE = "# HELP x_total X.\n# TYPE x_total counter\nx_total 3.0\n"


def page() -> CollectorRegistry:
    registry = CollectorRegistry()
    Counter("x_total", "X.", registry=registry).inc(3)
    return registry


@pytest.fixture
def url() -> Iterator[str]:
    server = MetricsServer(page(), "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        server.close()


def test_get_serves_the_page(url: str) -> None:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        assert response.read().decode() == PAGE


def test_head_answers_like_get_without_a_body(url: str) -> None:
    request = urllib.request.Request(f"{url}/metrics", method="HEAD")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200
        assert int(response.headers["Content-Length"]) == len(PAGE.encode())
        assert response.read() == b""


def test_other_paths_are_not_found(url: str) -> None:
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(f"{url}/nothing", timeout=10)
    with caught.value:  # an HTTPError holds the response open
        assert caught.value.code == 404


@pytest.mark.slow
def test_the_broker_says_where_its_metrics_are_at_the_default_log_level(
    processes: Processes,  # noqa: F811
) -> None:
    """With --metrics-port 0 the port it picked was only in an INFO log line."""
    broker = start_broker(processes)  # its INFO line tells the helper the port
    url = broker.proc.wait_for(r"ipuserve broker: .*, metrics (http://\S+/metrics)$").group(1)
    assert url == f"http://127.0.0.1:{broker.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        assert b"ipuserve_broker_workers" in response.read()


def test_a_label_that_is_not_utf8_text_still_gives_a_page() -> None:
    """A lone surrogate in a label once made every scrape fail (UnicodeEncodeError);
    prometheus-client's exposition fails the same way, so the page falls back to
    writing it escaped."""
    registry = CollectorRegistry()
    Counter("x_total", "X.", ["model"], registry=registry).labels("\ud800").inc()
    server = MetricsServer(registry, "127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{server.port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200
            assert b'x_total{model="\\\\ud800"} 1.0\n' in response.read()
    finally:
        server.close()


def test_several_registries_make_one_page_and_openmetrics_is_served_when_asked() -> None:
    """A worker's job families, credit pool and repository are registries of their
    own: one page, each family once; a scraper asking for OpenMetrics gets it."""
    first, second = Metrics(), Metrics()
    first.counter("a_total", "A.").inc()
    second.gauge("b", "B.").set(2)
    server = MetricsServer([first.registry, second.registry], "127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{server.port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.read().decode() == first.render() + second.render()
        asked = urllib.request.Request(url, headers={"Accept": "application/openmetrics-text"})
        with urllib.request.urlopen(asked, timeout=10) as response:
            assert response.headers["Content-Type"].startswith("application/openmetrics-text")
            text = response.read().decode()
        assert "a_total 1.0" in text and "b 2.0" in text and text.endswith("# EOF\n")
    finally:
        server.close()


def test_observe_many_is_count_single_observations() -> None:
    """What it relies on of prometheus-client's histogram (private names) holds: the
    page after observe_many(v, n) is the page after n observe(v), at every bucket
    edge and between them."""
    weighted, single = Metrics(), Metrics()
    buckets = (0.001, 0.01, 0.1)
    many = weighted.histogram("h_seconds", "H.", ("model",), buckets).labels("m")
    one = single.histogram("h_seconds", "H.", ("model",), buckets).labels("m")
    for value, count in [(0.0005, 3), (0.001, 2), (0.005, 1), (0.01, 4), (0.5, 2), (7.0, 1)]:
        many.observe_many(value, count)
        for _ in range(count):
            one.observe(value)
    assert weighted.render() == single.render()
    assert weighted.value("h_seconds_count", model="m") == 13


def test_histogram_is_prometheus_clients() -> None:
    import prometheus_client

    assert issubclass(Histogram, prometheus_client.Histogram)
