"""``ipuserve models load | unload | index`` through click's CliRunner, against the fake
broker (a real ROUTER) answering as a broker with repository workers does."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from ipuserve import protocol as wire
from ipuserve.face.cli import main
from tests.client.fake_broker import (
    FakeBroker,
    ScriptedRepository,
    answered_by,
    inputs,
    scripted_broker,
)


@pytest.fixture
def broker() -> Iterator[FakeBroker]:
    with scripted_broker() as fake:
        yield fake


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_load_waits_until_ready_and_shows_the_models_versions(broker: FakeBroker) -> None:
    code, out, _ = invoke("models", "load", "mlp", "--version", "2", "--broker", broker.address)
    assert code == 0, out
    rows = {line.split()[1]: line.split()[2:] for line in out.splitlines()[2:]}
    assert rows["2"][0] == "READY" and rows["1"][0] == "READY"
    load = broker.commands[0]
    assert (load.action, load.model, load.version, load.workers) == ("load", "mlp", "2", None)
    assert len(broker.commands) > 1  # it asked the index until READY


def test_load_no_wait_sends_the_command_and_prints_the_answer_as_json(broker: FakeBroker) -> None:
    args = ["--replicas", "2", "--workers", "1", "--no-wait", "--json"]
    code, out, _ = invoke("models", "load", "mlp", *args, "--broker", broker.address)
    assert code == 0, out
    found = json.loads(out)
    assert found["message"] == "load done"
    assert {m["version"]: m["state"] for m in found["models"]} == {"1": "READY", "2": "LOADING"}
    (load,) = broker.commands
    assert (load.version, load.replicas, load.workers) == (None, 2, 1)


def test_unload_and_index_show_the_states_with_their_reasons(broker: FakeBroker) -> None:
    code, _, _ = invoke("models", "unload", "mlp", "--version", "1", "--broker", broker.address)
    assert code == 0
    code, out, _ = invoke("models", "index", "--broker", broker.address)
    assert code == 0
    assert "UNAVAILABLE        0  unloaded" in out
    assert "UNAVAILABLE        0  not loaded" in out


def test_a_refusal_is_a_one_line_error_with_its_code(broker: FakeBroker) -> None:
    assert isinstance(broker.repository, ScriptedRepository)
    refusal = "a client key may not change the fleet: admin role only"
    broker.repository.refusal = wire.ErrorReply(b"", "PERMISSION_DENIED", refusal)
    code, _, err = invoke("models", "load", "mlp", "--broker", broker.address)
    assert code == 1
    assert err.strip() == f"Error: [PERMISSION_DENIED] {refusal}"


def test_models_alone_still_lists_the_models_and_needs_a_broker(broker: FakeBroker) -> None:
    code, out, _ = invoke("models", "--broker", broker.address)
    assert code == 0 and out.splitlines()[2].startswith("add")
    code, _, err = invoke("models")
    assert code == 2 and "Missing option '--broker'" in err


def test_infer_asks_for_a_version_and_says_which_answered(
    broker: FakeBroker, tmp_path: Path
) -> None:
    broker.handler = answered_by("2")
    given = inputs(2)
    args = ["infer", "--broker", broker.address, "--model", "add", "--version", "2"]
    for name, array in given.items():
        np.save(tmp_path / f"{name}.npy", array)
        args += ["--input", f"{name}={tmp_path / name}.npy"]
    code, out, err = invoke(*args)
    assert code == 0, err
    assert out.startswith("y: float32[2, 3]") and err.strip().endswith("ms (version 2)")
    assert [r.version for r in broker.requests] == ["2"]
