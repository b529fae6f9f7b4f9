"""CurveZMQ for ipuserve: keys, allow-lists by role, the broker's ZAP handler.

    keys.py        generate / load key files, fingerprints for logs
    allowlists.py  Role, one directory of public keys per role, re-read on SIGHUP
    policy.py      who is admitted (CURVE, protected, insecure): a pure function
    roles.py       Roles: a message's sender's role now (its key's, since the last reload)
    zap.py         ZapHandler, the RFC 27 thread on the broker's context; counters
    sockets.py     one call to configure a server or client socket; ClientKeys
    cli.py         ``ipuserve keys generate`` / ``ipuserve keys show``; the peers' key options

docs/security.md has the threat model and how to deploy keys.
"""

from __future__ import annotations

from ipuserve.security.allowlists import (
    BACKEND_DOMAIN,
    DOMAIN_ROLES,
    FRONTEND_DOMAIN,
    AllowLists,
    Role,
)
from ipuserve.security.keys import (
    KeyFiles,
    KeyPair,
    KeySource,
    fingerprint,
    generate_keypair,
    load_public_key,
    load_secret_key,
)
from ipuserve.security.policy import Mode, Verdict, decide, is_local_address
from ipuserve.security.roles import Roles
from ipuserve.security.sockets import (
    ClientKeys,
    client_keys,
    client_socket,
    curve_client,
    curve_server,
    keyless_server,
    peer_user_id,
    server_socket,
)
from ipuserve.security.zap import ZapHandler, reload_on_sighup, startup_line

__all__ = [
    "BACKEND_DOMAIN",
    "DOMAIN_ROLES",
    "FRONTEND_DOMAIN",
    "AllowLists",
    "ClientKeys",
    "KeyFiles",
    "KeyPair",
    "KeySource",
    "Mode",
    "Role",
    "Roles",
    "Verdict",
    "ZapHandler",
    "client_keys",
    "client_socket",
    "curve_client",
    "curve_server",
    "decide",
    "fingerprint",
    "generate_keypair",
    "is_local_address",
    "keyless_server",
    "load_public_key",
    "load_secret_key",
    "peer_user_id",
    "reload_on_sighup",
    "server_socket",
    "startup_line",
]
