"""Several gateway processes on one port: ``ipuserve gateway --processes N``.

One gateway process costs ~200 us of CPU per HTTP request and ~400 us per gRPC one
(docs/gateway.md, "Cost"), so one process caps near 5,000 / 2,500 requests/s whatever
the machine. The gateway keeps no state, so N processes can share the doors' ports the
way ``uvicorn --workers`` and gunicorn do: every process binds them with SO_REUSEPORT,
and the kernel spreads the *connections* over the processes.

The supervisor is a plain process manager -- no asyncio, no client, no socket it
serves on -- and does the rest:

* it fixes the ports: a door given port 0 gets a concrete port, reserved by a socket
  bound (never listening) with SO_REUSEPORT and held until the end, so every child
  binds the same port and a child restarted later finds it still ours;
* it starts N children, ``python -m ipuserve gateway ... --processes 1 --supervised``,
  each with its stdout and stdin on pipes: stdout carries the child's start line (or
  the reason it could not start), stdin is never written, so a supervisor that dies,
  even by SIGKILL, closes it and the child stops at its end of file; stderr stays
  inherited, so the children's logs go where the supervisor's go;
* it prints one start line once every child printed its own, or stops the others and
  fails with the reason of the first that could not start;
* it restarts a child that dies, after a backoff (0.5 s doubling to 10 s, starting
  over once a child lived 30 s), while the others keep serving;
* on SIGTERM or SIGINT it sends SIGTERM to every child (each drains its requests for
  up to 5 s, as one gateway does), kills what still runs after 15 s, and exits 0.

The children share a private ``PROMETHEUS_MULTIPROC_DIR`` (mode 0700) that the
supervisor makes and removes, so their statistics can be summed across processes.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from types import FrameType

from ipuserve.errors import ConfigError
from ipuserve.gateway.config import MULTIPROC_ENV, GatewayConfig, split_address

log = logging.getLogger(__name__)

#: how a gateway's start line begins (gateway/app.py); a child's first line of stdout
#: that does not is the reason it could not start
START_PREFIX = "ipuserve gateway: "
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 10.0
#: a child that lived this long is healthy: its slot's backoff starts over
STEADY_S = 30.0
#: after SIGTERM, how long the children may take (each drains for up to 5 s) before
#: they are killed
STOP_GRACE_S = 15.0
#: a child that has neither announced itself nor exited by then is taken for hung: the
#: start fails (naming it) rather than waiting for ever; a start binds and reads its
#: token files, seconds at most even on a loaded machine
START_TIMEOUT_S = 60.0
#: tries at one port free on every address of a host (a later address may hold it)
_RESERVE_TRIES = 20

#: builds a child's command line from the config it is to serve
ChildArgv = Callable[[GatewayConfig], list[str]]


@dataclass(eq=False)
class Child:
    """One run of one slot's process."""

    slot: int
    popen: subprocess.Popen[str]
    born: float = field(default_factory=time.monotonic)
    #: the first line it wrote that was not a start line: why it could not start
    reason: str | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid


@dataclass(frozen=True)
class _Started:
    child: Child
    line: str


@dataclass(frozen=True)
class _Exited:
    child: Child
    returncode: int


@dataclass(frozen=True)
class _Signalled:
    signum: int


_Event = _Started | _Exited | _Signalled


@dataclass
class Backoff:
    """How long a slot waits before its next start: 0.5 s doubling to 10 s, so a child
    that cannot stay up is not restarted in a busy loop, and back to 0.5 s once one
    lived ``STEADY_S`` (a crash now and then is met at once)."""

    delay: float = FIRST_BACKOFF_S

    def after(self, lived_s: float) -> float:
        """The wait after a child that lived ``lived_s`` seconds exited."""
        if lived_s >= STEADY_S:
            self.delay = FIRST_BACKOFF_S
        delay, self.delay = self.delay, min(self.delay * 2, MAX_BACKOFF_S)
        return delay


def describe_exit(returncode: int) -> str:
    """``signal 9`` or ``code 1``, as the restart message words it."""
    return f"signal {-returncode}" if returncode < 0 else f"code {returncode}"


class Supervisor:
    """``processes`` gateway children serving ``config`` on shared ports; :meth:`run`."""

    def __init__(
        self,
        config: GatewayConfig,
        processes: int,
        child_argv: ChildArgv,
        announce: Callable[[str], None],
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        self.config = config
        self.start_timeout_s = start_timeout_s
        self.processes = processes
        self._child_argv = child_argv
        self._announce = announce
        # SimpleQueue: its put is safe in a signal handler (it takes no lock a
        # handler could interrupt), and the reader threads post to it as well
        self._events: queue.SimpleQueue[_Event] = queue.SimpleQueue()
        self._alive: set[Child] = set()
        self._backoff = {slot: Backoff() for slot in range(1, processes + 1)}
        self._due: dict[int, float] = {}  # slot -> when it is to be started again

    def run(self) -> None:
        """Start the children, announce, keep them running until SIGTERM or SIGINT, stop
        them. :class:`ConfigError` if a port cannot be reserved or a child cannot start
        (the others are stopped first)."""
        with (
            reserved_ports(self.config) as config,
            private_directory() as metrics_dir,
            self._signals_handled(),
        ):
            env = {**os.environ, MULTIPROC_ENV: metrics_dir}
            argv = self._child_argv(config)
            try:
                if self._start_all(argv, env):
                    self._keep_running(argv, env, metrics_dir)
            finally:
                self._stop_all()

    # ------------------------------------------------------------ starting

    def _start_all(self, argv: list[str], env: dict[str, str]) -> bool:
        """Start every slot and wait for every start line; False if a signal came
        first. A child that exits before its start line, or has not written it within
        ``start_timeout_s``, fails the whole start."""
        for slot in range(1, self.processes + 1):
            self._spawn(slot, argv, env)
        lines: dict[int, str] = {}
        deadline = time.monotonic() + self.start_timeout_s
        while len(lines) < self.processes:
            try:
                event = self._events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                late = sorted(c.slot for c in self._alive if c.slot not in lines)
                raise ConfigError(
                    f"gateway process {', '.join(map(str, late))} did not start within "
                    f"{self.start_timeout_s:g} s (no start line, still running): stopped; "
                    "its log above may say why"
                ) from None
            if isinstance(event, _Signalled):
                return False
            if isinstance(event, _Exited):
                self._alive.discard(event.child)
                reason = event.child.reason or f"exited ({describe_exit(event.returncode)})"
                raise ConfigError(f"gateway process {event.child.slot} could not start: {reason}")
            lines[event.child.slot] = event.line
            log.info("gateway process %d (pid %d) started", event.child.slot, event.child.pid)
        first = lines[1].removeprefix(START_PREFIX)
        self._announce(f"{START_PREFIX}{self.processes} processes, {first}")
        return True

    def _spawn(self, slot: int, argv: list[str], env: dict[str, str]) -> None:
        popen = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,  # never written: its end of file says we are gone
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            bufsize=1,
        )
        child = Child(slot, popen)
        self._alive.add(child)
        threading.Thread(
            target=self._watch, args=(child,), name=f"gateway-{slot}", daemon=True
        ).start()

    def _watch(self, child: Child) -> None:
        """Post the child's start line (or keep its reason), then its exit."""
        assert child.popen.stdout is not None
        first = True
        for line in child.popen.stdout:
            text = line.rstrip("\n")
            if first and text.startswith(START_PREFIX):
                self._events.put(_Started(child, text))
            elif first:
                child.reason = text
            else:  # nothing else is written there; keep it anyway
                print(text, file=sys.stderr, flush=True)
            first = False
        child.popen.stdout.close()
        returncode = child.popen.wait()
        if child.popen.stdin is not None:  # our end of its stdin: no use any more
            child.popen.stdin.close()
        self._events.put(_Exited(child, returncode))

    # ------------------------------------------------------------ running

    def _keep_running(self, argv: list[str], env: dict[str, str], metrics_dir: str) -> None:
        """Restart children that die, each slot after its backoff, until a signal."""
        while True:
            try:
                event: _Event | None = self._events.get(timeout=self._until_due())
            except queue.Empty:
                event = None
            self._restart_due(argv, env)
            if event is None:
                continue
            if isinstance(event, _Signalled):
                log.info("%s: stopping the gateway processes", signal.Signals(event.signum).name)
                return
            if isinstance(event, _Started):
                log.info("gateway process %d (pid %d) started", event.child.slot, event.child.pid)
            else:
                self._exited(event, metrics_dir)

    def _exited(self, event: _Exited, metrics_dir: str) -> None:
        child = event.child
        self._alive.discard(child)
        _forget_process(child.pid, metrics_dir)
        slot = child.slot
        delay = self._backoff[slot].after(time.monotonic() - child.born)
        self._due[slot] = time.monotonic() + delay
        why = describe_exit(event.returncode) + (f": {child.reason}" if child.reason else "")
        log.warning(
            "gateway process %d (pid %d) exited (%s); restarting in %.1f s",
            slot,
            child.pid,
            why,
            delay,
        )

    def _until_due(self) -> float | None:
        if not self._due:
            return None
        return max(0.0, min(self._due.values()) - time.monotonic())

    def _restart_due(self, argv: list[str], env: dict[str, str]) -> None:
        now = time.monotonic()
        for slot in [s for s, when in self._due.items() if when <= now]:
            del self._due[slot]
            self._spawn(slot, argv, env)

    # ------------------------------------------------------------ stopping

    def _stop_all(self) -> None:
        """SIGTERM to every child; wait for them (each drains); kill the late ones."""
        for child in self._alive:
            with contextlib.suppress(ProcessLookupError):
                child.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while self._alive:
            try:
                event = self._events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if isinstance(event, _Exited):
                self._alive.discard(event.child)
        for child in self._alive:
            log.warning("gateway process %d (pid %d) still runs: killing it", child.slot, child.pid)
            child.popen.kill()
            child.popen.wait()

    @contextlib.contextmanager
    def _signals_handled(self) -> Iterator[None]:
        """SIGTERM and SIGINT become events of the loop (and no KeyboardInterrupt)."""

        def handler(signum: int, _frame: FrameType | None) -> None:
            self._events.put(_Signalled(signum))

        previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for signum, old in previous.items():
                signal.signal(signum, old)


def _forget_process(pid: int, metrics_dir: str) -> None:
    """What prometheus-client's multiprocess mode asks of whoever reaps a process: drop
    its live gauges' files (a no-op where it wrote none)."""
    from prometheus_client import multiprocess  # only where processes are supervised

    multiprocess.mark_process_dead(pid, metrics_dir)  # type: ignore[no-untyped-call]


@contextlib.contextmanager
def private_directory() -> Iterator[str]:
    """A fresh directory only this user can enter (mkdtemp's 0700), removed at the end."""
    path = tempfile.mkdtemp(prefix="ipuserve-gateway-metrics-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def reserved_ports(config: GatewayConfig) -> Iterator[GatewayConfig]:
    """``config`` with every port 0 made concrete, the ports held (bound with
    SO_REUSEPORT, not listening: the kernel hands connections to listening sockets only)
    until the end, so every child, and every restarted one, binds the same port."""
    with contextlib.ExitStack() as held:
        http = _reserve(config.http, held)
        grpc = None if config.grpc is None else _reserve(config.grpc, held)
        yield replace(config, http=http, grpc=grpc)


def _reserve(address: str, held: contextlib.ExitStack) -> str:
    host, port = split_address(address)
    if port != 0:
        return address  # the children bind it; a clash is theirs to report
    for _ in range(_RESERVE_TRIES):
        sockets = _bind_everywhere(host)
        if sockets:
            for sock in sockets:
                held.callback(sock.close)
            port = sockets[0].getsockname()[1]
            return f"{address.rpartition(':')[0]}:{port}"
    raise ConfigError(f"cannot find a port free on every address of {host!r}")


def _bind_everywhere(host: str) -> list[socket.socket]:
    """Sockets on one port on every address ``host`` resolves to (as the doors bind
    them all); empty when a later address has the first one's port taken."""
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise ConfigError(f"cannot resolve {host!r}: {exc}") from exc
    sockets: list[socket.socket] = []
    port = 0
    try:
        for family, kind, proto, _, sockaddr in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:  # as asyncio binds it: beside the IPv4 one
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((sockaddr[0], port, *sockaddr[2:]))
            port = sock.getsockname()[1]
    except OSError as exc:
        for sock in sockets:
            sock.close()
        if exc.errno == errno.EADDRINUSE and port:
            return []
        raise ConfigError(f"cannot reserve a port on {host!r}: {exc}") from exc
    return sockets
