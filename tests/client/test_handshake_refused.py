"""A broker that refuses the client's handshake is reported at once, with the reason.

Real brokers with CURVE keys (``ipuserve broker`` processes, keys from
``ipuserve.security.generate_keypair``), real Clients and AsyncClients. Each refused
request is given a 60 s timeout: before the client watched its connection monitor it
failed only then, with DeadlineExceeded. No time is measured: a refusal that took the
timeout would raise DeadlineExceeded, not HandshakeRefusedError.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from ipuserve.errors import HandshakeRefusedError
from ipuserve.security import generate_keypair
from tests.client.faces import MakeClient
from tests.helpers import (
    BrokerProc,
    Processes,
    runner_worker_argv,
    start_broker,
    start_worker,
    write_example,
)

pytestmark = pytest.mark.slow

#: far beyond the refusal, which comes within a reconnection or two
TIMEOUT_S = 60.0


@dataclass
class Keys:
    """Key files: two brokers', an allowed client's and worker's, a stranger's."""

    root: Path

    def secret(self, name: str) -> Path:
        return self.root / f"{name}.key_secret"

    def public(self, name: str) -> Path:
        return self.root / f"{name}.key"


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    root = tmp_path / "keys"
    for role in ("clients", "workers", "admins"):
        (root / role).mkdir(parents=True)
    for name in ("broker", "other-broker", "client", "worker", "stranger"):
        generate_keypair(name, root)
    made = Keys(root)
    for name, role in (("client", "clients"), ("worker", "workers")):
        (root / role / f"{name}.key").write_bytes(made.public(name).read_bytes())
    return made


def curve_broker(procs: Processes, keys: Keys, name: str) -> BrokerProc:
    env = {f"IPUSERVE_BROKER_{role.upper()}_KEYS": str(keys.root / f"{role}s")
           for role in ("client", "worker", "admin")}  # fmt: skip
    options = ("--curve-secret-key", str(keys.secret(name)))
    return start_broker(procs, *options, env=env, ping_check=False)


def given(seed: int) -> dict[str, np.ndarray]:
    return {"input": np.random.default_rng(seed).standard_normal((3, 8)).astype(np.float32)}


def test_a_wrong_broker_public_key_fails_at_once_naming_it(
    processes: Processes, keys: Keys, make_client: MakeClient
) -> None:
    broker = curve_broker(processes, keys, "broker")
    with make_client(
        broker.frontend,
        timeout=TIMEOUT_S,
        curve_secret_key=str(keys.secret("client")),
        broker_public_key=str(keys.public("other-broker")),
    ) as client:
        with pytest.raises(HandshakeRefusedError, match=r"broker_public_key .*--broker-public-key"):
            client.infer("noop", given(0))
        with pytest.raises(HandshakeRefusedError, match=broker.frontend):  # a new one too
            client.infer("noop", given(1))


def test_a_client_key_not_allowed_fails_at_once_with_the_zap_status(
    processes: Processes, keys: Keys, make_client: MakeClient
) -> None:
    broker = curve_broker(processes, keys, "broker")
    with (
        make_client(
            broker.frontend,
            timeout=TIMEOUT_S,
            curve_secret_key=str(keys.secret("stranger")),
            broker_public_key=str(keys.public("broker")),
        ) as client,
        pytest.raises(HandshakeRefusedError, match=r"ZAP status 400.*allow-lists"),
    ):
        client.infer("noop", given(0))


def test_a_keyless_client_at_a_broker_with_keys_fails_at_once(
    processes: Processes, keys: Keys, make_client: MakeClient
) -> None:
    broker = curve_broker(processes, keys, "broker")
    # the broker may drop the handshake before it says why: either names the keys
    named = "curve_secret_key and broker_public_key"
    with (
        make_client(broker.frontend, timeout=TIMEOUT_S) as client,
        pytest.raises(HandshakeRefusedError, match=named),
    ):
        client.infer("noop", given(0))


def test_with_two_brokers_only_the_refusing_one_is_left_out(
    processes: Processes, keys: Keys, make_client: MakeClient, tmp_path: Path
) -> None:
    """The client has the first broker's public key only: the second drops every
    handshake, and every request is served by the first, as numpy says."""
    model = write_example(tmp_path / "noop.popef", "noop", "--batch-size", "4", "--elements", "8")
    serving = curve_broker(processes, keys, "broker")
    refusing = curve_broker(processes, keys, "other-broker")
    worker_keys = ("--curve-secret-key", str(keys.secret("worker")),
                   "--broker-public-key", str(keys.public("broker")))  # fmt: skip
    argv = runner_worker_argv(model, args=("--name", "noop", *worker_keys))
    start_worker(processes, serving, argv)
    with make_client(
        [serving.frontend, refusing.frontend],
        timeout=TIMEOUT_S,
        curve_secret_key=str(keys.secret("client")),
        broker_public_key=str(keys.public("broker")),
    ) as client:
        for seed in range(8):
            inputs = given(seed)
            outputs = client.infer("noop", inputs)
            np.testing.assert_array_equal(outputs["output"], inputs["input"])
        usable = {link.endpoint: link.usable for link in client.links()}
        assert usable == {serving.frontend: True, refusing.frontend: False}
