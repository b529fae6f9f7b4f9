"""The admission policy on the addresses and credentials it is given, without sockets."""

from __future__ import annotations

from pathlib import Path

import pytest
from zmq.utils import z85

from ipuserve.security import (
    BACKEND_DOMAIN,
    FRONTEND_DOMAIN,
    AllowLists,
    Mode,
    Role,
    decide,
    generate_keypair,
    is_local_address,
    load_public_key,
    startup_line,
)


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1", "127.5.6.7", "::1", "::ffff:127.0.0.1", "localhost:0:0:812", ""],
)
def test_local_addresses(address: str) -> None:
    assert is_local_address(address)


@pytest.mark.parametrize(
    "address",
    [
        "10.200.0.2",
        "192.168.1.1",
        "0.0.0.0",
        "::",
        "::ffff:10.0.0.1",
        "fe80::1%eth0",
        "2001:db8::1",
        "128.0.0.1",
        "localhost",
        "evil:0:0:1",
        "127.0.0.1.example.com",
    ],
)
def test_other_addresses(address: str) -> None:
    assert not is_local_address(address)


def test_protected_mode_admits_loopback_null_peers_only() -> None:
    loopback = decide(Mode.PROTECTED, None, FRONTEND_DOMAIN, "127.0.0.1", b"NULL", [])
    assert loopback.admitted and loopback.user_id == loopback.role == "admin"
    remote = decide(Mode.PROTECTED, None, BACKEND_DOMAIN, "10.200.0.2", b"NULL", [])
    assert not remote.admitted and "10.200.0.2" in remote.who
    assert "loopback" in remote.reason


def test_insecure_mode_admits_every_address() -> None:
    remote = decide(Mode.INSECURE, None, BACKEND_DOMAIN, "10.200.0.2", b"NULL", [])
    assert remote.admitted and remote.user_id == remote.role == "worker"


def test_keyless_modes_refuse_other_mechanisms_and_domains() -> None:
    assert not decide(Mode.INSECURE, None, FRONTEND_DOMAIN, "::1", b"PLAIN", [b"u", b"p"]).admitted
    assert not decide(Mode.INSECURE, None, "other", "::1", b"NULL", []).admitted


def test_curve_mode_judges_by_key_and_domain(tmp_path: Path) -> None:
    dirs = {role: tmp_path / role.value for role in Role}
    keys = {}
    for role, folder in dirs.items():
        folder.mkdir()
        keys[role] = z85.decode(load_public_key(generate_keypair("k", folder).public))
    lists = AllowLists.load(dirs)

    def granted(domain: str, key: bytes, mechanism: bytes = b"CURVE") -> str | None:
        verdict = decide(Mode.CURVE, lists, domain, "10.0.0.9", mechanism, [key])
        return verdict.role if verdict.admitted else None

    assert granted(FRONTEND_DOMAIN, keys[Role.CLIENT]) == "client"
    # the User-Id names the key, not its role: the broker judges each message by it
    client = decide(Mode.CURVE, lists, FRONTEND_DOMAIN, "10.0.0.9", b"CURVE", [keys[Role.CLIENT]])
    assert client.user_id == z85.encode(keys[Role.CLIENT]).decode()
    assert granted(FRONTEND_DOMAIN, keys[Role.ADMIN]) == "admin"
    assert granted(FRONTEND_DOMAIN, keys[Role.WORKER]) is None
    assert granted(BACKEND_DOMAIN, keys[Role.WORKER]) == "worker"
    assert granted(BACKEND_DOMAIN, keys[Role.CLIENT]) is None
    assert granted("elsewhere", keys[Role.CLIENT]) is None
    assert granted(FRONTEND_DOMAIN, keys[Role.CLIENT], b"NULL") is None
    assert granted(FRONTEND_DOMAIN, b"\0" * 32) is None
    assert granted(FRONTEND_DOMAIN, b"short") is None


def test_the_startup_line_names_the_mode() -> None:
    assert "protected mode" in startup_line(Mode.PROTECTED, None)
    assert "--insecure" in startup_line(Mode.PROTECTED, None)
    assert "INSECURE" in startup_line(Mode.INSECURE, None)
