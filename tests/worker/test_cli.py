"""The `ipuserve worker` and `ipuserve broker` commands: options, env vars, clear failures."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from ipuserve import protocol as wire
from ipuserve.face.cli import main
from tests.helpers import (
    Processes,
    RawClient,
    runner_worker_argv,
    start_broker,
    start_worker,
    write_example,
)


@pytest.mark.parametrize(
    ("command", "options"),
    [
        (
            "worker",
            [
                "--broker",
                "--model",
                "--name",
                "--replicas",
                "--batching-dim",
                "--batch-policy",
                "--batch-timeout-ms",
                "--look-ahead",
                "--ipus",
                "--credit",
                "--heartbeat-ms",
                "--worker-id",
                "--drain-timeout-ms",
                "IPUSERVE_WORKER_BROKER",
            ],
        ),
        (
            "broker",
            [
                "--frontend",
                "--backend",
                "--heartbeat-ms",
                "--liveness-ms",
                "--grace-ms",
                "--queue-limit",
                "--max-attempts",
                "--max-payload-bytes",
                "--metrics-port",
                "IPUSERVE_BROKER_FRONTEND",
            ],
        ),
    ],
)
def test_help_lists_every_option_with_its_env_var(command: str, options: list[str]) -> None:
    result = CliRunner().invoke(main, [command, "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    for option in options:
        assert option in result.output


def test_a_worker_that_cannot_build_its_backend_fails_in_one_line(tmp_path: object) -> None:
    result = CliRunner().invoke(
        main, ["worker", "--broker", "tcp://127.0.0.1:1", "--model", "/nonexistent.popef"]
    )
    assert result.exit_code == 1
    assert result.output.startswith("Error: ")
    assert "Traceback" not in result.output


def test_broker_rejects_inconsistent_settings() -> None:
    result = CliRunner().invoke(
        main,
        [
            "broker",
            "--heartbeat-ms",
            "500",
            "--liveness-ms",
            "100",
            "--frontend",
            "tcp://127.0.0.1:*",
            "--backend",
            "tcp://127.0.0.1:*",
        ],
    )
    assert result.exit_code == 2  # a usage error, in the options' own names
    assert "Error: --liveness-ms must be at least --heartbeat-ms" in result.output


def test_broker_refuses_one_endpoint_for_both_sockets() -> None:
    """It failed binding the second socket: "Address already in use", which blames
    another process instead of the command line."""
    same = ["--frontend", "tcp://127.0.0.1:5599", "--backend", "tcp://127.0.0.1:5599"]
    result = CliRunner().invoke(main, ["broker", *same])
    assert result.exit_code == 2, result.output
    assert (
        "Error: --frontend and --backend must differ (both tcp://127.0.0.1:5599): clients "
        "and workers each need a port of their own"
    ) in result.output


def test_broker_reports_an_endpoint_it_cannot_bind() -> None:
    """A well-formed address this host does not have (TEST-NET-3): ZeroMQ refuses the bind."""
    result = CliRunner().invoke(main, ["broker", "--frontend", "tcp://203.0.113.1:5555"])
    assert result.exit_code == 1
    assert "cannot bind tcp://203.0.113.1:5555" in result.output


def test_broker_refuses_an_address_that_is_no_endpoint() -> None:
    result = CliRunner().invoke(main, ["broker", "--frontend", "bogus://x"])
    assert result.exit_code == 2 and "is not a ZeroMQ endpoint" in result.output


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["worker", "--broker", "tcp://127.0.0.1:1", "--model", "m.popef", "--name", ""], "--name"),
        (["infer", "--broker", "tcp://127.0.0.1:1", "--model", "x" * 257], "--model"),
        (["bench", "--broker", "tcp://127.0.0.1:1", "--model", ""], "--model"),
    ],
)
def test_a_model_name_the_wire_cannot_carry_is_a_usage_error(argv: list[str], option: str) -> None:
    """An empty --name once served silently under the file's name."""
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 2
    assert f"Invalid value for '{option}': a model name must have 1..256 characters" in (
        result.output
    )


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A TCP port on 127.0.0.1 another socket is listening on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_a_broker_whose_metrics_port_is_taken_says_so_in_one_line(taken_port: int) -> None:
    argv = ["broker", "--frontend", "tcp://127.0.0.1:0", "--backend", "tcp://127.0.0.1:0"]
    metrics = ["--metrics-port", str(taken_port), "--metrics-host", "127.0.0.1"]
    result = CliRunner().invoke(main, [*argv, *metrics])
    assert result.exit_code == 1
    assert f"Error: cannot serve metrics on 127.0.0.1:{taken_port}: Address already in use" in (
        result.output
    )


# ---------------------------------------------------------------- a real `ipuserve worker`


def noop_model(tmp_path: Path, *options: str) -> str:
    """A noop (output = input) of 8 elements a sample, compiled for batches of 4."""
    return write_example(
        tmp_path / "noop.popef", "noop", "--batch-size", "4", "--elements", "8", *options
    )


def test_a_worker_whose_metrics_port_is_taken_says_so_in_one_line(
    tmp_path: Path, taken_port: int, isolated_ipu_host: Path
) -> None:
    argv = runner_worker_argv(noop_model(tmp_path), args=("--metrics-port", str(taken_port)))
    argv = [*argv("tcp://127.0.0.1:1"), "--metrics-host", "127.0.0.1"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == (
        f"Error: cannot serve metrics on 127.0.0.1:{taken_port}: Address already in use"
    )


def test_a_bad_blas_threads_variable_is_a_one_line_error(
    tmp_path: Path, isolated_ipu_host: Path
) -> None:
    argv = runner_worker_argv(noop_model(tmp_path))("tcp://127.0.0.1:1")
    env = {**os.environ, "IPUSERVE_SIM_BLAS_THREADS": "two"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False, env=env)
    assert done.returncode == 1
    last = done.stderr.splitlines()[-1]
    assert last.startswith("Error: cannot serve ") and last.endswith(
        ": IPUSERVE_SIM_BLAS_THREADS='two': expected a whole number >= 1"
    )


@pytest.mark.slow
def test_a_worker_whose_model_the_broker_refuses_says_why_and_exits_1(
    processes: Processes, tmp_path: Path
) -> None:
    """Another schema under a served name: the worker's log once said it joined, and it
    idled for ever; now it hears why, stops (a supervisor restarts it), and is taken
    once the workers of the old schema are gone (a rolling upgrade)."""
    broker = start_broker(processes)
    old = start_worker(processes, broker, runner_worker_argv(noop_model(tmp_path), args=(
        "--name", "m", "--worker-id", "old")))  # fmt: skip
    simple = write_example(tmp_path / "simple.popef", "simple")
    new_argv = runner_worker_argv(simple, args=("--name", "m", "--worker-id", "new"))
    refused = processes.start("refused", new_argv(broker.backend))
    assert refused.wait() == 1
    refused.wait_for(r"ERROR .*refused model 'm': model 'm' is served by old with another schema")
    refused.wait_for(r"worker new stops: the broker refused every model it serves")
    assert "joined the broker" not in refused.output()
    assert "retrying" not in refused.output()
    broker.proc.wait_for(r"worker new dropped \(left\)")  # its BYE arrived
    given = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    with RawClient(broker.frontend) as client:
        (info,) = client.models()
        assert [load.worker_id for load in info.workers] == ["old"]  # gone after its BYE
        reply = client.call("m", {"input": given})
        assert isinstance(reply, wire.Reply)
        np.testing.assert_array_equal(reply.tensors.arrays()["output"], given)
        old.terminate()
        assert old.wait() == 0
        start_worker(processes, broker, new_argv)  # the old schema has left: taken now
        (info,) = client.models()
    assert [load.worker_id for load in info.workers] == ["new"]
    assert [t.name for t in info.spec.inputs] == ["tensor_A", "tensor_B"]


@pytest.mark.slow
def test_a_named_worker_with_two_replicas_offers_twice_the_credit_of_one(
    processes: Processes, tmp_path: Path
) -> None:
    model = noop_model(tmp_path)
    broker = start_broker(processes)
    # The host has 4 IPUs; the first worker sees only 2 of them (and takes both).
    for worker_id, replicas in (("two", ("--replicas", "2", "--ipus", "2")), ("one", ())):
        options = ("--name", "twin", "--worker-id", worker_id, *replicas)
        start_worker(processes, broker, runner_worker_argv(model, args=options))
    given = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    with RawClient(broker.frontend) as client:
        (info,) = client.models()
        reply = client.call("twin", {"input": given})
    assert info.spec.name == "twin"  # not the file's "noop"
    credit = {load.worker_id: load.credit for load in info.workers}
    assert credit.keys() == {"one", "two"}
    assert credit["two"] == 2 * credit["one"]
    assert isinstance(reply, wire.Reply), reply
    np.testing.assert_array_equal(reply.tensors.arrays()["output"], given)


def test_more_replicas_than_ipus_fail_with_a_clear_message(tmp_path: Path) -> None:
    argv = ["worker", "--broker", "tcp://127.0.0.1:1", "--model", noop_model(tmp_path)]
    result = subprocess.run(
        [sys.executable, "-m", "ipuserve", *argv, "--replicas", "2", "--ipus", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert "2 replicas need at least 2 IPUs (one device each), but --ipus gives this worker 1" in (
        result.stderr
    )


@pytest.mark.slow
@pytest.mark.parametrize("look_ahead", ["unlimited", "0"])
def test_batching_dim_1_and_a_batch_timeout_serve_requests_of_any_width(
    processes: Processes, tmp_path: Path, look_ahead: str
) -> None:
    model = noop_model(tmp_path, "--batch-dim", "1")  # tensors are [8, batch]
    broker = start_broker(processes)
    options = ("--batching-dim", "1", "--batch-policy", "fixed", "--batch-timeout-ms", "20",
               "--look-ahead", look_ahead)  # fmt: skip
    start_worker(processes, broker, runner_worker_argv(model, args=options))
    rng = np.random.default_rng(0)
    given = {width: rng.standard_normal((8, width)).astype(np.float32) for width in (1, 3, 4, 9)}
    with RawClient(broker.frontend) as client:
        (info,) = client.models()
        # alone, one sample of a batch of 4: only the batch timeout sends it to the device
        lone = client.call("noop", {"input": given[1]})
        ids = {client.request("noop", {"input": x}): x for x in given.values()}
        replies = [client.recv() for _ in ids]
    assert info.spec.batching_dim == 1
    assert isinstance(lone, wire.Reply), lone
    np.testing.assert_array_equal(lone.tensors.arrays()["output"], given[1])
    for reply in replies:
        assert isinstance(reply, wire.Reply), reply
        np.testing.assert_array_equal(reply.tensors.arrays()["output"], ids[reply.request_id])


@pytest.mark.slow
def test_sigterm_while_the_model_loads_lets_go_and_says_so(
    processes: Processes, tmp_path: Path
) -> None:
    """At a large time scale the load program takes seconds; SIGTERM then once killed
    the worker without a word (its drain handler comes only with serving)."""
    model = write_example(tmp_path / "mlp.popef", "mlp")
    argv = [sys.executable, "-m", "ipuserve", "--log-level", "INFO", "worker", "--broker",
            "tcp://127.0.0.1:1", "--model", model]  # fmt: skip
    env = {"IPUSERVE_SIM_TIME_SCALE": "100000"}  # the load program: about a minute
    loading = processes.start("loading", argv, env=env)
    loading.wait_for(r"loading .*mlp\.popef")
    loading.popen.send_signal(signal.SIGTERM)
    assert loading.wait(60) == 143
    loading.wait_for(r"^ipuserve worker: stopped by SIGTERM while loading its model$")
    assert "Traceback" not in loading.output()


@pytest.mark.parametrize("value", ["some", "-1", "1.5", ""])
def test_a_bad_look_ahead_is_a_usage_error_naming_the_option(value: str) -> None:
    result = CliRunner().invoke(
        main,
        ["worker", "--broker", "tcp://127.0.0.1:1", "--model", "m.popef", "--look-ahead", value],
    )
    assert result.exit_code == 2, result.output
    assert "--look-ahead" in result.output
    assert "expected 'unlimited' or a whole number >= 0" in result.output
