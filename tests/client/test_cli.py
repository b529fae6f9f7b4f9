"""`ipuserve infer` and `ipuserve models` through click's CliRunner (bench: tests/bench)."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
import zmq
from click.testing import CliRunner

from ipuserve.face.cli import main
from tests.helpers import (
    BrokerProc,
    Processes,
    add_expected,
    add_inputs,
    processes,  # noqa: F401  (a fixture)
)

pytestmark = pytest.mark.slow


def invoke(*args: str) -> str:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout


def test_infer_reads_npy_files_and_writes_an_npz(served: BrokerProc, tmp_path: Path) -> None:
    given = add_inputs(rows=3, seed=4)
    for name, array in given.items():
        np.save(tmp_path / f"{name}.npy", array)
    out = tmp_path / "out.npz"
    printed = invoke(
        "infer", "--broker", served.frontend, "--model", "add",
        "--input", f"x={tmp_path / 'x.npy'}", "--input", f"y={tmp_path / 'y.npy'}",
        "--output", str(out),
    )  # fmt: skip
    assert printed.startswith("z: float32[3, 8]")
    with np.load(out) as saved:
        np.testing.assert_allclose(saved["z"], add_expected(given), rtol=1e-6)


def test_infer_reports_a_typed_error_on_one_line(served: BrokerProc, tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.zeros((2, 8), np.float64))
    args = ["infer", "--broker", served.frontend, "--model", "nope"]
    result = CliRunner().invoke(main, [*args, "--input", f"x={tmp_path / 'x.npy'}"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        "Error: [UNKNOWN_MODEL] no worker serves model 'nope' (models: add); check the name, "
        "or start a worker for it: `ipuserve worker --broker tcp://BROKER:5556 --model FILE "
        "--name nope`"
    ]


def test_infer_rejects_an_input_that_is_not_name_equals_file() -> None:
    args = ["infer", "--broker", "tcp://127.0.0.1:1", "--model", "m", "--input", "x.npy"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "NAME=FILE.npy" in result.output


def test_models_json_lists_the_model_and_its_worker(served: BrokerProc) -> None:
    listed = json.loads(invoke("models", "--broker", served.frontend, "--json"))
    assert [m["spec"]["name"] for m in listed] == ["add"]
    [load] = listed[0]["workers"]
    assert load["jobs"] == load["in_flight"] == 0  # the table's name beside the wire's
    assert load["credit"] > 0 and load["requests"] == 0
    table = invoke("models", "--broker", served.frontend)
    assert "add" in table and "x:float32[4, 8]" in table
    assert "; batched along dimension 0" in table


@pytest.mark.parametrize("command", ["models", "infer"])
def test_ctrl_c_while_waiting_for_the_broker_exits_130_in_one_line(
    processes: Processes,  # noqa: F811
    command: str,
    tmp_path: Path,
) -> None:
    """Ctrl-C once surfaced as click's "Aborted!" and exit 1, a failure to a script. A
    silent ROUTER plays the broker: once the request reached it, the command waits."""
    np.save(tmp_path / "x.npy", np.zeros((4, 8), np.float32))
    extra = ["--model", "add", "--input", f"x={tmp_path / 'x.npy'}"] if command == "infer" else []
    context = zmq.Context.instance()
    with context.socket(zmq.ROUTER) as broker:
        port = broker.bind_to_random_port("tcp://127.0.0.1")
        argv = [sys.executable, "-m", "ipuserve", command, "--broker", f"tcp://127.0.0.1:{port}"]
        proc = processes.start(command, [*argv, *extra])
        assert broker.poll(60_000), "the command never sent its request"
        broker.recv_multipart()
        proc.popen.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130
    proc.wait_for(r"^Error: interrupted \(Ctrl-C\)$")
    assert not any("Aborted" in line or "Traceback" in line for line in proc.lines)
