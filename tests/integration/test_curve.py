"""CURVE end to end: a broker with keys, real ``ipuserve worker`` processes, real Clients.

Keys are made by ``ipuserve keys generate`` into the test's folder, as an operator
would. Every wait is on something observable: a log line, a registration, a reply,
a metric; a refused peer is waited for through the broker's refusal counter.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ipuserve import protocol as wire
from ipuserve.client import AsyncClient, Client
from ipuserve.errors import HandshakeRefusedError
from tests.helpers import (
    BrokerProc,
    Processes,
    RawClient,
    metric,
    runner_worker_argv,
    scrape,
    start_broker,
    start_worker,
    wait_until,
    write_example,
)

pytestmark = pytest.mark.slow

REFUSED = "ipuserve_broker_refused_handshakes_total"
#: a refused client's request fails at once (HandshakeRefusedError); this bounds a
#: raw socket's wait for an answer that never comes
REFUSED_TIMEOUT_S = 1.0


@dataclass
class KeyDirs:
    """Key files made by ``ipuserve keys generate`` and the broker's allow-lists."""

    root: Path

    def generate(self, name: str, into: str | None = None) -> Path:
        """``ipuserve keys generate NAME``; its public file copied into the allow-list
        ``into`` (clients, workers, admins). The secret file's path."""
        subprocess.run(
            [sys.executable, "-m", "ipuserve", "keys", "generate", name, "--dir", str(self.root)],
            check=True,
            capture_output=True,
        )
        if into is not None:
            shutil.copy(self.root / f"{name}.key", self.root / into / f"{name}.key")
        return self.secret(name)

    def secret(self, name: str) -> Path:
        return self.root / f"{name}.key_secret"

    @property
    def broker_public(self) -> Path:
        return self.root / "broker.key"

    def peer_options(self, name: str) -> tuple[str, ...]:
        return ("--curve-secret-key", str(self.secret(name)), "--broker-public-key",
                str(self.broker_public))  # fmt: skip


@pytest.fixture
def keys(tmp_path: Path) -> KeyDirs:
    root = tmp_path / "keys"
    for folder in ("clients", "workers", "admins"):
        (root / folder).mkdir(parents=True)
    made = KeyDirs(root)
    made.generate("broker")
    made.generate("client", into="clients")
    made.generate("worker", into="workers")
    made.generate("admin", into="admins")
    made.generate("stranger")  # in no list
    return made


def start_curve_broker(
    procs: Processes, keys: KeyDirs, counts: str = "1 client key, 1 worker key"
) -> BrokerProc:
    """``ipuserve broker`` with keys (the allow-lists from environment variables, as a
    deployment gives them); it says it runs CURVE, with ``counts`` keys and 1 admin key.
    Its liveness is the CLI's default (3 s), not the fast 400 ms of other tests: no test
    here waits for a silent worker to be dropped, and these count the workers' joins, which
    a loaded machine's late heartbeat would double (a flake seen 1 run in 5)."""
    env = {
        "IPUSERVE_BROKER_CLIENT_KEYS": str(keys.root / "clients"),
        "IPUSERVE_BROKER_WORKER_KEYS": str(keys.root / "workers"),
        "IPUSERVE_BROKER_ADMIN_KEYS": str(keys.root / "admins"),
    }
    options = ("--curve-secret-key", str(keys.secret("broker")))
    broker = start_broker(procs, *options, env=env, ping_check=False, liveness_ms=3000)
    broker.proc.wait_for(rf"security: CURVE, peers admitted by key: {counts}, 1 admin key")
    return broker


def admin_only_broker(procs: Processes, tmp_path: Path, peer: str) -> tuple[KeyDirs, BrokerProc]:
    """A CURVE broker, a key ``peer`` in its client list (no admin) and a key ``admin`` in
    its admin list: what the repository's permission tests start from."""
    root = tmp_path / "keys"
    for folder in ("clients", "workers", "admins"):
        (root / folder).mkdir(parents=True)
    keys = KeyDirs(root)
    keys.generate("broker")
    keys.generate(peer, into="clients")
    keys.generate("admin", into="admins")
    return keys, start_curve_broker(procs, keys, counts="1 client key, 0 worker keys")


def client(broker: BrokerProc, keys: KeyDirs, name: str, timeout: float = 20.0) -> Client:
    return Client(
        broker.frontend,
        timeout=timeout,
        curve_secret_key=str(keys.secret(name)),
        broker_public_key=str(keys.broker_public),
    )


async def async_face(broker: BrokerProc, keys: KeyDirs) -> None:
    """An AsyncClient with the client's keys is served; one without is told why not."""
    secret, public = str(keys.secret("client")), str(keys.broker_public)
    async with AsyncClient(
        broker.frontend, timeout=20, curve_secret_key=secret, broker_public_key=public
    ) as good:
        given = np.random.default_rng(9).standard_normal((3, 8)).astype(np.float32)
        outputs = await good.infer("noop", {"input": given})
        np.testing.assert_array_equal(outputs["output"], given)
    async with AsyncClient(broker.frontend, timeout=3 * REFUSED_TIMEOUT_S) as keyless:
        with pytest.raises(HandshakeRefusedError, match="curve_secret_key and broker_public_key"):
            await keyless.infer("noop", {"input": np.zeros((1, 8), np.float32)})


def refused(broker: BrokerProc, socket: str) -> float:
    return scrape(broker.metrics_url).get(f'{REFUSED}{{socket="{socket}"}}', 0.0)


def assert_served(c: Client, seed: int) -> None:
    """One request to the noop model (output = input): the numpy reference is the input."""
    given = np.random.default_rng(seed).standard_normal((3, 8)).astype(np.float32)
    outputs = c.infer("noop", {"input": given})
    np.testing.assert_array_equal(outputs["output"], given)


def models_cli(broker: BrokerProc, keys: KeyDirs, name: str) -> list[dict[str, Any]]:
    """``ipuserve models --json`` with ``name``'s key, from environment variables."""
    env = {
        **os.environ,
        "IPUSERVE_MODELS_CURVE_SECRET_KEY": str(keys.secret(name)),
        "IPUSERVE_MODELS_BROKER_PUBLIC_KEY": str(keys.broker_public),
    }
    done = subprocess.run(
        [sys.executable, "-m", "ipuserve", "models", "--broker", broker.frontend, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    listed: list[dict[str, Any]] = json.loads(done.stdout)
    return listed


def test_allow_listed_peers_are_served_and_others_refused_and_counted(
    processes: Processes, keys: KeyDirs, tmp_path: Path
) -> None:
    model = write_example(tmp_path / "noop.popef", "noop", "--batch-size", "4", "--elements", "8")
    broker = start_curve_broker(processes, keys)
    worker_args = ("--name", "noop", "--worker-id", "good", *keys.peer_options("worker"))
    start_worker(processes, broker, runner_worker_argv(model, args=worker_args))

    with client(broker, keys, "client") as good:
        assert_served(good, seed=0)

        # a client without CURVE: refused on the mechanism, before ZAP, counted too
        with RawClient(broker.frontend) as plain:
            plain.send(wire.Ping(b"plain"))
            wait_until(lambda: refused(broker, "frontend") >= 1, timeout=20)
            with pytest.raises(TimeoutError):
                plain.recv(timeout=REFUSED_TIMEOUT_S)
        broker.proc.wait_for(r"refused a peer on the frontend socket: a peer ")
        before = refused(broker, "frontend")

        # a Client without keys is told why it hears nothing
        with (
            Client(broker.frontend, timeout=REFUSED_TIMEOUT_S) as keyless,
            pytest.raises(HandshakeRefusedError, match="curve_secret_key and broker_public_key"),
        ):
            keyless.infer("noop", {"input": np.zeros((1, 8), np.float32)})
        asyncio.run(async_face(broker, keys))  # the asyncio face: the same, told the same
        before = refused(broker, "frontend")

        # an unknown key: the handshake is refused, the request never answered
        with client(broker, keys, "stranger", timeout=REFUSED_TIMEOUT_S) as stranger:
            with pytest.raises(HandshakeRefusedError, match=r"refused this client .*allow-lists"):
                stranger.infer("noop", {"input": np.zeros((1, 8), np.float32)})
            assert_served(good, seed=1)  # meanwhile the allowed client is served
        wait_until(lambda: refused(broker, "frontend") > before, timeout=20)
        broker.proc.wait_for(r"refused a peer on the frontend socket: key \w{12} not in")

        # a worker presenting a client's key is refused on the backend: it never
        # registers, and nobody's request is sent to it
        thief = runner_worker_argv(model, args=("--name", "noop", "--worker-id", "thief",
                                                *keys.peer_options("client")))  # fmt: skip
        thief_proc = processes.start("thief", thief(broker.backend))
        wait_until(lambda: refused(broker, "backend") >= 1, timeout=60)
        thief_proc.wait_for(r"refused this worker's connection: ZAP status 400: its key")
        for name in ("admin", "client"):  # MODELS is open to clients and admins
            (info,) = models_cli(broker, keys, name)
            assert [w["worker_id"] for w in info["workers"]] == ["good"]
        assert_served(good, seed=2)
    # (its "has not joined the broker" warning may come too, on a slow machine)
    assert not re.search(r"worker \S+ joined the broker", thief_proc.output())
    bench = subprocess.run(
        [sys.executable, "-m", "ipuserve", "bench", "--broker", broker.frontend, "--model",
         "noop", "--concurrency", "4", "--requests", "40", "--warmup-s", "0", "--json",
         *keys.peer_options("client")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bench.returncode == 0, bench.stderr
    assert json.loads(bench.stdout)["errors"] == {}
    samples = scrape(broker.metrics_url)
    assert metric(samples, "ipuserve_broker_admitted_handshakes_total") >= 3
    assert samples['ipuserve_broker_allowed_keys{role="client"}'] == 1


def test_a_key_added_to_the_allow_list_is_admitted_after_sighup_without_a_restart(
    processes: Processes, keys: KeyDirs, tmp_path: Path
) -> None:
    model = write_example(tmp_path / "noop.popef", "noop", "--batch-size", "4", "--elements", "8")
    broker = start_curve_broker(processes, keys)
    worker_args = ("--name", "noop", *keys.peer_options("worker"))
    worker = start_worker(processes, broker, runner_worker_argv(model, args=worker_args))
    keys.generate("newcomer")  # not allowed yet
    with client(broker, keys, "client") as old:
        assert_served(old, seed=0)
        with (
            client(broker, keys, "newcomer", timeout=REFUSED_TIMEOUT_S) as early,
            pytest.raises(HandshakeRefusedError),
        ):
            early.infer("noop", {"input": np.zeros((1, 8), np.float32)})

        shutil.copy(keys.root / "newcomer.key", keys.root / "clients" / "newcomer.key")
        mark = broker.proc.mark()
        os.kill(broker.proc.pid, signal.SIGHUP)
        broker.proc.wait_for(r"allow-lists reloaded: .*2 client keys", since=mark)

        with client(broker, keys, "newcomer") as newcomer:
            assert_served(newcomer, seed=1)
        assert_served(old, seed=2)  # its connection was never dropped
    assert old.stats.reconnects == 0
    assert broker.proc.popen.poll() is None  # SIGHUP did not end it
    assert "joined the broker" in worker.output()
    assert worker.output().count("joined the broker") == 1  # nor the worker's connection
