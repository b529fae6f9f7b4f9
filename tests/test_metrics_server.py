"""The /metrics endpoint over real HTTP on loopback: GET, HEAD (what some health
checkers send; it once answered 501), and 404 elsewhere."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from ipuserve.metrics import MetricsServer
from tests.helpers import (
    Processes,
    processes,  # noqa: F401  (a fixture)
    start_broker,
)

PAGE = "# HELP x_total X.\n# TYPE x_total counter\nx_total 3\n"


class Page:
    def render(self) -> str:
        return PAGE


@pytest.fixture
def url() -> Iterator[str]:
    server = MetricsServer(Page(), "127.0.0.1", 0)
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
    """A lone surrogate in a label once made every scrape fail (UnicodeEncodeError)."""

    class Odd:
        def render(self) -> str:
            return 'x_total{model="\ud800"} 1\n'

    server = MetricsServer(Odd(), "127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{server.port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.read() == b'x_total{model="\\ud800"} 1\n'
    finally:
        server.close()
