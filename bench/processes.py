"""Processes the fabric suite starts on loopback, and the waits that make them usable.

Every process is a plain command line (``python -m ipuserve broker``, ``python -m
ipuserve worker``, ``python -m ipuserve.bench.relay``): the bench imports no
broker, worker or runtime code. Output goes to one log file per process in the
suite's work directory, so a failure can point at it. :class:`ChildProcesses` is a
context manager that terminates (then kills) everything it started, whatever happens.
The benchmark scripts (``benchmarks/``) and ``ipuserve demo`` start theirs with it too.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from ipuserve.client.client import Client
from ipuserve.errors import DeadlineExceeded, IpuserveError

#: How children run a module. ``-P`` (Python 3.11+) keeps the working directory off
#: their sys.path: started from a source checkout after ``pip install .``, they would
#: otherwise import the checkout's ``ipuserve/`` (which lacks the installed package's
#: ``ipuserve.broker``, ``ipuserve.worker``, ... mapping) instead of the installed one.
PYTHON = [sys.executable, "-P", "-m"]


def free_port() -> int:
    """A loopback TCP port nobody listens on right now (the usual small race is accepted)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM if the parent dies (Linux), so a killed
    bench or demo never leaves a broker or worker behind."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the parent's cleanup has to do
        pass


_PR_SET_PDEATHSIG = 1
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU of process ``pid`` and all its threads, from Linux's /proc
    (libzmq's I/O threads included: they are part of what a message costs); None
    where there is no /proc or the process is gone. Resolution: one clock tick."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime


@dataclass
class Child:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def check(self) -> None:
        """Raise if the process died; the message points at its log."""
        code = self.popen.poll()
        if code is not None:
            tail = self.log.read_text(errors="replace")[-2000:]
            raise IpuserveError(f"{self.name} exited with {code}; {self.log}:\n{tail}")


class ChildProcesses:
    """Starts child processes with their logs in ``workdir``; stops them all on exit."""

    def __init__(self, workdir: Path, env: Mapping[str, str] | None = None) -> None:
        self.workdir = workdir
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.children: list[Child] = []

    def start(self, name: str, argv: list[str], env: Mapping[str, str] | None = None) -> Child:
        log = self.workdir / f"{name}.log"
        with log.open("wb") as out:
            popen = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**self.env, **(env or {})},
                start_new_session=True,  # Ctrl-C reaches us only; we stop children in order
                preexec_fn=_die_with_parent,
            )
        child = Child(name, popen, log)
        self.children.append(child)
        return child

    def check(self) -> None:
        for child in self.children:
            child.check()

    def stop(self) -> None:
        for child in self.children:
            if child.popen.poll() is None:
                child.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        for child in self.children:
            try:
                child.popen.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                child.popen.kill()
                child.popen.wait()
        self.children.clear()

    def __enter__(self) -> ChildProcesses:
        return self

    def __exit__(
        self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None
    ) -> None:
        self.stop()


def wait_for_models(
    procs: ChildProcesses, frontend: str, workers: Mapping[str, int], timeout_s: float = 120.0
) -> None:
    """Return once the broker lists each model with at least its number of workers."""
    deadline = time.monotonic() + timeout_s
    with Client(frontend, timeout=2.0) as client:
        while True:
            procs.check()
            try:
                listed = {i.spec.name: len(i.workers) for i in client.models()}
            except DeadlineExceeded:
                listed = {}
            if all(listed.get(m, 0) >= n for m, n in workers.items()):
                return
            if time.monotonic() > deadline:
                raise DeadlineExceeded(f"workers did not register in {timeout_s} s: {listed}")
            time.sleep(0.2)  # polling a process we do not control; nothing to wait on
