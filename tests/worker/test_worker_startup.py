"""`ipuserve worker` at start-up: model files from the environment, replicas the host
cannot hold, and telling the user when it cannot join its broker."""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import ipuserve.runtime as model_runtime
from ipuserve import protocol as wire
from ipuserve.face.cli import main
from ipuserve.logs import LOG_LEVEL_ENV
from ipuserve.runtime.popef import examples
from ipuserve.runtime.popef.reader import load_model
from tests.helpers import (
    Processes,
    RawClient,
    runner_worker_argv,
    start_broker,
    wait_registered,
    write_example,
)

NO_WAIT = model_runtime.DeviceWaitConfig(model_runtime.DeviceWaitStrategy.NO_WAIT)

# ---------------------------------------------------------------- IPUSERVE_WORKER_MODELS


@pytest.mark.slow
def test_the_models_env_var_takes_a_space_separated_list(
    processes: Processes, tmp_path: Path
) -> None:
    """A model in two files (weights apart), named by IPUSERVE_WORKER_MODELS alone."""
    model = tmp_path / "m2.popef"
    weights = tmp_path / "m2w.popef"
    write_example(model, "simple", "--weights-file", str(weights))
    data = examples.tensor_arrays(load_model([model, weights]))
    broker = start_broker(processes)
    argv = [sys.executable, "-m", "ipuserve", "--log-level", "INFO", "worker"]
    env = {
        "IPUSERVE_WORKER_BROKER": broker.backend,
        "IPUSERVE_WORKER_MODELS": f"  {model}\t{weights} ",
        "IPUSERVE_WORKER_HEARTBEAT_MS": "50",
    }
    worker = processes.start("worker", argv, env)
    wait_registered(worker, broker)
    inputs = {
        "tensor_A": np.arange(8, dtype=np.float32).reshape(2, 4),
        "tensor_B": np.ones((2, 4), np.float32),
    }
    with RawClient(broker.frontend) as client:
        reply = client.call("simple", inputs)
    assert isinstance(reply, wire.Reply), reply
    want = examples.reference("simple", inputs, data)["output"]
    np.testing.assert_allclose(reply.tensors.arrays()["output"], want, rtol=1e-6)


def test_model_files_in_the_env_var_are_split_on_whitespace(tmp_path: Path) -> None:
    """Files that do not exist are named one by one: the list was split."""
    first, second = tmp_path / "a.popef", tmp_path / "b.popef"
    result = CliRunner().invoke(
        main,
        ["worker", "--broker", "tcp://127.0.0.1:1"],
        env={"IPUSERVE_WORKER_MODELS": f"{first} {second}"},
    )
    assert result.exit_code == 1, result.output
    assert f"cannot serve {first}, {second}:" in result.output


def test_a_model_given_without_its_weights_file_says_to_add_it(tmp_path: Path) -> None:
    model, weights = tmp_path / "s.popef", tmp_path / "s-weights.popef"
    write_example(model, "simple", "--weights-file", str(weights))
    result = CliRunner().invoke(
        main, ["worker", "--broker", "tcp://127.0.0.1:1", "--model", str(model)]
    )
    assert result.exit_code == 1, result.output
    assert "anchor 'weights' is read by the load program but the model has no tensor data" in (
        result.output
    )
    assert "`ipuserve worker --model MODEL --model WEIGHTS`" in result.output


# ---------------------------------------------------------------- replicas and IPUs


def test_more_replicas_than_the_host_has_ipus_fail_up_front(tmp_path: Path) -> None:
    model = write_example(tmp_path / "noop.popef", "noop", "--elements", "8")
    result = CliRunner().invoke(
        main,
        ["worker", "--broker", "tcp://127.0.0.1:1", "--model", model, "--replicas", "9"],
        env={"IPUSERVE_SIM_IPUS": "4"},
    )
    assert result.exit_code == 1, result.output
    assert result.output == (
        f"Error: cannot serve {model}: 9 replicas of model 'noop' need 9 IPUs (1 each), but "
        "this host's simulated inventory has 4: use --replicas 4 or fewer, or give the "
        "worker more IPUs with --ipus (or IPUSERVE_SIM_IPUS)\n"
    )


def test_replicas_short_of_free_ipus_are_told_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another worker holds 2 of the host's 4 IPUs; this one asks for 3 replicas. The
    runtime's "no free device ... (NO_WAIT)" once ended there, naming no way out."""
    monkeypatch.setenv("IPUSERVE_SIM_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.setenv("IPUSERVE_SIM_IPUS", "4")
    model = write_example(tmp_path / "noop.popef", "noop", "--elements", "8")
    manager = model_runtime.DeviceManager()
    held = [manager.getSpecificDevice(ipu, wait_config=NO_WAIT) for ipu in (0, 1)]
    try:
        result = CliRunner().invoke(
            main, ["worker", "--broker", "tcp://127.0.0.1:1", "--model", model, "--replicas", "3"]
        )
    finally:
        for device in held:
            device.detach()
    assert result.exit_code == 1, result.output
    assert result.output.startswith(f"Error: cannot serve {model}: no free device")
    assert result.output.endswith(
        ". This worker needs 3 IPU(s) and 2 of the host's 4 are free now (the ones this "
        "process held are let go): run it with --replicas 2, stop a process holding the "
        "others, or give the simulated host more IPUs with --ipus (or IPUSERVE_SIM_IPUS)\n"
    )


# ---------------------------------------------------------------- joining the broker


@pytest.fixture
def not_a_broker() -> Iterator[str]:
    """A TCP port where something listens that never speaks ZeroMQ."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield f"tcp://127.0.0.1:{server.getsockname()[1]}"


def plain_worker(endpoint: str, model: str) -> tuple[list[str], dict[str, str]]:
    """An `ipuserve worker` command line and env: the default log level, WARNING."""
    argv = [sys.executable, "-m", "ipuserve", "worker", "--broker", endpoint, "--model", model]
    return argv, {LOG_LEVEL_ENV: "WARNING"}


@pytest.mark.slow
def test_a_worker_that_cannot_join_says_so_and_keeps_trying(
    processes: Processes, tmp_path: Path, not_a_broker: str
) -> None:
    model = write_example(tmp_path / "noop.popef", "noop", "--elements", "8")
    worker = processes.start("worker", *plain_worker(not_a_broker, model))
    found = worker.wait_for(r"WARNING .*has not joined the broker at (\S+) after (\d+) s")
    assert found[1] == not_a_broker
    assert (
        "still retrying: check that the broker is running and that this is its backend "
        "(worker) endpoint, e.g. tcp://HOST:5556, not its frontend (client) one"
    ) in found.string
    assert worker.popen.poll() is None  # still retrying
    worker.terminate()
    assert worker.wait() == 0


@pytest.mark.slow
def test_a_worker_pointed_at_the_brokers_frontend_is_told_so(
    processes: Processes, tmp_path: Path
) -> None:
    model = write_example(tmp_path / "noop.popef", "noop", "--elements", "8")
    broker = start_broker(processes)
    worker = processes.start("worker", *plain_worker(broker.frontend, model))
    found = worker.wait_for(r"WARNING .*has not joined the broker at (\S+) after")
    assert found[1] == broker.frontend
    assert "it answered HELLO with ERROR" in found.string
    assert "likely its frontend (client) endpoint; point --broker at the broker's backend" in (
        found.string
    )
    # once pointed at the backend, the same model joins
    fixed = processes.start("fixed", runner_worker_argv(model)(broker.backend))
    wait_registered(fixed, broker)


@pytest.mark.slow
def test_at_the_default_log_level_a_worker_says_it_joined_and_a_drain_is_one_line(
    processes: Processes, tmp_path: Path
) -> None:
    model = write_example(tmp_path / "noop.popef", "noop", "--elements", "8")
    broker = start_broker(processes)
    worker = processes.start("worker", *plain_worker(broker.backend, model))
    joined = worker.wait_for(
        rf"worker \S+ joined the broker at {broker.backend}, serving noop \(credit "
    )
    worker.terminate()
    assert worker.wait() == 0
    worker.close()
    after_join = worker.lines[worker.lines.index(joined.string) + 1 :]
    assert len(after_join) == 1 and "received SIGTERM: draining" in after_join[0], after_join
