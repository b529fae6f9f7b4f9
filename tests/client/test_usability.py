"""Mistakes a user makes on the command line or with the Client get one clear line each.

Endpoints without a transport, unreadable input files, an --output path, options that
would be ignored, inputs that are not a dict of arrays, a bench whose every request
fails, and a client pointed where nothing (or a broker's backend) answers.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner, Result

from ipuserve.cli import main
from ipuserve.client import Client, ClientConfig, io_loop
from ipuserve.client.bench_cli import too_many_failed
from ipuserve.client.fleet import free_port
from ipuserve.client.report import error_lines, suite_table
from ipuserve.client.stats import Recording, Sample, summarize
from ipuserve.endpoints import endpoint_problem
from ipuserve.errors import ConfigError, DeadlineExceeded, InvalidInputError, UnavailableError
from tests.helpers import (
    BrokerProc,
    Processes,
    add_inputs,
    fn_worker_argv,
    processes,  # noqa: F401  (a fixture)
    start_broker,
    start_worker,
)

NOWHERE = "tcp://127.0.0.1:1"  # never dialled: every test using it fails before sending


def run(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(main, list(args), env=env)


def last_line(result: Result) -> str:
    return result.output.strip().splitlines()[-1]


@pytest.fixture
def served(processes: Processes) -> BrokerProc:  # noqa: F811
    broker = start_broker(processes)
    start_worker(processes, broker, fn_worker_argv("add"))
    return broker


@pytest.fixture
def npy_files(tmp_path: Path) -> dict[str, Path]:
    """x/y as the add model wants them, x as float64, an .npz and a text file."""
    given = add_inputs(rows=4)
    files = {name: tmp_path / f"{name}.npy" for name in ("x", "y", "x64")}
    np.save(files["x"], given["x"])
    np.save(files["y"], given["y"])
    np.save(files["x64"], given["x"].astype(np.float64))
    files["npz"] = tmp_path / "x.npz"
    np.savez(files["npz"], x=given["x"])
    files["text"] = tmp_path / "x.txt"
    files["text"].write_text("1 2 3\n")
    return files


# ------------------------------------------------------------------ 1. endpoints

ADVICE = "use tcp://HOST:PORT (e.g. tcp://127.0.0.1:5555)"


@pytest.mark.parametrize(
    "args",
    [
        ["infer", "--broker", "127.0.0.1:25555", "--model", "m", "--input", "x=x.npy"],
        ["models", "--broker", "127.0.0.1:25555"],
        ["bench", "--broker", "127.0.0.1:25555", "--model", "m"],
        ["worker", "--broker", "127.0.0.1:25555", "--model", "m.popef"],
        ["broker", "--frontend", "127.0.0.1:25555"],
        ["broker", "--backend", "127.0.0.1:25555"],
    ],
    ids=["infer", "models", "bench", "worker", "broker-frontend", "broker-backend"],
)
def test_an_endpoint_without_a_transport_is_a_usage_error(args: list[str]) -> None:
    result = run(*args)
    assert result.exit_code == 2, result.output
    assert "'127.0.0.1:25555' is not a ZeroMQ endpoint; use tcp://HOST:PORT (e.g. tcp://" in (
        last_line(result)
    )
    assert "Traceback" not in result.output


def test_endpoint_check_accepts_the_transports_and_binds_only_where_binding() -> None:
    for good in ("tcp://127.0.0.1:5555", "tcp://broker:5555", "ipc:///tmp/b.ipc", "inproc://b"):
        assert endpoint_problem(good) is None
    for bind in ("tcp://*:5555", "tcp://127.0.0.1:*"):
        assert endpoint_problem(bind, bind=True) is None
        assert endpoint_problem(bind) == f"{bind!r} is a bind address ('*'); to connect, {ADVICE}"
    assert endpoint_problem("tcp://127.0.0.1") == (
        f"'tcp://127.0.0.1' is not a ZeroMQ endpoint (no port); {ADVICE}"
    )
    assert endpoint_problem("127.0.0.1:25555") == (
        f"'127.0.0.1:25555' is not a ZeroMQ endpoint; {ADVICE}"
    )
    assert endpoint_problem("http://b:80") is not None
    assert endpoint_problem("tcp://b:70000") is not None


@pytest.mark.parametrize("address", ["127.0.0.1:25555", "tcp://*:5555", "tcp://b:x"])
def test_a_client_refuses_a_malformed_address_with_config_error(address: str) -> None:
    with pytest.raises(ConfigError) as refused:
        Client(address)
    assert str(refused.value).startswith(repr(address))
    assert str(refused.value).endswith(ADVICE)


# ------------------------------------------------------------------ 2. infer --output


@pytest.mark.slow
def test_infer_writes_its_output_to_exactly_the_path_given(
    served: BrokerProc, npy_files: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "out.txt"
    inputs = ["--input", f"x={npy_files['x']}", "--input", f"y={npy_files['y']}"]
    infer = ["infer", "--broker", served.frontend, "--model", "add", *inputs]
    result = run(*infer, "--output", str(out))
    assert result.exit_code == 0, result.output
    assert f"saved z to {out}" in result.output
    assert not Path(f"{out}.npz").exists()
    with np.load(out) as saved:
        assert saved["z"].shape == (4, 8)

    bad = tmp_path / "missing" / "y.npz"
    result = run(*infer, "--output", str(bad))
    assert result.exit_code == 1
    assert result.output.splitlines() == [  # refused before the request, nothing printed
        f"Error: cannot write {bad}: {bad.parent} is not a directory"
    ]


@pytest.mark.parametrize(
    ("option", "name", "message"),
    [
        ("--output", "missing/b.json", "cannot write {path}: {parent} is not a directory"),
        ("--plot", "missing/c.svg", "cannot write {path}: {parent} is not a directory"),
        ("--plot", "c.png", "--plot writes SVG: give a .svg path, not {path}"),
    ],
)
def test_bench_refuses_a_file_it_could_not_write_before_it_runs(
    tmp_path: Path, option: str, name: str, message: str
) -> None:
    """Nothing listens at the broker address: a bench that started would take 30 s."""
    path = tmp_path / name
    result = run("bench", "--broker", "tcp://127.0.0.1:1", "--model", "m", option, str(path))
    assert result.exit_code in (1, 2)
    assert message.format(path=path, parent=path.parent) in result.output


# ------------------------------------------------------------------ 3. input files


@pytest.mark.parametrize("command", ["infer", "bench"])
@pytest.mark.parametrize(
    ("kind", "why"),
    [
        (
            "npz",
            "a zip archive (an .npz?), not a single array; save the tensor alone with numpy.save",
        ),
        ("text", "not a .npy file (no NUMPY header)"),
    ],
)
def test_an_input_file_that_is_not_one_npy_array_is_named_on_one_line(
    npy_files: dict[str, Path], command: str, kind: str, why: str
) -> None:
    path = npy_files[kind]
    result = run(command, "--broker", NOWHERE, "--model", "add", "--input", f"x={path}")
    assert result.exit_code == 2, result.output
    assert last_line(result) == (
        f"Error: Invalid value for '--input': input 'x': cannot read {path}: {why}"
    )


# ------------------------------------------------------------------ 4. bench errors


def test_the_summary_keeps_the_first_message_of_each_error_code() -> None:
    recording = Recording(start_ns=0, stop_ns=100)
    recording.add(Sample(10, 1, "INVALID_INPUT", message="input 'x' must be float32"))
    recording.add(Sample(20, 1, "INVALID_INPUT", message="input 'y' must be float32"))
    recording.add(Sample(30, 1, "OVERLOADED", message="queue full"))
    recording.add(Sample(40, 1))
    summary = summarize(recording)
    assert summary["errors"] == {"INVALID_INPUT": 2, "OVERLOADED": 1}
    assert summary["error_messages"] == {
        "INVALID_INPUT": "input 'x' must be float32",
        "OVERLOADED": "queue full",
    }


def test_failures_after_the_window_are_counted_apart_and_shown() -> None:
    """Requests in flight when the window closes stay out of the figures, but a worker
    killed then must not leave a clean-looking report."""
    recording = Recording(start_ns=0, stop_ns=100)
    recording.add(Sample(50, 1))
    recording.add(Sample(150, 1))  # finished after the window: fine, not in the figures
    recording.add(Sample(30_000, 1, "DEADLINE_EXCEEDED", message="no reply within 30.0 s"))
    summary = summarize(recording)
    assert summary["requests"] == summary["ok"] == 1 and summary["errors"] == {}
    assert summary["after_window"] == {"ok": 1, "errors": {"DEADLINE_EXCEEDED": 1}}
    assert summary["error_messages"] == {"DEADLINE_EXCEEDED": "no reply within 30.0 s"}
    lines = error_lines([summary])
    assert lines == [
        "after       the window closed, 1 failed: DEADLINE_EXCEEDED 1",
        "error       DEADLINE_EXCEEDED: no reply within 30.0 s",
    ]


@pytest.mark.slow
def test_a_bench_whose_every_request_fails_says_why_and_exits_non_zero(
    served: BrokerProc, npy_files: dict[str, Path], tmp_path: Path
) -> None:
    saved = tmp_path / "bench.json"
    result = run(
        "bench", "--broker", served.frontend, "--model", "add", "--warmup-s", "0",
        "--requests", "20", "--input", f"x={npy_files['x64']}", "--input", f"y={npy_files['y']}",
        "--output", str(saved),
    )  # fmt: skip
    message = (
        "input 'x' of model 'add' must be float32, got float64 (convert it: x.astype(np.float32))"
    )
    assert result.exit_code == 1, result.output
    assert f"error       INVALID_INPUT: {message}" in result.stdout.splitlines()
    assert last_line(result) == f"Error: no request succeeded: [INVALID_INPUT] {message}"
    summary = json.loads(saved.read_text())
    assert summary["ok"] == 0 and summary["errors"] == {"INVALID_INPUT": summary["requests"]}
    assert summary["error_messages"] == {"INVALID_INPUT": message}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("allowed", "exit_code"), [(None, 1), ("24", 1), ("25", 0)], ids=["default", "24", "25"]
)
def test_a_bench_with_some_failed_requests_exits_1_unless_max_error_pct_allows_them(
    processes: Processes,  # noqa: F811
    allowed: str | None,
    exit_code: int,
) -> None:
    """One request in flight, each its own job, every 4th job failing: exactly 5 of 20
    fail. A report with failures once exited 0, as clean as a clean one."""
    broker = start_broker(processes)
    start_worker(processes, broker, fn_worker_argv("add", "--fail-every", "4"))
    args = ["bench", "--broker", broker.frontend, "--model", "add", "--warmup-s", "0"]
    threshold = [] if allowed is None else ["--max-error-pct", allowed]
    result = run(*args, "--requests", "20", "--json", *threshold)
    assert result.exit_code == exit_code, result.output
    summary = json.loads(result.stdout)  # the report comes first, either way
    assert (summary["ok"], summary["errors"]) == (15, {"INFERENCE_FAILED": 5})
    if exit_code:
        assert last_line(result) == (
            f"Error: 5 of 20 requests failed (25%, above --max-error-pct {allowed or 0}); "
            "most often [INFERENCE_FAILED] model 'add' raised ValueError: "
            "job 4 fails, as every 4th does"
        )


def test_a_bench_of_a_model_nobody_serves_says_how_to_start_one(served: BrokerProc) -> None:
    result = run("bench", "--broker", served.frontend, "--model", "nope", "--requests", "1")
    assert result.exit_code == 1, result.output
    assert last_line(result) == (
        "Error: [UNKNOWN_MODEL] no worker serves model 'nope' (models: add); check the name, "
        "or start a worker for it: `ipuserve worker --broker tcp://BROKER:5556 --model FILE "
        "--name nope`"
    )


def test_failures_after_the_window_count_against_max_error_pct() -> None:
    level = {
        "requests": 3,
        "ok": 3,
        "errors": {},
        "error_messages": {"DEADLINE_EXCEEDED": "no reply within 1.0 s"},
        "after_window": {"ok": 0, "errors": {"DEADLINE_EXCEEDED": 1}},
    }
    assert too_many_failed([level], 25.0) is None  # 1 of 4
    assert too_many_failed([level], 24.9) == (
        "1 of 4 requests failed (25%, above --max-error-pct 24.9); most often "
        "[DEADLINE_EXCEEDED] no reply within 1.0 s"
    )
    assert too_many_failed([level, {**level, "after_window": {}}], 0) is not None  # a sweep


# ------------------------------------------------------------------ 5. ignored options


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--concurrency", "8", "--rate", "100"],
            "--concurrency (closed loop) and --rate (open loop) exclude each other; give one",
        ),
        (["--concurrency", "1,8", "--rate", "10,100"], "exclude each other"),
        (["--arrivals", "fixed"], "--arrivals shapes the open loop's arrivals; it needs --rate"),
        (["--runs", "5", "--quick"], "--runs, --quick: only for --suite fabric"),
        (["--batch", "2", "--input", "x=X"], "--batch sizes the random inputs"),
        (
            ["--suite", "fabric", "--concurrency", "8"],
            "--suite fabric starts its own broker, workers and load; it does not take "
            "--broker, --model, --concurrency",
        ),
        (["--input", "x=X", "--input", "x=X"], "input 'x' is given twice: "),
    ],
    ids=["closed-and-open", "two-sweeps", "arrivals", "suite-only", "batch", "suite", "twice"],
)
def test_bench_refuses_options_it_would_ignore(
    npy_files: dict[str, Path], args: list[str], message: str
) -> None:
    args = [arg.replace("=X", f"={npy_files['x']}") for arg in args]
    result = run("bench", "--broker", NOWHERE, "--model", "add", *args)
    assert result.exit_code == 2, result.output
    assert message in last_line(result)


def test_infer_refuses_an_input_given_twice(npy_files: dict[str, Path]) -> None:
    x, text = npy_files["x"], npy_files["text"]
    args = ["--input", f"x={x}", "--input", f"x={text}"]
    result = run("infer", "--broker", NOWHERE, "--model", "add", *args)
    assert result.exit_code == 2
    assert last_line(result).endswith(f"input 'x' is given twice: {x} and {text}")


@pytest.mark.slow
def test_concurrency_on_the_command_line_beats_a_rate_from_the_environment(
    served: BrokerProc,
) -> None:
    args = ["bench", "--broker", served.frontend, "--model", "add", "--warmup-s", "0"]
    result = run(
        *args, "--requests", "20", "--concurrency", "2", "--json",
        env={"IPUSERVE_BENCH_RATE": "50", "IPUSERVE_BENCH_ARRIVALS": "fixed"},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert (summary["mode"], summary["in_flight"], summary["ok"]) == ("closed", 2, 20)


# ------------------------------------------------------------------ 6. Client inputs


def test_client_infer_refuses_an_array_instead_of_a_dict() -> None:
    with Client(NOWHERE) as client:
        with pytest.raises(
            InvalidInputError,
            match=r"^inputs must be a dict of input name -> numpy array, not a numpy\.ndarray$",
        ):
            client.infer_async("add", np.zeros((2, 8), np.float32))  # type: ignore[arg-type]
        with pytest.raises(
            InvalidInputError, match=r"^input 'y' is a list, not a numpy array; convert it"
        ):
            client.infer_async("add", {"x": np.zeros((2, 8), np.float32), "y": [[1.0] * 8] * 2})
        assert client.stats.sent == 0


# ------------------------------------------------------------------ 7. nobody answers

HINT = "since the client started; is the broker running, and is this its frontend (client) port?"


def test_a_timeout_with_nothing_listening_says_nothing_ever_answered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    config = ClientConfig(ping_interval_s=0.05, liveness_s=0.1)
    with (
        caplog.at_level(logging.WARNING),
        Client(address, config=config) as client,
        pytest.raises(DeadlineExceeded) as failed,
    ):
        client.infer("add", add_inputs(), timeout=1.0)
    assert str(failed.value).endswith(f": nothing has answered at {address} {HINT}")
    silent = [r.getMessage() for r in caplog.records if "broker silent" in r.getMessage()]
    assert silent, "no warning about the silence"
    assert silent[0].endswith(  # nothing to re-send over: it goes when connected
        f", not connected; 1 pending go again once it is: nothing has answered at {address} {HINT}"
    )
    assert not any("nothing has answered" in line for line in silent[1:])


def test_infer_with_nothing_listening_suggests_checking_the_endpoint(
    npy_files: dict[str, Path],
) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    inputs = ["--input", f"x={npy_files['x']}", "--input", f"y={npy_files['y']}"]
    result = run("infer", "--broker", address, "--model", "add", *inputs, "--timeout-s", "0.5")
    assert result.exit_code == 1
    line = last_line(result)
    assert line.startswith("Error: [DEADLINE_EXCEEDED] no reply within 0.5 s (request ")
    assert line.endswith(f"): nothing has answered at {address} {HINT}")


def test_a_timeout_too_short_to_hear_anything_does_not_blame_the_endpoint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the threshold widened: a loaded machine may take 50 ms to expire a 1 ms timeout
    monkeypatch.setattr(io_loop, "_SUSPECT_SILENCE_S", 10.0)
    address = f"tcp://127.0.0.1:{free_port()}"
    with Client(address) as client, pytest.raises(DeadlineExceeded) as failed:
        client.infer("add", add_inputs(), timeout=0.001)
    assert "nothing has answered" not in str(failed.value)


@pytest.mark.slow
def test_a_timeout_from_a_live_broker_does_not_blame_the_endpoint(
    processes: Processes,  # noqa: F811
) -> None:
    broker = start_broker(processes, grace_ms=60_000)  # queues for a model nobody serves
    with Client(broker.frontend) as client, pytest.raises(DeadlineExceeded) as failed:
        client.infer("nobody", add_inputs(), timeout=0.3)
    assert "nothing has answered" not in str(failed.value)


@pytest.mark.slow
def test_a_client_pointed_at_the_backend_port_is_told_so_at_once(
    processes: Processes,  # noqa: F811
) -> None:
    broker = start_broker(processes)
    with Client(broker.backend) as client, pytest.raises(UnavailableError) as failed:
        client.infer("add", add_inputs(), timeout=60.0)
    assert str(failed.value) == (
        f"{broker.backend} answers as a broker's backend (worker) port; "
        "clients connect to its frontend (client) port"
    )


def test_the_suite_table_aligns_rows_whose_labels_are_long() -> None:
    """The diagnostics' longer labels once pushed their numbers out of the columns."""
    row = {"ipuserve": 1.0, "baseline": 2.0, "ratio": 0.5, "target": ">= 0.7", "met": False}
    results = {
        "runs": 1,
        "comparisons": [{**row, "name": "latency p50", "unit": "us"}],
        "diagnostics": [
            {**row, "name": "client vs bare protocol loop, 64 in flight", "unit": "req/s"}
        ],
    }
    lines = suite_table(results).splitlines()
    rows = [line for line in lines if line.endswith("NO")]
    assert len(rows) == 2
    assert len({line.index("1.0") for line in rows}) == 1
    assert len({len(line) for line in rows}) == 1
    assert len(lines[0]) == len(lines[1]) == len(rows[0])  # the header and its rule too
