"""The key options of every component: all or nothing, each mistake one clear line.

The end-to-end behaviour (peers served, refused, counted, SIGHUP) is
tests/integration/test_curve.py; here, what is decided before any socket connects.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zmq
from click.testing import CliRunner, Result

from ipuserve.broker.config import BrokerConfig
from ipuserve.broker.loop import Broker
from ipuserve.client import Client
from ipuserve.errors import ConfigError
from ipuserve.face.cli import main
from ipuserve.security import BACKEND_DOMAIN, FRONTEND_DOMAIN, Mode, Role, ZapHandler
from tests.security.conftest import Keys

LOOPBACK = "tcp://127.0.0.1:*"


def run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def key_file(keys: Keys, name: str, secret: bool = True) -> str:
    return str(keys.root / "keys" / f"{name}.key{'_secret' if secret else ''}")


def test_broker_key_folders_without_its_secret_key_are_a_usage_error(keys: Keys) -> None:
    result = run("broker", "--client-keys", str(keys.dirs[Role.CLIENT]),
                 "--worker-keys", str(keys.dirs[Role.WORKER]))  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "--client-keys and --worker-keys need --curve-secret-key" in result.output


@pytest.mark.parametrize("given", [Role.CLIENT, Role.WORKER])
def test_a_broker_with_keys_needs_the_client_and_the_worker_lists(keys: Keys, given: Role) -> None:
    missing = Role.WORKER if given is Role.CLIENT else Role.CLIENT
    result = run("broker", "--curve-secret-key", key_file(keys, "broker"),
                 f"--{given.value}-keys", str(keys.dirs[given]))  # fmt: skip
    assert result.exit_code == 2, result.output
    assert f"--curve-secret-key needs --{missing.value}-keys" in result.output


def test_admin_keys_alone_are_refused_too() -> None:
    with pytest.raises(ConfigError, match="admin_keys need curve_secret_key"):
        BrokerConfig(admin_keys="admins")


@pytest.mark.parametrize("how", ["option", "variable"])
def test_keys_and_insecure_together_are_a_usage_error(keys: Keys, how: str) -> None:
    """--insecure opens a keyless broker; with keys it would mean nothing (or worse,
    suggest keys were ignored), so the CLI refuses it, from the variable too."""
    argv = ["broker", "--frontend", LOOPBACK, "--backend", LOOPBACK,
            "--curve-secret-key", key_file(keys, "broker"),
            "--client-keys", str(keys.dirs[Role.CLIENT]),
            "--worker-keys", str(keys.dirs[Role.WORKER])]  # fmt: skip
    env = {"IPUSERVE_BROKER_INSECURE": "1"} if how == "variable" else {}
    result = CliRunner().invoke(main, argv + (["--insecure"] if how == "option" else []), env=env)
    assert result.exit_code == 2, result.output
    assert "--insecure and --curve-secret-key exclude each other" in result.output


def test_a_missing_allow_list_folder_stops_the_broker_naming_it(keys: Keys) -> None:
    result = run("broker", "--frontend", LOOPBACK, "--backend", LOOPBACK,
                 "--curve-secret-key", key_file(keys, "broker"),
                 "--client-keys", str(keys.root / "nowhere"),
                 "--worker-keys", str(keys.dirs[Role.WORKER]))  # fmt: skip
    assert result.exit_code == 1, result.output
    assert "nowhere" in result.output


@pytest.mark.parametrize("command", ["worker", "models", "infer", "bench"])
@pytest.mark.parametrize("given", ["--curve-secret-key", "--broker-public-key"])
def test_each_peer_command_takes_both_keys_or_neither(
    keys: Keys, tmp_path: Path, command: str, given: str
) -> None:
    """Half a configuration would talk plaintext to a broker that refuses it: a usage
    error naming the missing option, before a model loads or a socket connects."""
    np.save(tmp_path / "x.npy", np.zeros((1, 8), np.float32))
    extra = {
        "worker": ("--model", str(tmp_path / "m.popef")),
        "models": (),
        "infer": ("--model", "m", "--input", f"x={tmp_path / 'x.npy'}"),
        "bench": ("--model", "m"),
    }[command]
    path = key_file(keys, "client") if given == "--curve-secret-key" else key_file(keys, "broker")
    result = run(command, "--broker", "tcp://127.0.0.1:1", *extra, given, path)
    missing = ({"--curve-secret-key", "--broker-public-key"} - {given}).pop()
    assert result.exit_code == 2, result.output
    assert f"{given} needs {missing} too" in result.output


def test_the_bench_suite_takes_no_keys(keys: Keys) -> None:
    result = run("bench", "--suite", "fabric", "--curve-secret-key", key_file(keys, "client"))
    assert result.exit_code == 2, result.output
    assert "--curve-secret-key" in result.output


def test_a_client_given_one_key_names_the_other() -> None:
    with pytest.raises(ConfigError, match="curve_secret_key needs broker_public_key"):
        Client("tcp://127.0.0.1:1", curve_secret_key=b"x" * 40)
    with pytest.raises(ConfigError, match="broker_public_key needs curve_secret_key"):
        Client("tcp://127.0.0.1:1", broker_public_key=b"x" * 40)


def test_a_client_given_a_public_file_for_its_secret_says_so(keys: Keys) -> None:
    with pytest.raises(ConfigError, match="holds no secret key"):
        Client(
            "tcp://127.0.0.1:1",
            curve_secret_key=key_file(keys, "client", secret=False),
            broker_public_key=key_file(keys, "broker", secret=False),
        )


def test_a_broker_without_keys_runs_protected_and_one_with_keys_stops_its_own(
    keys: Keys, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """Keyless, the handler judges every peer by address (protected mode; every
    address with insecure); with keys by key. Each broker's handler is gone with it,
    so another can start on the same context."""
    for insecure, mode in ((False, Mode.PROTECTED), (True, Mode.INSECURE)):
        plain = Broker(
            BrokerConfig(frontend=LOOPBACK, backend=LOOPBACK, insecure=insecure), context=context
        )
        assert plain.zap is not None and plain.zap.mode is mode
        assert plain._frontend.zap_domain == FRONTEND_DOMAIN.encode()
        assert plain._backend.zap_domain == BACKEND_DOMAIN.encode()
        assert not plain._frontend.curve_server
        plain.stop()
        plain.run()
    config = BrokerConfig(
        frontend=LOOPBACK,
        backend=LOOPBACK,
        curve_secret_key=key_file(keys, "broker"),
        client_keys=str(keys.dirs[Role.CLIENT]),
        worker_keys=str(keys.dirs[Role.WORKER]),
    )
    for _ in range(2):  # the second start proves the first handler let go of the context
        broker = Broker(config, context=context)
        assert broker.zap is not None
        assert broker._frontend.curve_server and broker._backend.curve_server
        broker.stop()
        broker.run()


def test_a_zap_handler_can_start_again_on_its_context_as_soon_as_it_stopped(
    context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """stop() frees the ZAP endpoint before it returns (close() alone frees an inproc
    endpoint later, on ZeroMQ's reaper thread: about one restart in two then failed).
    400 handlers one after the other, each collected before the next is made: when the
    control endpoint was named by id(self), a new handler could get a collected one's
    id while that endpoint was still held, and its start failed "address in use" (once
    in a full run; within 400 restarts here, before the fix)."""
    for _ in range(400):
        handler = ZapHandler(context, None)
        handler.start()
        handler.stop()
        del handler  # collected now: the next handler may be given its id
