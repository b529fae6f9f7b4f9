"""Who may do what at the broker's frontend: the role a client's message carries.

The ZAP handler gives every peer a role at its handshake (docs/security.md): with keys,
the allow-list its key is in (``admin`` before ``client``); without keys, the most the
socket grants (``admin`` on the frontend: protected mode trusts this host). libzmq
stamps that role on every frame the peer sends as its User-Id. This is the one place
the broker reads it, so judging each message by its sender's key against the lists in
force now (after a SIGHUP) changes this function only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ipuserve.security import Role, peer_user_id


def is_admin(frames: Sequence[Any]) -> bool:
    """Whether the client that sent ``frames`` (as received: zmq.Frame objects, the
    ROUTER's identity first) has the admin role."""
    return bool(frames) and peer_user_id(frames[-1]) == Role.ADMIN.value
