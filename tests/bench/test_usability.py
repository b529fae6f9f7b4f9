"""Mistakes a user makes with ``ipuserve bench`` get one clear line each.

Output files it could not write, requests that fail (all, some, or after the
measurement window), a model nobody serves, options that would be ignored, and an
option given both ways. The CLI-wide and client mistakes:
tests/client/test_usability.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from ipuserve.bench.cli import too_many_failed
from ipuserve.bench.recording import Recording, Sample, summarize
from ipuserve.bench.report import error_lines, suite_table
from ipuserve.face.cli import main
from tests.helpers import (
    BrokerProc,
    Processes,
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
