"""Who is admitted: the ZAP decision as a pure function, apart from the thread.

Three modes, fixed when the broker starts:

- ``CURVE``: the broker has a secret key and allow-lists. A peer is admitted when
  its public key is in a list of a role its socket's domain admits
  (:data:`~ipuserve.security.allowlists.DOMAIN_ROLES`); its User-Id is its public
  key (Z85), so that the broker judges each of its messages against the lists in
  force *then* (:class:`~ipuserve.security.roles.Roles`), not once at the handshake.
- ``PROTECTED`` (no keys, the default, as Redis does it): only peers on this host
  are admitted: a loopback address (127.0.0.0/8, ::1, IPv4-mapped ::ffff:127.x) or
  an ipc:// socket. Nothing is encrypted; a process on the host is trusted as much
  as today.
- ``INSECURE`` (no keys, ``--insecure``): every address is admitted.

Without keys the broker cannot tell roles apart, so an admitted peer gets the most
a socket grants (``admin`` on the frontend, ``worker`` on the backend), and that role
is its User-Id: the keyless demo keeps every command. What reaches the peer is the
ZAP status only (200 or 400); the reason is for the broker's log.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from enum import StrEnum

from zmq.utils import z85

from ipuserve.security.allowlists import DOMAIN_ROLES, AllowLists
from ipuserve.security.keys import RAW_KEY_BYTES, fingerprint

#: who the log names when a keyless peer is refused: its address
LOOPBACK_NETWORKS = "127.0.0.0/8 and ::1"


class Mode(StrEnum):
    CURVE = "curve"
    PROTECTED = "protected"
    INSECURE = "insecure"


@dataclass(frozen=True)
class Verdict:
    """One ZAP answer. ``user_id`` is what every frame of an admitted peer carries (its
    key with keys, its role without), ``role`` what it was admitted as; ``who`` names
    the peer in the log (a key's fingerprint, or an address); ``reason`` says why it
    was refused (never sent to the peer)."""

    admitted: bool
    user_id: str = ""
    role: str = ""
    who: str = ""
    reason: str = ""


def is_local_address(address: str) -> bool:
    """Whether a ZAP request's peer address is on this host.

    libzmq gives a TCP peer as a numeric address (``127.0.0.1``, ``::1``, or
    ``::ffff:127.0.0.1`` on an IPv6-enabled socket) and an ipc:// peer as
    ``localhost:UID:GID:PID`` (or nothing where the OS has no peer credentials);
    a link-local address with a zone (``fe80::1%eth0``) is another host."""
    if address == "" or address.startswith("localhost:"):
        return True
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback


def decide(
    mode: Mode,
    lists: AllowLists | None,
    domain: str,
    address: str,
    mechanism: bytes,
    credentials: list[bytes],
) -> Verdict:
    """The answer to one ZAP request (RFC 27) under ``mode``."""
    roles = DOMAIN_ROLES.get(domain)
    if roles is None:
        return Verdict(False, who=address, reason=f"unknown ZAP domain {domain!r}")
    if mode is Mode.CURVE:
        return _decide_curve(lists, domain, mechanism, credentials)
    keyless = roles[0].value  # the most this socket grants: see the module docstring
    if mechanism != b"NULL":
        return Verdict(False, who=address, reason=f"{mechanism!r} to a broker without keys")
    if mode is Mode.INSECURE or is_local_address(address):
        return Verdict(True, user_id=keyless, role=keyless, who=address)
    return Verdict(
        False,
        who=f"address {address}",
        reason=f"not a loopback address (protected mode admits only {LOOPBACK_NETWORKS})",
    )


def _decide_curve(
    lists: AllowLists | None, domain: str, mechanism: bytes, credentials: list[bytes]
) -> Verdict:
    if mechanism != b"CURVE" or len(credentials) != 1 or len(credentials[0]) != RAW_KEY_BYTES:
        return Verdict(False, who=f"mechanism {mechanism!r}", reason="not a CURVE peer")
    key = z85.encode(credentials[0])
    who = f"key {fingerprint(key)}"
    role = lists.role_of(domain, key) if lists is not None else None
    if role is None:
        admitting = " or ".join(r.value for r in DOMAIN_ROLES[domain])
        return Verdict(False, who=who, reason=f"not in the {admitting} allow-list")
    return Verdict(True, user_id=key.decode(), role=role.value, who=who)
