"""``ipuserve gateway`` as a command: its variables, usage errors, a clean stop."""

from __future__ import annotations

import os
import signal
import subprocess
import urllib.request

import pytest

from tests.gateway.conftest import gateway_argv, start_gateway
from tests.helpers import Processes, start_broker

pytestmark = pytest.mark.slow


def test_options_are_read_from_their_variables(processes: Processes) -> None:
    broker = start_broker(processes, metrics=False)
    argv = gateway_argv(broker)
    del argv[argv.index("--http") : argv.index("--http") + 2]
    env = {**os.environ, "IPUSERVE_GATEWAY_HTTP": "0.0.0.0:0"}
    refused = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert refused.returncode != 0 and "--http 0.0.0.0:0 is reachable" in refused.stderr


def test_tls_cert_without_key_is_a_usage_error(processes: Processes) -> None:
    broker = start_broker(processes, metrics=False)
    argv = gateway_argv(broker, "--tls-cert", __file__)
    refused = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--tls-cert and --tls-key go together" in refused.stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_it_cleanly(processes: Processes, signum: signal.Signals) -> None:
    broker = start_broker(processes, metrics=False)
    gateway = start_gateway(processes, broker)
    with urllib.request.urlopen(gateway.url + "/v2/health/live", timeout=60) as response:
        assert response.status == 200
    gateway.proc.popen.send_signal(signum)
    assert gateway.proc.wait() == 0, gateway.proc.output()
    assert "stopping: closing the doors" in gateway.proc.output()
