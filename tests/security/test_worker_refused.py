"""A worker the broker refuses at the handshake says so at once, with the reason.

Real processes: a broker with keys (``ipuserve broker``) and ``ipuserve worker``
processes whose keys do not fit. A refused peer gets no answer, so the worker's own
connection monitor is all it learns from; it logs the refusal at ERROR and keeps
retrying (a SIGHUP may admit its key). The wait is on the log line itself; a worker
without the monitor only warned, every 30 s, that it had not joined and might be
refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ipuserve.security import generate_keypair
from tests.helpers import BrokerProc, Processes, runner_worker_argv, start_broker, write_example

pytestmark = pytest.mark.slow


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Key files: the broker's, an allowed worker's, a stranger's, another broker's."""
    keys = tmp_path / "keys"
    for role in ("clients", "workers"):
        (keys / role).mkdir(parents=True)
    for name in ("broker", "other-broker", "worker", "stranger"):
        generate_keypair(name, keys)
    (keys / "workers" / "worker.key").write_bytes((keys / "worker.key").read_bytes())
    return keys


def curve_broker(processes: Processes, keys: Path) -> BrokerProc:
    env = {
        "IPUSERVE_BROKER_CLIENT_KEYS": str(keys / "clients"),
        "IPUSERVE_BROKER_WORKER_KEYS": str(keys / "workers"),
    }
    options = ("--curve-secret-key", str(keys / "broker.key_secret"))
    return start_broker(processes, *options, env=env, ping_check=False)


@pytest.mark.parametrize(
    ("secret", "public", "said"),
    [
        ("stranger", "broker", r"ZAP status 400: its key \w{12} is not in .*--worker-keys"),
        ("worker", "other-broker", r"is --broker-public-key the broker's public key\?"),
        (None, None, r"another security mechanism"),
    ],
)
def test_a_refused_worker_logs_why_at_once_and_keeps_trying(
    processes: Processes,
    root: Path,
    tmp_path: Path,
    secret: str | None,
    public: str | None,
    said: str,
) -> None:
    model = write_example(tmp_path / "noop.popef", "noop", "--batch-size", "4", "--elements", "8")
    broker = curve_broker(processes, root)
    keys = () if secret is None else (
        "--curve-secret-key", str(root / f"{secret}.key_secret"),
        "--broker-public-key", str(root / f"{public}.key"),
    )  # fmt: skip
    argv = runner_worker_argv(model, args=("--name", "noop", *keys))
    worker = processes.start("worker", argv(broker.backend))
    worker.wait_for(r"ERROR .*the broker at \S+ refused this worker's connection: .*" + said)
    assert worker.popen.poll() is None  # still retrying
