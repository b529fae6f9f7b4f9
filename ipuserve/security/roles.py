"""Whose message is this: a sender's role, judged per message against the lists in force.

ZAP is asked once per connection, at the handshake. Had it named a role there, a
key removed from an allow-list (and SIGHUP) would keep that role on its open
connection until the connection dropped. So with keys the ZAP handler gives a peer
its **public key** as User-Id (libzmq stamps it on every frame the peer sends), and
:class:`Roles` maps that key to a role through a table rebuilt from the lists on each
reload: one ``frame.get("User-Id")`` and one dict lookup a message (0.33 us for
:meth:`ZapHandler.role_of` on a loopback CURVE socket's frame; docs/security.md).
A key in no list of the socket's roles any more gets None: the broker refuses that
message (:mod:`ipuserve.broker.loop`).

Without keys nothing tells peers apart: every peer of a socket has the most it
grants (:mod:`ipuserve.security.policy`; its User-Id says so too), and no frame is
read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import zmq

from ipuserve.security.allowlists import DOMAIN_ROLES, AllowLists, Role

#: without keys, every peer of a socket has the most the socket grants (policy.py)
KEYLESS_ROLES: Mapping[str, Role] = {domain: roles[0] for domain, roles in DOMAIN_ROLES.items()}


@dataclass(frozen=True)
class Roles:
    """User-Id -> role, per ZAP domain; immutable, so a reload swaps one reference and
    a reader sees the old table or the new one, never a mix."""

    by_domain: Mapping[str, Mapping[str, Role]]
    keyed: bool

    @classmethod
    def keyless(cls) -> Roles:
        """Without keys: every peer of a socket has the role it grants (admin, worker)."""
        return cls({}, keyed=False)

    @classmethod
    def of(cls, lists: AllowLists) -> Roles:
        """With keys: every listed key (its Z85 text) to the role it has on each socket;
        a key in two lists of one socket gets the first role of DOMAIN_ROLES (admin
        before client), as at the handshake."""
        by_domain: dict[str, dict[str, Role]] = {}
        for domain, roles in DOMAIN_ROLES.items():
            table: dict[str, Role] = {}
            for role in reversed(roles):  # the role that takes precedence is written last
                table.update(dict.fromkeys((k.decode() for k in lists.keys.get(role, ())), role))
            by_domain[domain] = table
        return cls(by_domain, keyed=True)

    def role_of(self, frame: zmq.Frame, domain: str) -> Role | None:
        """The role now of the peer that sent ``frame`` on ``domain``'s socket (any frame
        of a message received with ``copy=False``), or None: no longer admitted."""
        if not self.keyed:  # the socket's role, whoever sent it: no frame to read
            return KEYLESS_ROLES[domain]
        try:
            sender = str(frame.get("User-Id"))  # sockets.peer_user_id, one call less
        except zmq.ZMQError:  # a socket without a ZAP domain: nobody judged the peer
            return None
        return self.by_domain[domain].get(sender)
