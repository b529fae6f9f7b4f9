"""Bearer tokens by role, checked on every call but the health probes.

A token file holds one token per line; blank lines and ``#`` comments are skipped. Roles:
``infer`` (metadata, inference, statistics) and ``admin`` (the model repository: what
changes the fleet; an admin token also passes where ``infer`` is asked). Roles close by
default:

- no token at all: ``infer`` is open (the bind rules, loopback unless TLS or
  ``--insecure``, guard such a gateway) and ``admin`` is served to loopback peers only,
  so a door published beyond the host never hands out the fleet;
- any token configured: a role that no configured token passes is closed
  (:class:`PermissionDeniedError` naming the missing option), and every other call
  needs a token that passes: none, a malformed one or an unknown one is
  :class:`UnauthenticatedError` (401), a known token of another role
  :class:`PermissionDeniedError` (403).

Tokens are compared with :func:`hmac.compare_digest`, so the time a refusal takes does
not tell how much of a guess was right.

Refusals are counted by door in ``ipuserve_gateway_token_refusals_total`` (the counter
given, :mod:`gateway.metrics`), which a scrape of any of the gateway's processes sums
over all of them, and in :attr:`Tokens.refused`, this process's, logged at stop.
"""

from __future__ import annotations

import hmac
import ipaddress
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path

from prometheus_client import Counter

from ipuserve.errors import ConfigError, PermissionDeniedError, UnauthenticatedError

ROLES = ("infer", "admin")
#: roles whose tokens also pass for a role (admin may do what infer may)
_ALSO: Mapping[str, tuple[str, ...]] = {"infer": ("admin",), "admin": ()}
#: the option that configures each role's tokens, named in refusals
OPTIONS: Mapping[str, str] = {"infer": "--infer-tokens", "admin": "--admin-tokens"}


def is_loopback(host: str | None) -> bool:
    """Whether a peer address (``127.0.0.1``, ``::1``, ``::ffff:127.0.0.1``) is this
    host's loopback; an unknown or unparsable one is not."""
    if not host:
        return False
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def grpc_peer_host(peer: str | None) -> str | None:
    """The address in grpcio's peer string (``ipv4:127.0.0.1:5000``,
    ``ipv6:[::1]:5000``); None for another kind (``unix:...``) or none."""
    if not peer:
        return None
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    if kind == "ipv6":
        return rest.rsplit(":", 1)[0].strip("[]")
    return None


def read_token_file(path: Path) -> tuple[bytes, ...]:
    """The tokens in ``path``; :class:`ConfigError` if it is unreadable or holds none."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read token file {path}: {exc}") from exc
    tokens = tuple(
        line.strip().encode()
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    )
    if not tokens:
        raise ConfigError(f"token file {path} holds no token (one per line, # comments)")
    return tokens


class Tokens:
    """The tokens of each role, and how many calls were refused."""

    def __init__(
        self, by_role: Mapping[str, Iterable[bytes]], refusals: Counter | None = None
    ) -> None:
        """``refusals``: the counter labelled by door that refusals add to, if any."""
        unknown = set(by_role) - set(ROLES)
        if unknown:
            raise ConfigError(f"unknown token roles {sorted(unknown)} (roles: {', '.join(ROLES)})")
        self._by_role = {role: tuple(by_role.get(role, ())) for role in ROLES}
        self._lock = threading.Lock()  # the gRPC door may check from its own threads
        self._refused = 0
        self._refusals = refusals

    @classmethod
    def none(cls) -> Tokens:
        """No tokens: ``infer`` open, ``admin`` to loopback peers only."""
        return cls({})

    @classmethod
    def from_files(
        cls,
        *,
        infer: Path | None = None,
        admin: Path | None = None,
        refusals: Counter | None = None,
    ) -> Tokens:
        by_role: dict[str, tuple[bytes, ...]] = {}
        if infer is not None:
            by_role["infer"] = read_token_file(infer)
        if admin is not None:
            by_role["admin"] = read_token_file(admin)
        return cls(by_role, refusals)

    @property
    def refused(self) -> int:
        """Calls refused so far."""
        return self._refused

    @property
    def configured(self) -> bool:
        """Whether any token is configured (then roles without tokens are closed)."""
        return any(self._by_role.values())

    def describe(self) -> str:
        """The start line's words for who may call what."""
        if not self.configured:
            return "no tokens (repository admin calls from loopback only)"
        closed = [r for r in ROLES if not self._passing(r)]
        return "bearer tokens" + (f" ({', '.join(closed)} closed)" if closed else "")

    def check(
        self, authorization: str | None, role: str, *, door: str, peer: str | None = None
    ) -> None:
        """Pass, or raise :class:`UnauthenticatedError` (401: no valid token) or
        :class:`PermissionDeniedError` (403: the role is closed, or the token is
        another role's) saying what is wrong (counted, under ``door``). ``peer``: the
        caller's address, which decides an admin call on a gateway with no tokens."""
        problem = self._problem(authorization, role, peer)
        if problem is not None:
            with self._lock:
                self._refused += 1
            if self._refusals is not None:
                self._refusals.labels(door).inc()
            raise problem

    def _problem(
        self, authorization: str | None, role: str, peer: str | None
    ) -> UnauthenticatedError | PermissionDeniedError | None:
        if not self.configured:
            if role == "admin" and not is_loopback(peer):
                return PermissionDeniedError(
                    "repository (admin) calls are served to loopback peers only on a gateway"
                    " with no tokens: configure admin tokens (--admin-tokens)"
                )
            return None
        if not self._passing(role):
            return PermissionDeniedError(
                f"no {role} tokens are configured ({OPTIONS[role]}): {role} calls are closed"
            )
        if not authorization:
            return UnauthenticatedError(
                f"missing Authorization header: this gateway needs a bearer token ({role} role)"
            )
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return UnauthenticatedError(
                "the Authorization header is not a bearer token ('Bearer TOKEN')"
            )
        try:
            given = token.strip().encode("utf-8")
        except UnicodeEncodeError:  # a header decoded with surrogates: no token's bytes
            return UnauthenticatedError("unknown bearer token (not UTF-8 text)")
        if any(self._matches(given, r) for r in (role, *_ALSO[role])):
            return None
        other = [r for r in ROLES if r != role and self._matches(given, r)]
        if other:
            return PermissionDeniedError(
                f"this {other[0]} token may not make {role} calls (an {role} token may)"
            )
        return UnauthenticatedError(f"unknown bearer token for the {role} role")

    def _passing(self, role: str) -> bool:
        """Whether any configured token passes for ``role``."""
        return any(self._by_role[r] for r in (role, *_ALSO[role]))

    def _matches(self, given: bytes, role: str) -> bool:
        found = False
        for known in self._by_role[role]:  # compare with every token: no early exit
            found |= hmac.compare_digest(given, known)
        return found
