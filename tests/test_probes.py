"""Health probes over real HTTP: /healthz and /ready of a real broker and a real
worker process (the worker's /ready follows its registration), and ``ipuserve
health``, the check a container runs, against them and against a closed port."""

from __future__ import annotations

import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter

from ipuserve.bench.processes import free_port
from ipuserve.broker.config import BrokerConfig
from ipuserve.broker.loop import Broker
from ipuserve.metrics import MetricsServer
from ipuserve.probes import Probe
from tests.helpers import (
    START_TIMEOUT,
    Processes,
    processes,  # noqa: F401  (a fixture)
    restart_broker,
    runner_worker_argv,
    start_broker,
    wait_registered,
    wait_until,
    write_example,
)


def get(url: str) -> tuple[int, str]:
    """The status and body of GET ``url`` (an error status too)."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read().decode()


def health(*args: str) -> subprocess.CompletedProcess[str]:
    """``ipuserve health ARGS`` as a container runs it: a real process."""
    argv = [sys.executable, "-m", "ipuserve", "health", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def page() -> CollectorRegistry:
    registry = CollectorRegistry()
    Counter("x_total", "X.", registry=registry).inc()
    return registry


def test_probes_answer_beside_the_metrics_and_follow_their_owner() -> None:
    """A probe's (ok, reason) is the status and body; the dict is read per request, so
    an owner fills it once it knows its state; a probe that raises answers 503."""
    state = {"ready": False}

    def ready() -> tuple[bool, str]:
        return (True, "ok") if state["ready"] else (False, "not registered\nwith any broker")

    def broken() -> tuple[bool, str]:
        raise RuntimeError("boom")

    probes: dict[str, Probe] = {"/ready": ready}
    server = MetricsServer(page(), "127.0.0.1", 0, probes)
    url = f"http://127.0.0.1:{server.port}"
    try:
        assert get(f"{url}/ready") == (503, "not registered with any broker\n")
        state["ready"] = True
        assert get(f"{url}/ready?verbose=1") == (200, "ok\n")
        assert get(f"{url}/healthz")[0] == 404  # none given
        probes["/healthz"] = broken
        status, body = get(f"{url}/healthz")
        assert (status, body.startswith("the probe failed: RuntimeError('boom')")) == (503, True)
        assert get(f"{url}/metrics")[1].endswith("\nx_total 1.0\n")  # the page is unchanged
        head = urllib.request.Request(f"{url}/ready", method="HEAD")
        with urllib.request.urlopen(head, timeout=10) as response:
            assert (response.status, response.read()) == (200, b"")
    finally:
        server.close()


def test_a_broker_is_neither_live_nor_ready_before_its_loop_runs() -> None:
    """Bound is not serving: between construction and run() (or after a crash of the
    loop) both probes say why; once the loop turns, both are ok."""
    config = BrokerConfig(frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*", metrics_port=0)
    broker = Broker(config)
    assert broker.metrics_server is not None
    url = f"http://127.0.0.1:{broker.metrics_server.port}"
    thread = threading.Thread(target=broker.run, name="broker")
    try:
        assert get(f"{url}/healthz") == (503, "the broker's loop is not running\n")
        assert get(f"{url}/ready") == (503, "the broker's loop has not started\n")
        thread.start()
        wait_until(lambda: get(f"{url}/ready")[0] == 200, START_TIMEOUT)
        assert get(f"{url}/healthz") == (200, "ok\n")
    finally:
        broker.stop()
        if thread.is_alive():
            thread.join(timeout=30)
        else:
            broker.run()  # never started: run() sees the stop and closes everything


@pytest.mark.slow
def test_a_broker_is_live_and_ready_while_it_serves(processes: Processes) -> None:  # noqa: F811
    broker = start_broker(processes)
    url = f"http://127.0.0.1:{broker.metrics_port}"
    assert get(f"{url}/healthz") == (200, "ok\n")
    assert get(f"{url}/ready") == (200, "ok\n")
    checked = health(f"{url}/ready", "--timeout-s", "10")
    assert (checked.returncode, checked.stdout, checked.stderr) == (0, "200 OK: ok\n", "")


@pytest.mark.slow
def test_a_worker_is_ready_while_registered_with_a_broker(
    processes: Processes,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Not ready until a broker takes it, ready then, not ready once that broker is
    gone (kill -9), ready again with its successor; live all along."""
    model = write_example(tmp_path / "mlp.popef", "mlp", "--input-size", "8", "--hidden-size", "8")
    backend = f"tcp://127.0.0.1:{free_port()}"
    args = ("--metrics-port", "0", "--metrics-host", "127.0.0.1", "--reconnect-max-ms", "200")
    worker = processes.start("worker", runner_worker_argv(model, args=args)(backend))
    url = worker.wait_for(r"ipuserve worker: metrics on (http://\S+)/metrics", 60)[1]

    def not_registered() -> bool:
        status, body = get(f"{url}/ready")
        return status == 503 and body.startswith("not registered with any broker")

    wait_until(not_registered, START_TIMEOUT)  # "starting" for a moment before
    assert get(f"{url}/healthz") == (200, "ok\n")
    checked = health(f"{url}/ready")
    assert checked.returncode == 1
    assert checked.stderr.startswith("503 Service Unavailable: not registered with any broker")

    broker = start_broker(processes, backend=backend)
    wait_registered(worker, broker)
    assert get(f"{url}/ready") == (200, "ok\n")
    assert health(f"{url}/ready").returncode == 0

    since = worker.mark()
    broker.proc.kill()
    wait_until(not_registered, START_TIMEOUT)  # its liveness ran out
    assert get(f"{url}/healthz") == (200, "ok\n")
    successor = restart_broker(processes, broker)
    wait_registered(worker, successor, since)
    assert get(f"{url}/ready") == (200, "ok\n")


def test_health_says_why_when_nothing_listens() -> None:
    url = f"http://127.0.0.1:{free_port()}/ready"
    checked = health(url, "--timeout-s", "10")
    assert checked.returncode == 1
    assert checked.stderr == f"{url}: cannot reach it: Connection refused\n"
    assert checked.stdout == ""


def test_health_refuses_what_is_not_an_http_url() -> None:
    checked = health("tcp://127.0.0.1:5555")
    assert checked.returncode == 2
    assert "is not an http:// or https:// URL" in checked.stderr


def test_health_starts_without_the_other_commands() -> None:
    """It runs every few seconds in every container: the fabric's modules (ZeroMQ,
    numpy, the gateway's servers) stay unimported, where they cost ~0.4 s a check."""
    url = f"http://127.0.0.1:{free_port()}/ready"
    argv = [sys.executable, "-X", "importtime", "-m", "ipuserve", "health", url]
    checked = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert checked.returncode == 1
    imported = {
        line.rsplit("|", 1)[-1].strip()
        for line in checked.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "ipuserve.face.health" in imported
    heavy = ("ipuserve.face.cli", "ipuserve.broker", "ipuserve.gateway", "zmq", "numpy", "aiohttp")
    assert {m for m in imported if m.startswith(heavy)} == set()
