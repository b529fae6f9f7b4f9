"""`ipuserve demo` end to end: a real broker and workers, checked results, nothing left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

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
