"""``ipuserve health`` (the containers' check) against a real gateway's
``/v2/health/ready``, over plain HTTP and over HTTPS with a self-signed certificate:
trusted with ``--ca``, refused without, taken on trust with ``--insecure-tls``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.gateway.conftest import self_signed, start_gateway
from tests.helpers import (
    Processes,
    processes,  # noqa: F401  (a fixture)
    start_broker,
)

pytestmark = pytest.mark.slow


def health(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "ipuserve", "health", "--timeout-s", "20", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def test_health_of_a_gateway_over_http(processes: Processes) -> None:  # noqa: F811
    gateway = start_gateway(processes, start_broker(processes), "--grpc", "off")
    checked = health(f"{gateway.url}/v2/health/ready")
    assert (checked.returncode, checked.stdout.startswith("200 OK")) == (0, True), checked
    missing = health(f"{gateway.url}/v2/models/nothing/ready")  # no worker serves it
    assert missing.returncode == 1, missing
    assert missing.stderr.startswith("503 Service Unavailable: ") and "nothing" in missing.stderr


def test_health_of_a_gateway_over_https(
    processes: Processes,  # noqa: F811
    tmp_path: Path,
) -> None:
    cert, _key = self_signed(tmp_path)
    key = str(tmp_path / "key.pem")
    broker = start_broker(processes)
    gateway = start_gateway(processes, broker, "--tls-cert", str(cert), "--tls-key", key)
    url = f"{gateway.url}/v2/health/ready"
    assert url.startswith("https://")
    trusted = health(url, "--ca", str(cert))
    assert (trusted.returncode, trusted.stdout.startswith("200 OK")) == (0, True), trusted
    untrusted = health(url)
    assert untrusted.returncode == 1
    assert "cannot reach it" in untrusted.stderr and "CERTIFICATE_VERIFY_FAILED" in untrusted.stderr
    assert health(url, "--insecure-tls").returncode == 0
    both = health(url, "--insecure-tls", "--ca", str(cert))
    assert both.returncode == 2 and "exclude each other" in both.stderr
