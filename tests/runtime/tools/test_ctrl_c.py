"""A real SIGINT to a running tool: it stops, prints a partial report, exits 130."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

WAIT_S = 60.0

COMMANDS = {
    "queues": ["queues-benchmark", "--duration-s", "600", "--warmup", "10"],
    "ring": ["queues-benchmark", "--mode", "ring", "--duration-s", "600"],
    "callbacks": ["callbacks-benchmark", "--runs", "1000000000", "--warmup", "2"],
}


def real_data_command(simple_file: Path, folder: Path) -> list[str]:
    for name in ("tensor_A", "tensor_B"):
        np.save(folder / f"{name}.npy", np.ones((4, 4), np.float32))
    return [
        "real-data", "--popef", str(simple_file), "--runs", "1000000000",
        "--input", f"tensor_A={folder / 'tensor_A.npy'}",
        "--input", f"tensor_B={folder / 'tensor_B.npy'}",
        "--output-dir", str(folder / "out"),
    ]  # fmt: skip


def wait_for(proc: subprocess.Popen[bytes], marker: bytes) -> bytes:
    """Read stderr until ``marker`` appears (or the process ends): the progress line
    reaching that phase is proof the tool is under way."""
    assert proc.stderr is not None
    seen = b""
    while marker not in seen:
        chunk = proc.stderr.read1(256)
        if not chunk:
            break
        seen += chunk
    return seen


@pytest.mark.parametrize("name", [*COMMANDS, "real-data"])
def test_sigint_gives_a_partial_report(name: str, simple_file: Path, tmp_path: Path) -> None:
    command = COMMANDS.get(name) or real_data_command(simple_file, tmp_path)
    marker = b"running" if name == "real-data" else b"measuring"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ipuserve", "tools", *command, "--json", "--progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ),  # the test's private IPU lock dir and time scale
    )
    try:
        seen = wait_for(proc, marker)
        assert marker in seen, seen.decode(errors="replace")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err.decode(errors="replace")
    assert err.decode().endswith("Error: interrupted (Ctrl-C): the report covers what completed\n")
    assert b"Traceback" not in err
    report = json.loads(out)
    assert report["interrupted"] is True
    assert report["tool"] == command[0]
    if name == "real-data":  # what completed was kept: the first run's outputs
        assert report["runs"] >= 1
        assert np.load(tmp_path / "out" / "output.npy").shape == (4, 4)
