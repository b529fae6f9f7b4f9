"""Keys, allow-lists and a pair of real ZeroMQ sockets on loopback for the security tests.

Nothing waits on time: a peer's fate is read from its own socket monitor (the
handshake either succeeds or fails with the ZAP status), and a message is waited
for with a poll whose timeout only bounds a failing test.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from ipuserve.security import KeyPair, Role, generate_keypair, load_secret_key
from tests.helpers import processes  # noqa: F401  (a fixture: real processes)

#: bounds a failing wait; a passing test never comes near it
WAIT_MS = 10_000
HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


@dataclass
class Keys:
    """A broker pair, one pair per role, and the allow-list directory of each role."""

    root: Path
    broker: KeyPair
    pairs: dict[str, KeyPair]
    dirs: dict[Role, Path]

    def make(self, name: str, into: Role | None = None) -> KeyPair:
        """A new pair under keys/; its public file copied into ``into``'s list."""
        files = generate_keypair(name, self.root / "keys")
        if into is not None:
            (self.dirs[into] / files.public.name).write_bytes(files.public.read_bytes())
        return load_secret_key(files.secret)


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    (tmp_path / "keys").mkdir()
    dirs = {role: tmp_path / f"{role.value}s" for role in Role}
    for folder in dirs.values():
        folder.mkdir()
    made = Keys(tmp_path, KeyPair(b"", b""), {}, dirs)
    made.broker = made.make("broker")
    for role in Role:
        made.pairs[role.value] = made.make(role.value, into=role)
    made.pairs["stranger"] = made.make("stranger")
    return made


@pytest.fixture
def context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    """A private context per test: a context holds at most one ZAP handler."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        yield ctx
    finally:
        ctx.destroy(linger=0)


def watch(sock: zmq.Socket[bytes]) -> zmq.Socket[bytes]:
    """A monitor of ``sock``'s handshakes; make it before ``connect``."""
    return sock.get_monitor_socket(HANDSHAKE_EVENTS)


def handshake(monitor: zmq.Socket[bytes]) -> tuple[int, int]:
    """The first handshake outcome the monitor reports: (event, value); a ZAP
    refusal is EVENT_HANDSHAKE_FAILED_AUTH with the ZAP status code (400)."""
    assert monitor.poll(WAIT_MS), "no handshake outcome reported"
    event = recv_monitor_message(monitor)
    return int(event["event"]), int(event["value"])


def receive(sock: zmq.Socket[bytes]) -> list[zmq.Frame]:
    assert sock.poll(WAIT_MS), "nothing received"
    return sock.recv_multipart(copy=False)
