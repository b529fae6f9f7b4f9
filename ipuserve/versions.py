"""Which version of a model a request that names none goes to, and version order: the
one version rule of the fabric.

The broker routes by it (its registry recomputes a name's default whenever a worker
joins, leaves or starts draining) and the gateway's metadata answers by it (from the
broker's listing, whose workers carry their credit), so a request that names no version
and the metadata of "the model" speak of the same version. The rule is here, in the
common ground, so that neither component re-decides it; what a version string may be
(its syntax) is the wire's (:mod:`ipuserve.protocol`).

A model's default version is, in order: the version its config pins
(``ModelSpec.default_version``) while a worker serves it; else the latest (largest)
version a worker serves; else, with no worker at all, the latest version the broker
still knows (orphaned lately: the request then waits, or is answered UNAVAILABLE, as
any request to an orphaned model). A version whose every worker is draining (credit
0: an unload, a SIGTERM) counts as served only when no other version takes jobs, so
requests stop going to a version on its way out the moment it starts to leave.
Versions are positive integers written as strings (the wire's ``Version``), ordered
as numbers: "10" is later than "9".

Pure functions of two tables -- each version's spec, and the workers serving it -- so
the broker's registry can recompute a name's default whenever a worker joins or
leaves (admission then reads one dict), and the gateway can apply the same rule to the
broker's MODELS listing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from ipuserve.limits import is_version
from ipuserve.protocol import ModelSpec

#: A model version as the broker routes by: (name, version).
Key = tuple[str, str]


class Credited(Protocol):
    """A worker as far as the default is concerned: whether it takes jobs (the broker's
    own record of a worker, or a listing's :class:`~ipuserve.protocol.WorkerLoad`)."""

    @property
    def credit(self) -> int: ...


def version_order(version: str) -> tuple[int, str]:
    """Sort key of a version: as a number (an unnumbered one, never on the wire, first)."""
    return (int(version), version) if is_version(version) else (-1, version)


def latest(versions: Sequence[str] | set[str]) -> str | None:
    """The largest of ``versions`` as numbers, or None when there are none."""
    return max(versions, key=version_order, default=None)


def default_key(
    name: str,
    specs: Mapping[Key, ModelSpec],
    serving: Mapping[Key, Sequence[Credited]],
) -> Key | None:
    """``name``'s default version (see the module's doc), or None when none is known."""
    known = [key for key in specs if key[0] == name]
    served = [key for key in known if serving.get(key)]
    taking = [key for key in served if any(w.credit > 0 for w in serving[key])]
    served = taking or served
    if served:
        newest = max(served, key=lambda key: version_order(key[1]))
        pin = specs[newest].default_version
        if pin is not None and (name, pin) in served:
            return name, pin
        return newest
    return max(known, key=lambda key: version_order(key[1]), default=None)
