"""`ipuserve demo` end to end: a real broker and workers, checked results, nothing left behind."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ipuserve.face import demo as demo_module

pytestmark = pytest.mark.slow


def survivors(workdir: Path) -> list[str]:
    """Processes whose command line mentions the demo's working directory."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(workdir) in cmdline:
            found.append(f"{entry.name}: {cmdline}")
    return found


def demo(workdir: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "ipuserve", "demo", "--workdir", str(workdir), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_demo_checks_every_result_and_stops_everything(tmp_path: Path) -> None:
    with demo(tmp_path, "--requests", "400", "--clients", "4") as proc:
        output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    assert "all 400 results matched the numpy reference" in output
    assert "mlp" in output and "simple" in output and "p99 ms" in output
    assert survivors(tmp_path) == []


def test_ctrl_c_stops_the_broker_and_workers(tmp_path: Path) -> None:
    with demo(tmp_path, "--requests", "20000") as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("sending"):
                break
        else:
            pytest.fail("the demo never started sending")
        assert survivors(tmp_path)  # the broker and workers are running now
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "interrupted: the broker and workers were stopped" in output
    assert survivors(tmp_path) == []


def test_a_client_thread_that_dies_fails_the_demo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_inputs = demo_module._ClientRun._inputs

    def inputs(run: demo_module._ClientRun, model: str) -> dict[str, object]:
        if model == "mlp":  # the clients with odd numbers send only mlp requests
            raise RuntimeError("a bug in the client")
        return make_inputs(run, model)

    monkeypatch.setattr(demo_module._ClientRun, "_inputs", inputs)
    out = io.StringIO()
    config = demo_module.DemoConfig(requests=40, clients=4, workdir=tmp_path)
    code = demo_module.run_demo(config, out, io.StringIO())
    printed = out.getvalue()
    assert code == 1, printed
    assert "FAILED: only 20 of 40 requests were answered and checked" in printed
    assert "2 client thread(s) died; first: client 1: RuntimeError: a bug in the client" in printed
    assert "results matched" not in printed
    assert survivors(tmp_path) == []


def test_children_ignore_an_ipuserve_folder_in_the_working_directory(tmp_path: Path) -> None:
    """The README's first command runs the demo from the source checkout after a plain
    ``pip install .``: the checkout's ``ipuserve/`` must not shadow the installed
    package in the broker and workers the demo starts."""
    shadow = tmp_path / "ipuserve"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('the working directory was imported')\n")
    done = subprocess.run(
        [*demo_module.PYTHON, "--version"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "ipuserve" in done.stdout


def test_a_clean_run_removes_the_folder_it_made_for_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where mkdtemp makes it
    out = io.StringIO()
    code = demo_module.run_demo(demo_module.DemoConfig(requests=40, clients=4), out, io.StringIO())
    assert code == 0, out.getvalue()
    assert "working in " + str(tmp_path) in out.getvalue()
    assert list(tmp_path.glob("ipuserve-demo-*")) == []
