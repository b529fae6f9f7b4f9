"""Process fixtures shared by the test packages: real brokers and workers on loopback.

Everything waits on something that happened — a log line, a PONG, a reply — with a
timeout; nothing sleeps. Every process started through :class:`Processes` is killed
at teardown, and its output is printed when a test fails.

    procs = Processes()                               # or the ``processes`` fixture
    broker = start_broker(procs, "--heartbeat-ms", "50")
    worker = start_worker(procs, broker, model="add")  # waits for its registration
    with RawClient(broker.frontend) as client:
        reply = client.call("add", {"x": x, "y": y})

``start_worker`` takes ``argv=`` (a function of the broker's backend endpoint that
returns a command line), so the same tests can run real ``ipuserve worker``
processes once the runner backend exists; the default runs tests/fn_worker.py, a
FunctionBackend worker.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from ipuserve import protocol as wire

FN_WORKER = Path(__file__).with_name("fn_worker.py")
START_TIMEOUT = 20.0
REPLY_TIMEOUT = 20.0

# ---------------------------------------------------------------- processes


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll an observable state change (never a fixed sleep standing in for one)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.0005)


class Proc:
    """A child process whose merged stdout/stderr is collected line by line."""

    def __init__(self, name: str, argv: list[str], env: Mapping[str, str] | None = None) -> None:
        self.name, self.argv = name, argv
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.popen = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=full_env,
            text=True,
            bufsize=1,
        )
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, name=f"read-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def mark(self) -> int:
        """A position in the output; wait_for(..., since=mark) looks only after it."""
        with self._changed:
            return len(self.lines)

    def wait_for(
        self, pattern: str, timeout: float = START_TIMEOUT, since: int = 0
    ) -> re.Match[str]:
        """The first output line after ``since`` matching ``pattern`` (waits for it)."""
        regex, deadline, seen = re.compile(pattern), time.monotonic() + timeout, since
        with self._changed:
            while True:
                for line in self.lines[seen:]:
                    if match := regex.search(line):
                        return match
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or (self.popen.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(
                        f"{self.name}: no line matching {pattern!r} "
                        f"(exit code {self.popen.poll()}):\n{self.output()}"
                    )
                self._changed.wait(left)

    def wait_for_count(self, pattern: str, count: int, timeout: float = START_TIMEOUT) -> None:
        """Wait until ``count`` output lines match ``pattern``."""
        since = 0
        for _ in range(count):
            match = self.wait_for(pattern, timeout, since)
            since = self.lines.index(match.string, since) + 1

    def output(self) -> str:
        return "\n".join(f"  [{self.name}] {line}" for line in list(self.lines))

    @property
    def pid(self) -> int:
        return self.popen.pid

    def kill(self) -> None:
        """kill -9."""
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(timeout=10)
        self.close()

    def close(self) -> None:
        """Wait for the output to end (the process exited) and close the pipe."""
        self._reader.join(timeout=10)
        if self.popen.stdout is not None:
            self.popen.stdout.close()

    def terminate(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = START_TIMEOUT) -> int:
        return self.popen.wait(timeout=timeout)


class Processes:
    """Starts processes and kills every one of them at :meth:`close` (teardown)."""

    def __init__(self) -> None:
        self.started: list[Proc] = []

    def start(self, name: str, argv: list[str], env: Mapping[str, str] | None = None) -> Proc:
        proc = Proc(name, argv, env)
        self.started.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.started:
            proc.kill()

    def output(self) -> str:
        return "\n".join(proc.output() for proc in self.started)


@pytest.fixture
def processes() -> Iterator[Processes]:
    """Processes killed at teardown; their output shows in the report of a failed test."""
    procs = Processes()
    try:
        yield procs
    finally:
        procs.close()
        print(f"--- output of the test's processes ---\n{procs.output()}")


# ---------------------------------------------------------------- broker and workers


@dataclass
class BrokerProc:
    proc: Proc
    frontend: str
    backend: str
    epoch: str
    metrics_port: int | None
    argv: list[str] = field(default_factory=list)

    @property
    def metrics_url(self) -> str:
        assert self.metrics_port is not None, "start the broker with metrics=True"
        return f"http://127.0.0.1:{self.metrics_port}/metrics"


_LISTENING = r"broker listening: frontend=(\S+) backend=(\S+) epoch=(\S+) metrics-port=(\S+)"


def start_broker(
    procs: Processes,
    *args: str,
    frontend: str = "tcp://127.0.0.1:*",
    backend: str = "tcp://127.0.0.1:*",
    metrics: bool = True,
    heartbeat_ms: int = 50,
    liveness_ms: int = 400,
    grace_ms: int = 0,
    env: Mapping[str, str] | None = None,
    ping_check: bool = True,
) -> BrokerProc:
    """Start ``ipuserve broker``; ready once it logged its endpoints and answered a PING
    (a plaintext one: ``ping_check=False`` for a broker with keys, which refuses it)."""
    argv = [
        sys.executable,
        "-m",
        "ipuserve",
        "--log-level",
        "INFO",
        "broker",
        "--frontend",
        frontend,
        "--backend",
        backend,
        "--heartbeat-ms",
        str(heartbeat_ms),
        "--liveness-ms",
        str(liveness_ms),
        "--grace-ms",
        str(grace_ms),
        *args,
    ]
    if metrics:
        argv += ["--metrics-host", "127.0.0.1", "--metrics-port", "0"]
    proc = procs.start("broker", argv, env)
    found = proc.wait_for(_LISTENING)
    port = None if found[4] == "off" else int(found[4])
    broker = BrokerProc(proc, found[1], found[2], found[3], port, argv)
    if ping_check:
        assert ping(broker.frontend) == broker.epoch
    return broker


def restart_broker(procs: Processes, old: BrokerProc, *args: str) -> BrokerProc:
    """kill -9 the broker and start a new one on the same ports (with ``args`` added)."""
    old.proc.kill()
    argv = list(old.argv)
    argv[argv.index("--frontend") + 1] = old.frontend
    argv[argv.index("--backend") + 1] = old.backend
    argv += args
    proc = procs.start("broker2", argv)
    found = proc.wait_for(_LISTENING)
    port = None if found[4] == "off" else int(found[4])
    broker = BrokerProc(proc, found[1], found[2], found[3], port, argv)
    assert ping(broker.frontend) == broker.epoch
    return broker


WorkerArgv = Callable[[str], list[str]]


def fn_worker_argv(model: str = "add", *args: str) -> WorkerArgv:
    """A FunctionBackend worker (tests/fn_worker.py) serving ``model``."""

    def argv(backend: str) -> list[str]:
        return [
            sys.executable,
            str(FN_WORKER),
            "--broker",
            backend,
            "--model",
            model,
            "--heartbeat-ms",
            "50",
            "--handshake-ms",
            "300",
            "--reconnect-max-ms",
            "200",
            *args,
        ]

    return argv


def runner_worker_argv(*model_paths: str, args: tuple[str, ...] = ()) -> WorkerArgv:
    """A real ``ipuserve worker`` (ModelRunner backend) serving ``model_paths``."""

    def argv(backend: str) -> list[str]:
        models = [part for path in model_paths for part in ("--model", path)]
        return [
            sys.executable,
            "-m",
            "ipuserve",
            "--log-level",
            "INFO",
            "worker",
            "--broker",
            backend,
            *models,
            "--heartbeat-ms",
            "50",
            *args,
        ]

    return argv


def write_example(path: Path, name: str, *options: str) -> str:
    """``ipuserve model example NAME PATH OPTIONS...`` (a real process); the model's path."""
    argv = [sys.executable, "-m", "ipuserve", "model", "example", name, str(path), *options]
    subprocess.run(argv, check=True, capture_output=True)
    return str(path)


def time_scale_for_run(model_path: str, seconds: float) -> str:
    """The ``IPUSERVE_SIM_TIME_SCALE`` that makes one main-program run of the model at
    ``model_path`` take ``seconds`` (only the steps scale, not the 10 us launch)."""
    from ipuserve.runtime.popef.reader import load_model
    from ipuserve.runtime.simulator.cost import CostModel, ipu_spec, time_scale_for

    model = load_model([model_path])
    main = model.executable.program(model.metadata.programFlow().main()[0])
    cost = CostModel(ipu_spec(model.metadata.ipuVersion())).program_seconds(main)
    return repr(time_scale_for(seconds, cost))


_REGISTERED = r"worker (\S+) registered with \S+ \(epoch "
_worker_names = itertools.count(1)


def start_worker(
    procs: Processes, broker: BrokerProc, argv: WorkerArgv | None = None, *, name: str | None = None
) -> Proc:
    """Start a worker; ready once it logged its registration with this broker's epoch."""
    name = name or f"worker{next(_worker_names)}"
    proc = procs.start(name, (argv or fn_worker_argv())(broker.backend))
    proc.wait_for(_REGISTERED + broker.epoch)
    return proc


def wait_registered(proc: Proc, broker: BrokerProc, since: int = 0) -> None:
    proc.wait_for(_REGISTERED + broker.epoch, since=since)


# ---------------------------------------------------------------- a raw client


class RawClient:
    """A bare DEALER speaking the protocol: what tests use instead of the real Client."""

    _ids = itertools.count(1)

    def __init__(
        self,
        endpoint: str,
        *,
        rcvhwm: int | None = None,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self.context = context or zmq.Context.instance()
        self.socket: zmq.Socket[Any] = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        if rcvhwm is not None:
            self.socket.setsockopt(zmq.RCVHWM, rcvhwm)
            self.socket.setsockopt(zmq.RCVBUF, 4096)
        self.socket.connect(endpoint)
        self.stash: list[wire.Message] = []

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.socket.close(linger=0)

    def send_frames(self, frames: list[Any]) -> None:
        self.socket.send_multipart(frames, copy=False)

    def send(self, message: wire.Message) -> None:
        self.send_frames(message.encode())  # type: ignore[arg-type]

    def request(
        self,
        model: str,
        arrays: Mapping[str, Any],
        timeout_ms: float | None = None,
        request_id: bytes | None = None,
    ) -> bytes:
        request_id = request_id or b"r%d" % next(self._ids)
        self.send(wire.Request(request_id, model, wire.Tensors.of(arrays), timeout_ms))
        return request_id

    def recv(self, timeout: float = REPLY_TIMEOUT) -> wire.Message:
        """The next message (one set aside by :meth:`models` first)."""
        if self.stash:
            return self.stash.pop(0)
        return self._recv(timeout)

    def _recv(self, timeout: float) -> wire.Message:
        if not self.socket.poll(int(timeout * 1000)):
            raise TimeoutError(f"no message within {timeout} s")
        return wire.decode(self.socket.recv_multipart(copy=False))

    def call(
        self,
        model: str,
        arrays: Mapping[str, Any],
        timeout_ms: float | None = None,
        timeout: float = REPLY_TIMEOUT,
    ) -> wire.Message:
        request_id = self.request(model, arrays, timeout_ms)
        while True:
            reply = self.recv(timeout)
            if getattr(reply, "request_id", None) == request_id:
                return reply

    def models(self) -> tuple[wire.ModelInfo, ...]:
        """The broker's MODELS answer; other messages arriving first are kept for recv()."""
        self.send(wire.ListModels(b"models"))
        while not isinstance(reply := self._recv(REPLY_TIMEOUT), wire.ModelsReply):
            self.stash.append(reply)
        return reply.models


def ping(frontend: str, timeout: float = START_TIMEOUT) -> str:
    """PING the broker; its epoch."""
    with RawClient(frontend) as client:
        client.send(wire.Ping(b"ping"))
        pong = client.recv(timeout)
    assert isinstance(pong, wire.Pong), pong
    return pong.epoch


# ---------------------------------------------------------------- models and metrics

ADD_WIDTH = 8


def add_inputs(rows: int = 2, seed: int = 0) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((rows, ADD_WIDTH), dtype=np.float32),
        "y": rng.standard_normal((rows, ADD_WIDTH), dtype=np.float32),
    }


def add_expected(inputs: Mapping[str, np.ndarray[Any, Any]]) -> np.ndarray[Any, Any]:
    return inputs["x"] + 2 * inputs["y"]


def assert_add_reply(reply: wire.Message, inputs: Mapping[str, np.ndarray[Any, Any]]) -> None:
    assert isinstance(reply, wire.Reply), reply
    np.testing.assert_allclose(reply.tensors.arrays()["z"], add_expected(inputs), rtol=1e-6)


def scrape(url: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}, after checking the exposition format:
    each family once, HELP then TYPE before its samples, its samples together, no sample
    twice (what Prometheus' own parsers insist on)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    described: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            _hash, what, family, *_ = [*line.split(" ", 3), "", ""]
            if what not in ("HELP", "TYPE"):
                continue  # a plain comment
            if what == "HELP":
                assert family not in described, f"family {family} appears twice"
                described[family], current = ["HELP"], family
            else:
                assert family == current and described[family] == ["HELP"], line
                described[family].append(what)
            continue
        key, value = line.rsplit(" ", 1)
        name = key.split("{", 1)[0]
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        assert current in (name, base), f"{key} is not under its family's HELP/TYPE"
        assert key not in samples, f"{key} twice"
        samples[key] = float(value)
    return samples


def labels_of(metrics: Any, name: str) -> list[dict[str, str]]:
    """The label sets of the samples exposed as ``name`` in an in-process component's
    metrics (an :class:`ipuserve.metrics.Metrics`: its ``registry``)."""
    return [
        sample.labels
        for family in metrics.registry.collect()
        for sample in family.samples
        if sample.name == name
    ]


def metric(samples: dict[str, float], family: str) -> float:
    """The sum of every sample of ``family`` (all label sets) in a :func:`scrape`."""
    return sum(v for k, v in samples.items() if k.split("{", 1)[0] == family)


class Load:
    """Closed-loop load from one RawClient: ``window`` add requests in flight, each with
    its own inputs, every reply checked against numpy and every request id tallied."""

    def __init__(self, client: RawClient, total: int, window: int, prefix: bytes = b"L") -> None:
        self.client, self.total, self.window = client, total, window
        self.inputs = {b"%s%d" % (prefix, i): add_inputs(1 + i % 4, seed=i) for i in range(total)}
        self.order = list(self.inputs)
        self.sent = 0
        self.replies: dict[bytes, list[wire.Message]] = {rid: [] for rid in self.order}

    @property
    def answered(self) -> int:
        return sum(1 for replies in self.replies.values() if replies)

    def send(self, request_id: bytes) -> None:
        self.client.request("add", self.inputs[request_id], request_id=request_id)

    def run(self, until: int | None = None, timeout: float = REPLY_TIMEOUT) -> None:
        """Keep ``window`` in flight until ``until`` (default: all) requests are answered."""
        until = self.total if until is None else until
        while self.answered < until:
            while self.sent < self.total and self.sent - self.answered < self.window:
                self.send(self.order[self.sent])
                self.sent += 1
            self.take(self.client.recv(timeout))

    def take(self, message: wire.Message) -> None:
        request_id = getattr(message, "request_id", None)
        assert request_id in self.replies, message
        self.replies[request_id].append(message)

    def unanswered(self) -> list[bytes]:
        return [rid for rid in self.order[: self.sent] if not self.replies[rid]]

    def check(self, exactly_once: bool = True) -> None:
        for request_id, replies in self.replies.items():
            assert replies, f"{request_id!r} was never answered"
            if exactly_once:
                assert len(replies) == 1, f"{request_id!r} answered {len(replies)} times"
            for reply in replies:
                assert_add_reply(reply, self.inputs[request_id])
