"""What the client's commands share: a Client from the ``--broker`` values and the
CURVE options, and the fabric's errors as one-line exits."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import click

from ipuserve.client.client import Client
from ipuserve.discovery import expand, split_endpoints
from ipuserve.errors import IpuserveError
from ipuserve.security import ClientKeys

__all__ = ["client_address", "client_for", "typed_errors"]


@contextmanager
def typed_errors() -> Iterator[None]:
    """Turn a reported IpuserveError into a one-line click error that names its code."""
    try:
        yield
    except IpuserveError as exc:
        raise click.ClickException(f"[{exc.code}] {exc}") from exc


def client_address(brokers: str | Sequence[str]) -> str | list[str]:
    """What the Client is given for the ``--broker`` values: one endpoint as a string
    (the single-broker client, as ever), unless its host resolves to several addresses
    (Swarm's ``tasks.SERVICE``); several, or such a name, as a list (one link each)."""
    if isinstance(brokers, str):
        brokers = [brokers]
    endpoints = split_endpoints(brokers)
    if len(endpoints) != 1:
        return endpoints
    try:
        several = len(expand(endpoints[0])) > 1
    except OSError:  # not resolvable (yet): ZeroMQ resolves it when it can
        several = False
    return endpoints if several else endpoints[0]


def client_for(broker: str | Sequence[str], timeout_s: float, keys: ClientKeys | None) -> Client:
    """A Client to ``broker`` (one or several, :func:`client_address`), CURVE with
    ``keys`` (loaded by :func:`keys_from_options`)."""
    address = client_address(broker)
    if keys is None:
        return Client(address, timeout=timeout_s)
    return Client(
        address,
        timeout=timeout_s,
        curve_secret_key=keys.pair.secret,
        broker_public_key=keys.broker_public,
    )
