"""Allow-lists: one directory of public-key files per role.

A role is what a peer may do: a ``client`` infers, a ``worker`` serves (and so
receives every client's tensors), an ``admin`` may also change the fleet. Each
role's directory holds ``*.key`` files in pyzmq's certificate format (the ones
``ipuserve keys generate`` writes; czmq's and pyzmq's tools write the same).
Adding a peer is copying its public file in; removing it is deleting the file;
:meth:`AllowLists.load` is called again on SIGHUP. Only ``*.key`` files count: a
README or a ``.key_secret`` beside them is ignored (the latter with a warning,
since a secret key has no business on the broker's disk).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from ipuserve.errors import ConfigError
from ipuserve.security.keys import PUBLIC_SUFFIX, SECRET_SUFFIX, fingerprint, load_public_key

log = logging.getLogger(__name__)


class Role(StrEnum):
    """What an admitted peer may do; the value is the User-Id its frames carry."""

    CLIENT = "client"
    WORKER = "worker"
    ADMIN = "admin"


#: ZAP domain of each broker socket, and the roles it admits, in order of precedence
#: (a key in both the admin and the client list is an admin)
FRONTEND_DOMAIN = "frontend"
BACKEND_DOMAIN = "backend"
DOMAIN_ROLES: Mapping[str, tuple[Role, ...]] = {
    FRONTEND_DOMAIN: (Role.ADMIN, Role.CLIENT),
    BACKEND_DOMAIN: (Role.WORKER,),
}


@dataclass(frozen=True)
class AllowLists:
    """The public keys (Z85 bytes) each role admits, read from one directory per role.

    Immutable: a reload builds a new one and the handler swaps a single reference,
    so the ZAP thread never sees a half-read list."""

    dirs: Mapping[Role, Path]
    keys: Mapping[Role, frozenset[bytes]] = field(default_factory=dict)

    @classmethod
    def load(cls, dirs: Mapping[Role, Path | str]) -> AllowLists:
        """Read every role's directory; ConfigError naming the first bad directory or
        file, so a broker never starts (or reloads) with a list it misread."""
        paths = {Role(role): Path(folder) for role, folder in dirs.items()}
        keys = {role: _read_dir(role, folder) for role, folder in paths.items()}
        return cls(dirs=paths, keys=keys)

    def reloaded(self) -> AllowLists:
        """The same directories read again (ConfigError leaves ``self`` as it was)."""
        return AllowLists.load(self.dirs)

    def role_of(self, domain: str, public_key: bytes) -> Role | None:
        """The role ``public_key`` has on ``domain``'s socket, or None: refused."""
        for role in DOMAIN_ROLES.get(domain, ()):
            if public_key in self.keys.get(role, frozenset()):
                return role
        return None

    def counts(self) -> dict[str, int]:
        """Keys per role, for the start-up line and the reload log."""
        return {role.value: len(self.keys.get(role, frozenset())) for role in self.dirs}


def _read_dir(role: Role, folder: Path) -> frozenset[bytes]:
    if not folder.is_dir():
        raise ConfigError(f"{role.value} key directory {folder} does not exist or is not one")
    try:
        names = sorted(p for p in folder.iterdir() if not p.name.startswith("."))
    except OSError as exc:
        raise ConfigError(f"cannot read {role.value} key directory {folder}: {exc}") from exc
    for path in names:
        if path.name.endswith(SECRET_SUFFIX):
            log.warning(
                "%s is a secret key in the %s allow-list; only public %s files belong "
                "there (ignored; remove it and treat the key as exposed)",
                path,
                role.value,
                PUBLIC_SUFFIX,
            )
    keys = frozenset(load_public_key(p) for p in names if p.name.endswith(PUBLIC_SUFFIX))
    if not keys:
        log.warning(
            "%s key directory %s holds no %s file: no %s is admitted",
            role.value,
            folder,
            PUBLIC_SUFFIX,
            role.value,
        )
    for key in sorted(keys):
        log.debug("%s key %s allowed", role.value, fingerprint(key))
    return keys
