"""Bearer tokens by role, checked on every call but the health probes.

A token file holds one token per line; blank lines and ``#`` comments are skipped. Roles:
``infer`` (metadata, inference, statistics) and ``admin`` (what later changes the fleet;
an admin token also passes where ``infer`` is asked). With no token configured for a
role, that role is open: the bind rules (loopback unless TLS or ``--insecure``) guard
such a gateway. Tokens are compared with :func:`hmac.compare_digest`, so the time a
refusal takes does not tell how much of a guess was right.

Refusals are counted by door in ``ipuserve_gateway_token_refusals_total`` (the counter
given, :mod:`gateway.metrics`), which a scrape of any of the gateway's processes sums
over all of them, and in :attr:`Tokens.refused`, this process's, logged at stop.
"""

from __future__ import annotations

import hmac
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path

from prometheus_client import Counter

from ipuserve.errors import ConfigError, UnauthenticatedError

ROLES = ("infer", "admin")
#: roles whose tokens also pass for a role (admin may do what infer may)
_ALSO: Mapping[str, tuple[str, ...]] = {"infer": ("admin",), "admin": ()}


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
        """No tokens: every role open."""
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

    def required(self, role: str) -> bool:
        """Whether calls of ``role`` need a token."""
        return any(self._by_role[r] for r in (role, *_ALSO[role]))

    def check(self, authorization: str | None, role: str, *, door: str) -> None:
        """Pass, or raise :class:`UnauthenticatedError` saying what is wrong with the
        ``Authorization`` header's value (counted, under ``door``)."""
        if not self.required(role):
            return
        problem = self._problem(authorization, role)
        if problem is not None:
            with self._lock:
                self._refused += 1
            if self._refusals is not None:
                self._refusals.labels(door).inc()
            raise UnauthenticatedError(problem)

    def _problem(self, authorization: str | None, role: str) -> str | None:
        if not authorization:
            return f"missing Authorization header: this gateway needs a bearer token ({role} role)"
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return "the Authorization header is not a bearer token ('Bearer TOKEN')"
        given = token.strip().encode()
        if any(self._matches(given, r) for r in (role, *_ALSO[role])):
            return None
        return f"unknown bearer token for the {role} role"

    def _matches(self, given: bytes, role: str) -> bool:
        found = False
        for known in self._by_role[role]:  # compare with every token: no early exit
            found |= hmac.compare_digest(given, known)
        return found
