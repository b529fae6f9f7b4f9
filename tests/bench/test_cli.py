"""`ipuserve bench` through click's CliRunner and as a process (signals, sweeps, plots)."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from click.testing import CliRunner

from ipuserve.bench.cli import _sigterm_as_ctrl_c
from ipuserve.face.cli import main
from tests.helpers import (
    BrokerProc,
    Proc,
    Processes,
    fn_worker_argv,
    metric,
    processes,  # noqa: F401  (a fixture)
    scrape,
    start_broker,
    start_worker,
    wait_until,
)

pytestmark = pytest.mark.slow


def invoke(*args: str) -> str:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.mark.parametrize(
    "load", [["--concurrency", "4"], ["--rate", "400"]], ids=["closed", "open"]
)
def test_a_short_bench_prints_json_whose_counts_add_up(served: BrokerProc, load: list[str]) -> None:
    printed = invoke(
        "bench", "--broker", served.frontend, "--model", "add", "--batch", "2",
        "--warmup-s", "0", "--requests", "60", "--json", *load,
    )  # fmt: skip
    summary = json.loads(printed)
    assert summary["requests"] == 60
    assert summary["ok"] + sum(summary["errors"].values()) == summary["requests"]
    assert summary["client"]["sent"] >= summary["requests"]
    assert 0 <= summary["client"]["grouped"] <= summary["client"]["sent"]
    assert summary["samples_per_request"] == 2
    assert summary["request_bytes"] == 2 * 2 * 8 * 4
    assert isinstance(summary["seed"], int)  # a new one each run: shown so it can be repeated
    assert set(summary["split_us"]) == {
        "broker_queue", "worker_queue", "device", "worker_other", "wire", "total"
    }  # fmt: skip


@pytest.mark.parametrize(
    ("load", "mode_line"),
    [
        (["--concurrency", "4"], "mode        closed  in flight 4"),
        (
            ["--rate", "400", "--arrivals", "fixed", "--seed", "7"],
            "mode        open  rate 400.0 req/s  seed 7",
        ),
    ],
    ids=["closed", "open"],
)
def test_a_short_bench_prints_a_table_with_the_numbers_of_its_json(
    served: BrokerProc, tmp_path: Path, load: list[str], mode_line: str
) -> None:
    saved = tmp_path / "bench.json"
    result = CliRunner().invoke(
        main,
        ["bench", "--broker", served.frontend, "--model", "add", "--batch", "2",
         "--warmup-s", "0", "--requests", "60", "--output", str(saved), *load],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert result.stderr == ""  # no progress line: stderr is not a terminal
    summary = json.loads(saved.read_text())
    mode, requests, throughput, latency, split = result.stdout.splitlines()
    assert mode == mode_line
    assert requests == (
        f"requests    60 ok {summary['ok']}  errors 0  skipped 0  in {summary['duration_s']} s"
    )
    assert summary["ok"] == 60
    tp = re.fullmatch(r"throughput  ([\d.]+) req/s  ([\d.]+) samples/s  ([\d.]+) MB/s", throughput)
    assert tp, throughput
    assert float(tp[1]) == round(summary["throughput"]["req_per_s"], 1)
    assert float(tp[2]) == pytest.approx(2 * float(tp[1]), abs=0.2)  # 2 samples a request
    assert latency.startswith("latency us  ") and split.startswith("split us    ")
    assert labelled(latency[12:]).keys() == {"p50", "p90", "p99", "p99.9", "mean", "max"}
    percentiles = [labelled(latency[12:])[k] for k in ("p50", "p90", "p99", "p99.9", "max")]
    assert percentiles == sorted(percentiles)
    parts = labelled(split[12:])
    assert parts.keys() == set(summary["split_us"])
    assert parts["total"] == round(summary["split_us"]["total"])


def labelled(text: str) -> dict[str, float]:
    """'p50 12  p90 30' -> {'p50': 12.0, 'p90': 30.0}."""
    words = text.split()
    return {key: float(value) for key, value in zip(words[::2], words[1::2], strict=True)}


def test_a_concurrency_sweep_prints_a_row_per_level_and_plots_them(
    served: BrokerProc, tmp_path: Path
) -> None:
    plot, saved = tmp_path / "curve.svg", tmp_path / "sweep.json"
    printed = invoke(
        "bench", "--broker", served.frontend, "--model", "add", "--warmup-s", "0",
        "--requests", "40", "--concurrency", "1,4", "--plot", str(plot), "--output", str(saved),
    )  # fmt: skip
    levels = json.loads(saved.read_text())["sweep"]
    assert [level["in_flight"] for level in levels] == [1, 4]
    assert all(level["requests"] == level["ok"] == 40 for level in levels)
    rows = printed.splitlines()[3:]
    for row, level in zip(rows, levels, strict=True):
        cells = row.split()
        assert int(cells[0]) == level["in_flight"]
        assert float(cells[1]) == level["throughput"]["req_per_s"]
        assert float(cells[3]) == round(level["latency_us"]["p50"])
    root = ET.fromstring(plot.read_text())
    lines = root.findall(".//{http://www.w3.org/2000/svg}polyline")
    assert len(lines) == 2  # p50 and p99
    assert all(len(line.attrib["points"].split()) == 2 for line in lines)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--concurrency", "0,4"], "every value must be > 0"),
        (["--rate", "10,fast"], "not a number or a comma-separated list"),
        (["--suite", "fabric", "--plot", "x.svg"], "--plot draws a --concurrency or --rate"),
    ],
)
def test_bench_refuses_bad_levels_before_it_starts(args: list[str], message: str) -> None:
    result = CliRunner().invoke(main, ["bench", "--broker", "tcp://127.0.0.1:1", *args])
    assert result.exit_code == 2 and message in result.output


def signalled_bench(
    procs: Processes, served: BrokerProc, sig: int, *options: str, replies: int = 50
) -> Proc:
    """A bench of model ``add`` sent ``sig`` once the broker has answered ``replies``."""
    argv = [sys.executable, "-m", "ipuserve", "bench", "--broker", served.frontend]
    bench = procs.start("bench", [*argv, "--model", "add", *options])
    url = served.metrics_url
    wait_until(lambda: metric(scrape(url), "ipuserve_broker_replies_total") >= replies, timeout=60)
    bench.popen.send_signal(sig)
    return bench


def test_ctrl_c_during_a_bench_prints_what_was_measured_and_runs_no_further_level(
    processes: Processes,  # noqa: F811
    served: BrokerProc,
    tmp_path: Path,
) -> None:
    saved = tmp_path / "partial.json"
    bench = signalled_bench(
        processes, served, signal.SIGINT, "--warmup-s", "0", "--duration-s", "120",
        "--concurrency", "2,4", "--output", str(saved),
    )  # fmt: skip
    bench.wait_for(r"level 1/2: 2 in flight")
    assert bench.wait(60) == 130
    (level,) = json.loads(saved.read_text())["sweep"]
    assert level["interrupted"] and level["in_flight"] == 2
    assert level["ok"] > 0 and level["requests"] == level["ok"] + sum(level["errors"].values())
    assert level["duration_s"] < 120
    bench.wait_for(rf"^ +2 +{level['throughput']['req_per_s']}\b")  # the table's one row
    bench.wait_for(r"Error: interrupted \(Ctrl-C\): the figures above cover the first")
    assert not any("level 2/2" in line for line in bench.lines)


def test_sigterm_during_a_bench_prints_what_was_measured_like_ctrl_c(
    processes: Processes,  # noqa: F811
    served: BrokerProc,
) -> None:
    """``kill``, ``docker stop`` or a CI timeout once ended a bench with no report at all."""
    bench = signalled_bench(
        processes, served, signal.SIGTERM, "--warmup-s", "0", "--duration-s", "120",
        "--concurrency", "2", "--json",
    )  # fmt: skip
    assert bench.wait(60) == 143
    bench.wait_for(r'"interrupted": true')
    bench.wait_for(r"Error: interrupted \(SIGTERM\): the figures above cover the first")


def test_ctrl_c_during_the_warm_up_says_nothing_was_measured(
    processes: Processes,  # noqa: F811
    served: BrokerProc,
) -> None:
    bench = signalled_bench(
        processes, served, signal.SIGINT, "--warmup-s", "120", "--duration-s", "1", replies=20
    )
    assert bench.wait(60) == 130
    bench.wait_for(r"Error: interrupted \(Ctrl-C\) before anything was measured \(warm-up\)")
    assert not any(line.startswith("requests ") for line in bench.lines)  # no table of zeros


def test_a_bench_kept_waiting_after_its_window_says_so(
    processes: Processes,  # noqa: F811
) -> None:
    """A request in flight when the window closes and answered long after (a worker slower
    than the window; or dead, when each ends at its timeout): stderr says why it waits."""
    broker = start_broker(processes)
    start_worker(processes, broker, fn_worker_argv("add", "--delay-ms", "5000"))
    bench = processes.start(
        "bench",
        [sys.executable, "-m", "ipuserve", "bench", "--broker", broker.frontend, "--model",
         "add", "--warmup-s", "0", "--duration-s", "0.3"],
    )  # fmt: skip
    bench.wait_for(
        r"^waiting for 1 request\(s\) still in flight after the measurement window \(each "
        r"ends by its --timeout-s at the latest\)$",
        timeout=60,
    )
    assert bench.wait(60) == 1  # nothing finished inside the window: said, not hidden
    bench.wait_for(r"Error: no request finished inside the measurement window")


def test_sigterm_outside_the_measuring_window_exits_143_saying_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """While bench connects (or runs the suite) a SIGTERM once surfaced as click's
    "Aborted!" and exit 1. A real signal to this process: pytest runs tests on the
    main thread, where the handler goes."""
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stopped, _sigterm_as_ctrl_c():
        os.kill(os.getpid(), signal.SIGTERM)
        threading.Event().wait(10)  # the handler raises here, at once
    assert stopped.value.code == 143
    assert "Error: stopped by SIGTERM before anything was measured" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is before  # put back


def test_ctrl_c_does_not_wait_out_the_timeouts_of_requests_in_flight(
    processes: Processes,  # noqa: F811
) -> None:
    """With the requests stuck (a worker that takes a minute, or a broker gone) bench
    once waited out every --timeout-s after Ctrl-C before it reported anything."""
    broker = start_broker(processes)
    worker = start_worker(processes, broker, fn_worker_argv("add", "--delay-ms", "120000"))
    argv = [sys.executable, "-m", "ipuserve", "bench", "--broker", broker.frontend]
    bench = processes.start(
        "bench", [*argv, "--model", "add", "--warmup-s", "0", "--timeout-s", "120"]
    )
    worker.wait_for("running a job for 120000")  # the request is stuck at the worker
    bench.popen.send_signal(signal.SIGINT)
    assert bench.wait(60) == 130  # not after the request's 120 s
    bench.wait_for(r"stopped waiting for 1 request\(s\) still in flight \(Ctrl-C\)")
