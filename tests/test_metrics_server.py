"""The /metrics endpoint over real HTTP on loopback: GET, HEAD (what some health
checkers send; it once answered 501), and 404 elsewhere."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from ipuserve.metrics import MetricsServer

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
