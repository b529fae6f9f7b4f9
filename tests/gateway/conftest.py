"""The gateway's test fabric: a real broker, real ``ipuserve worker`` processes serving
the example ``mlp`` and ``simple`` models (with their numpy references), and real
``ipuserve gateway`` processes on free ports. Every process is killed at teardown."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ipuserve.runtime.popef import examples, load_model
from tests.helpers import (
    START_TIMEOUT,
    BrokerProc,
    Proc,
    Processes,
    runner_worker_argv,
    start_broker,
    start_worker,
    wait_until,
)

#: one gateway's start line, or a supervisor's (``--processes N``: "N processes, " first)
_STARTED = r"ipuserve gateway: (?:\d+ processes, )?http (https?)://(\S+):(\d+), grpc (\S+),"


@dataclass
class Model:
    """An example model served by the fabric, and its numpy reference."""

    name: str
    path: str
    weights: dict[str, np.ndarray[Any, Any]]

    def reference(self, inputs: dict[str, np.ndarray[Any, Any]]) -> dict[str, np.ndarray[Any, Any]]:
        return examples.reference(self.name, inputs, self.weights)


@dataclass
class Fabric:
    procs: Processes
    broker: BrokerProc
    models: dict[str, Model]
    workers: list[Proc]


@dataclass
class GatewayProc:
    proc: Proc
    url: str  # http://127.0.0.1:PORT
    host_port: str  # 127.0.0.1:PORT, as tritonclient takes it
    grpc: str | None
    argv: list[str]


def gateway_argv(broker: BrokerProc, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "ipuserve",
        "--log-level",
        "INFO",
        "gateway",
        "--broker",
        broker.frontend,
        "--http",
        "127.0.0.1:0",
        "--grpc",
        "127.0.0.1:0",
        *args,
    ]


def start_gateway(
    procs: Processes, broker: BrokerProc, *args: str, name: str = "gateway"
) -> GatewayProc:
    """``ipuserve gateway`` on a free port; ready once it printed its start-up line."""
    argv = gateway_argv(broker, *args)
    return started_gateway(procs.start(name, argv), argv)


def started_gateway(proc: Proc, argv: list[str], timeout: float = START_TIMEOUT) -> GatewayProc:
    """The gateway ``proc`` runs, once it printed its start-up line."""
    found = proc.wait_for(_STARTED, timeout)
    host_port = f"{found[2]}:{found[3]}"
    grpc = None if found[4] == "off" else found[4]
    return GatewayProc(proc, f"{found[1]}://{host_port}", host_port, grpc, argv)


def restart_gateway(procs: Processes, old: GatewayProc, name: str = "gateway2") -> GatewayProc:
    """Stop ``old`` (SIGTERM) and start the same command line on the same port."""
    old.proc.terminate()
    assert old.proc.wait() == 0, old.proc.output()
    argv = list(old.argv)
    argv[argv.index("--http") + 1] = old.host_port
    return started_gateway(procs.start(name, argv), argv)


def _write_models(directory: Path) -> dict[str, Model]:
    builders = {
        "mlp": examples.mlp(batch_size=16, input_size=64, hidden_size=96),
        "simple": examples.simple(batch_size=4),
    }
    found = {}
    for name, builder in builders.items():
        [path] = builder.write(directory / f"{name}.popef")
        model = load_model([str(path)])
        found[name] = Model(name, str(path), examples.tensor_arrays(model))
    return found


@pytest.fixture(autouse=True)
def _collect_clients_here() -> Iterator[None]:
    """Collect the test's garbage on the main thread when it ends: tritonclient's sync
    client closes its gevent pool in ``__del__``, which fails (an unraisable error that
    fails the run) when a collection happens to run on another thread, such as a later
    test's load thread."""
    yield
    gc.collect()


#: what the fabric sets for its workers, and puts back after
_SIM_ENV = ("IPUSERVE_SIM_LOCK_DIR", "IPUSERVE_SIM_IPUS", "IPUSERVE_SIM_TIME_SCALE")


@pytest.fixture(scope="module")
def fabric(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fabric]:
    """One broker and one worker per example model, for the module's tests."""
    procs = Processes()
    # Module-scoped: it starts before the per-test private IPU inventory
    # (tests/conftest.py), so it takes one of its own; the machine-wide one is shared
    # with whatever else runs here, and another run's workers would hold its IPUs.
    saved = {key: os.environ.get(key) for key in _SIM_ENV}
    os.environ["IPUSERVE_SIM_LOCK_DIR"] = str(tmp_path_factory.mktemp("fabric-ipu-locks"))
    os.environ["IPUSERVE_SIM_IPUS"] = "4"
    os.environ["IPUSERVE_SIM_TIME_SCALE"] = os.environ.get("IPUSERVE_TEST_TIME_SCALE", "0")
    try:
        models = _write_models(tmp_path_factory.mktemp("models"))
        broker = start_broker(procs)
        workers = [
            start_worker(procs, broker, runner_worker_argv(m.path), name=f"worker-{m.name}")
            for m in models.values()
        ]
        yield Fabric(procs, broker, models, workers)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        procs.close()
        print(f"--- output of the fabric's processes ---\n{procs.output()}")


def wait_ready(gateway: GatewayProc, timeout: float = 60.0) -> None:
    """Wait until the gateway says it is ready (its client reached a broker): the
    start-up line comes once the doors listen, which can be before that."""

    def ready() -> bool:
        try:
            with urllib.request.urlopen(gateway.url + "/v2/health/ready", timeout=timeout):
                return True
        except urllib.error.HTTPError as exc:
            exc.close()
            return False

    wait_until(ready, timeout=timeout)


@pytest.fixture(scope="module")
def gateway(fabric: Fabric) -> GatewayProc:
    """A gateway with no tokens, in front of the module's fabric, ready."""
    started = start_gateway(fabric.procs, fabric.broker)
    wait_ready(started)
    return started


def mlp_input(samples: int, seed: int = 0) -> np.ndarray[Any, Any]:
    """``samples`` rows of the mlp's input (64 features)."""
    return np.random.default_rng(seed).standard_normal((samples, 64)).astype(np.float32)


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost, and its key, made with the openssl
    command (the test is skipped, with the reason, where there is none)."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a certificate with")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    return cert, key
