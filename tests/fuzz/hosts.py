"""Fuzzing the broker's repository control plane: a fake repository worker (a *host*)
that lies, and an admin that loads, unloads and lists through the frontend.

The fake host joins as a repository worker does (HELLO with no models and credit 0,
then HOST reports) and then, one message at a time, sends HOST reports valid and
malformed — free_ipus above its ipus, hosted versions its repository lacks or it does
not serve, repositories of thousands of entries within the 256 KiB header limit,
broken entries, duplicates, mutated frames — answers or ignores the LOAD and UNLOAD it
gets, and dies (its socket closed without BYE, then back under its id or another) or
leaves (BYE). Between its messages an admin (the fuzzer's loopback client: admin in
protected mode) sends REPOSITORY commands, each of which must be answered exactly once
with a REPOSITORY_REPLY or an ERROR of an allowed code (tests/fuzz/repository.py),
and the index must list only the four states. The probes of the other halves hold:
a well-formed ``add`` request is answered correctly within a second after every 500
messages, MODELS keeps working, the broker stays up and its RSS bounded.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import zmq

from ipuserve import protocol as wire
from ipuserve.protocol import Command
from tests.fuzz.engine import PROBE_EVERY, Report, decodes, frames_of, mutate, rss_bytes
from tests.fuzz.frontend import probe
from tests.fuzz.repository import (
    STATES,
    check_index,
    check_repository_answer,
    repository_header,
)

ANSWER_TIMEOUT_S = 2.0
IPUS = 4
#: The versions the fake host's repository holds (and a broken one).
ENTRIES = [("fz", "1"), ("fz", "2"), ("mlp", "1"), ("mlp", "3"), ("add", "1")]
ACTIONS = [
    "host", "host", "host-lying", "host-lying", "host-huge", "host-mutated",
    "admin", "admin", "admin", "admin-load", "admin-load", "admin-unload",
    "heartbeat", "die", "leave",
]  # fmt: skip


class HostFuzzer:
    """Runs the fake host and the admin for ``messages`` messages."""

    def __init__(
        self, frontend: str, backend: str, broker_pid: int, seed: int, ops: list[str] | None = None
    ) -> None:
        self.rng = random.Random(seed)
        #: the mutations to draw from (engine.mutate; None: all), and the actions: with
        #: ``ops`` given, mostly HOST reports so mutated
        self.ops = ops
        self.actions = ACTIONS if ops is None else ["host", "admin", *["host-mutated"] * 4]
        self.report = Report("host", seed)
        self.pid = broker_pid
        self.frontend, self.backend = frontend, backend
        self.context: zmq.Context[Any] = zmq.Context.instance()
        self.admin = self._dealer(frontend)
        self.prober = self._dealer(frontend)
        self.host = self._dealer(backend)
        self.host_id = "fuzz-host"
        self.hosted: dict[tuple[str, str], str] = {}  # what it says it hosts: state
        self.serial = 0

    def _dealer(self, endpoint: str) -> zmq.Socket[Any]:
        socket: zmq.Socket[Any] = self.context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(endpoint)
        return socket

    def close(self) -> None:
        for socket in (self.admin, self.prober, self.host):
            socket.close(linger=0)

    # ------------------------------------------------------------ the run

    def run(self, messages: int, alive: Callable[[], bool] = lambda: True) -> Report:
        """``messages`` messages, or until the broker is no longer ``alive``."""
        report = self.report
        report.rss_before = rss_bytes(self.pid)
        self.join()
        next_probe = PROBE_EVERY
        while report.sent < messages and alive():
            action = self.rng.choice(self.actions)
            report.mutations[action] += 1
            getattr(self, "do_" + action.replace("-", "_"))()
            self.serve()
            if report.sent >= next_probe:
                probe(self.prober, self.rng, report, report.sent)
                next_probe += PROBE_EVERY
        self.join()
        self.command({"action": "index"})
        report.rss_after = rss_bytes(self.pid)
        return report

    def send(self, frames: list[bytes]) -> None:
        self.host.send_multipart(frames, copy=False)
        self.report.sent += 1

    def join(self) -> None:
        """HELLO as a host, wait for the WELCOME, report."""
        self.send(wire.Hello(self.host_id, (), 0).encode())
        deadline = time.monotonic() + 5
        while (left := deadline - time.monotonic()) > 0 and self.host.poll(int(left * 1000) + 1):
            if isinstance(decodes(self.host.recv_multipart())[0], wire.Welcome):
                self.hosted.clear()  # a host that registers again has lost what it held
                self.send(self.report_frames())
                return
        self.report.violate("a host is welcomed", f"{self.host_id}: no WELCOME within 5 s")

    def serve(self) -> None:
        """Read what the broker sent the host: a LOAD or UNLOAD is answered (a HOST
        report that says LOADING, then READY; UNLOADING, then gone) or ignored."""
        while self.host.poll(0):
            message, why = decodes(self.host.recv_multipart())
            self.report.answers[f"host got {type(message).__name__}"] += 1
            if message is None:
                self.report.violate("broker sends only well-formed messages", f"to a host: {why}")
            elif isinstance(message, wire.Load) and self.rng.random() < 0.8:
                key = (message.name, message.version)
                self.hosted[key] = self.rng.choice(["LOADING", "READY", "READY", "UNAVAILABLE"])
                self.send(self.report_frames())
            elif isinstance(message, wire.Unload) and self.rng.random() < 0.8:
                key = (message.name, message.version)
                if self.rng.random() < 0.5:
                    self.hosted[key] = "UNLOADING"
                else:
                    self.hosted.pop(key, None)
                self.send(self.report_frames())
            elif isinstance(message, wire.Reconnect):
                self.join()

    # ------------------------------------------------------------ HOST reports

    def report_frames(self, lying: bool = False) -> list[bytes]:
        entries = [wire.Entry(n, v, replicas=self.rng.choice([1, 1, 2])) for n, v in ENTRIES]
        entries.append(wire.Entry("broken", "1", problem="config.toml: replicas is 0"))
        hosted = [
            wire.Hosted(
                n, v, state, f"{self.host_id}/{n}/{v}", reason="fuzz" * (state == "UNAVAILABLE")
            )
            for (n, v), state in sorted(self.hosted.items())
        ]
        used = sum(1 for state in self.hosted.values() if state != "UNAVAILABLE")
        ipus, free = IPUS, max(IPUS - used, 0)
        if lying:
            lie = self.rng.randrange(5)
            if lie == 0:
                free = ipus + self.rng.choice([1, 100, 2**40])
            elif lie == 1:  # hosts what its repository lacks, or what it does not serve
                hosted.append(
                    wire.Hosted("ghost", self.rng.choice(["1", "7"]), "READY", "nobody/ghost/1")
                )
            elif lie == 2:
                entries = entries + entries  # every entry twice
            elif lie == 3:
                hosted = hosted + hosted
            else:
                ipus, free = 0, 0
        return wire.Host(ipus, free, tuple(entries), tuple(hosted)).encode()

    def do_host(self) -> None:
        self.send(self.report_frames())

    def do_host_lying(self) -> None:
        self.send(self.report_frames(lying=True))

    def do_host_huge(self) -> None:
        """A repository of thousands of entries, its header just under the limit."""
        name = self.rng.choice(["m", "m" * 200])
        count = (200 << 10) // (len(name) + 40)
        entries = tuple(wire.Entry(f"{name}{i}", "1") for i in range(count))
        self.send(wire.Host(IPUS, IPUS, entries, ()).encode())

    def do_host_mutated(self) -> None:
        lying = self.rng.random() < 0.5
        op, frames = mutate(self.rng, self.report_frames(lying=lying), self.ops)
        self.report.mutations[f"host-mutated/{op}"] += 1
        self.send(frames)

    def do_heartbeat(self) -> None:
        self.send(wire.Heartbeat(0, 0).encode())

    def do_die(self) -> None:
        """The host's process dies: its socket closes without BYE; it comes back (a new
        connection) under its id or another."""
        self.host.close(linger=0)
        self.host = self._dealer(self.backend)
        if self.rng.random() < 0.3:
            self.serial += 1
            self.host_id = f"fuzz-host-{self.serial}"
        self.join()

    def do_leave(self) -> None:
        self.send(wire.Bye().encode())
        self.join()

    # ------------------------------------------------------------ the admin

    def do_admin(self) -> None:
        self.command(repository_header(self.rng))

    def do_admin_load(self) -> None:
        name, version = self.rng.choice([*ENTRIES, ("broken", "1"), ("ghost", "1")])
        header: dict[str, Any] = {"action": "load", "model": name}
        if self.rng.random() < 0.7:
            header["version"] = version
        if self.rng.random() < 0.3:
            header["workers"] = self.rng.choice([1, 2, 5])
        self.command(header)

    def do_admin_unload(self) -> None:
        keys = list(self.hosted) or ENTRIES
        name, version = self.rng.choice(keys)
        header: dict[str, Any] = {"action": "unload", "model": name}
        if self.rng.random() < 0.7:
            header["version"] = version
        self.command(header)

    def command(self, header: dict[str, Any]) -> None:
        """Send a REPOSITORY and check its one answer."""
        self.serial += 1
        rid = b"r%07d" % self.serial
        frames = frames_of(Command.REPOSITORY, rid, header)
        message, _why = decodes(frames)
        self.admin.send_multipart(frames)
        self.report.sent += 1
        what = f"REPOSITORY {header}"[:200]
        answers = 0
        deadline = time.monotonic() + ANSWER_TIMEOUT_S
        while (left := deadline - time.monotonic()) > 0 and self.admin.poll(int(left * 1000) + 1):
            answer, why = decodes(self.admin.recv_multipart())
            if answer is None:
                self.report.violate("broker sends only well-formed messages", f"{what}: {why}")
                continue
            if getattr(answer, "request_id", None) != rid:
                self.report.violate("exactly one answer per command", f"{what}: {answer!r:.200}")
                continue
            answers += 1
            code = getattr(answer, "code", "REPOSITORY_REPLY")
            self.report.answers[str(code)] += 1
            check_repository_answer(frames, message, answer, self.report, what)
            if isinstance(answer, wire.RepositoryReply):
                check_index(answer, self.report, what)
                bad = [v for v in answer.models if v.state not in STATES]
                assert not bad  # (check_index reports them; the decoder refuses them)
            break
        if answers == 0:
            self.report.violate(
                "an admin's REPOSITORY is answered", f"{what}: none in {ANSWER_TIMEOUT_S} s"
            )
