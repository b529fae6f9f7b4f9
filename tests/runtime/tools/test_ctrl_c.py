"""A real SIGINT to a running benchmark: it stops, prints a partial report, exits 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

WAIT_S = 60.0


def wait_for(proc: subprocess.Popen[bytes], marker: bytes) -> bytes:
    """Read stderr until ``marker`` appears (or the process ends): the progress line
    reaching the measuring phase is proof the benchmark is under way."""
    assert proc.stderr is not None
    seen = b""
    while marker not in seen:
        chunk = proc.stderr.read1(256)
        if not chunk:
            break
        seen += chunk
    return seen


@pytest.mark.parametrize(
    "command",
    [
        ["queues-benchmark", "--duration-s", "600", "--warmup", "10"],
        ["queues-benchmark", "--mode", "ring", "--duration-s", "600"],
        ["callbacks-benchmark", "--runs", "1000000000", "--warmup", "2"],
    ],
    ids=["queues", "ring", "callbacks"],
)
def test_sigint_gives_a_partial_report(command: list[str]) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "ipuserve", "tools", *command, "--json", "--progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ),  # the test's private IPU lock dir and time scale
    )
    try:
        seen = wait_for(proc, b"measuring")
        assert b"measuring" in seen, seen.decode(errors="replace")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err.decode(errors="replace")
    assert b"Traceback" not in err
    report = json.loads(out)
    assert report["interrupted"] is True
    assert report["tool"] == command[0]
