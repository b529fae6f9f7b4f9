"""ipuserve.discovery: names that stand for several peers, followed as they change.

DNS itself is the one part replaced here (a table of answers), since a name with
several addresses cannot be made on loopback without editing /etc/hosts; the real
resolver is checked on names every machine has.
"""

from __future__ import annotations

import pytest

from ipuserve.discovery import EndpointSet, expand, resolve_ipv4, split_endpoints


class Table:
    """A DNS with answers that tests change between refreshes."""

    def __init__(self, **answers: list[str]) -> None:
        self.answers = dict(answers)
        self.asked: list[str] = []

    def __call__(self, host: str) -> list[str]:
        self.asked.append(host)
        if host not in self.answers:
            raise OSError(f"{host}: no such name")
        return self.answers[host]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_real_resolver_on_names_every_machine_has() -> None:
    assert resolve_ipv4("127.0.0.1") == ["127.0.0.1"]
    assert "127.0.0.1" in resolve_ipv4("localhost")
    assert expand("tcp://localhost:5555") == ["tcp://localhost:5555"]  # one address: kept
    with pytest.raises(OSError):
        expand("tcp://no-such-host.invalid:5555")


@pytest.mark.parametrize(
    "endpoint",
    ["tcp://127.0.0.1:5555", "tcp://[::1]:5555", "ipc:///tmp/b.sock", "inproc://b"],
)
def test_literals_and_other_transports_are_used_as_given(endpoint: str) -> None:
    table = Table()
    assert expand(endpoint, table) == [endpoint]
    assert table.asked == []


def test_a_name_with_several_addresses_becomes_one_endpoint_each_sorted() -> None:
    table = Table(**{"tasks.broker": ["10.0.0.12", "10.0.0.9"]})
    assert expand("tcp://tasks.broker:5556", table) == [
        "tcp://10.0.0.9:5556",
        "tcp://10.0.0.12:5556",
    ]


def test_the_set_follows_a_name_as_tasks_come_and_go() -> None:
    table = Table(**{"tasks.broker": ["10.0.0.2", "10.0.0.3"]})
    clock = Clock()
    peers = EndpointSet(
        ["tcp://tasks.broker:5556", "tcp://10.9.9.9:5556"], resolver=table, clock=clock
    )
    assert peers.refresh() == (
        ["tcp://10.0.0.2:5556", "tcp://10.0.0.3:5556", "tcp://10.9.9.9:5556"],
        [],
    )
    assert not peers.due()
    clock.now += 5.0
    assert peers.due()
    table.answers["tasks.broker"] = ["10.0.0.3", "10.0.0.4"]  # task .2 died, .4 replaced it
    assert peers.refresh() == (["tcp://10.0.0.4:5556"], ["tcp://10.0.0.2:5556"])
    assert peers.current == ("tcp://10.0.0.3:5556", "tcp://10.0.0.4:5556", "tcp://10.9.9.9:5556")
    assert peers.refresh() == ([], [])


def test_a_failed_resolution_keeps_what_the_set_had() -> None:
    table = Table(**{"tasks.broker": ["10.0.0.2", "10.0.0.3"]})
    peers = EndpointSet(["tcp://tasks.broker:5556"], resolver=table, clock=Clock())
    peers.refresh()
    del table.answers["tasks.broker"]  # DNS hiccup: never drop live peers for it
    assert peers.refresh() == ([], [])
    assert len(peers.current) == 2


def test_a_name_that_does_not_resolve_yet_is_kept_for_zeromq_to_retry() -> None:
    table = Table()
    peers = EndpointSet(["tcp://broker:5556"], resolver=table, clock=Clock())
    assert peers.refresh() == (["tcp://broker:5556"], [])
    table.answers["broker"] = ["10.0.0.5"]  # up now, one address: still the name
    assert peers.refresh() == ([], [])
    table.answers["broker"] = ["10.0.0.5", "10.0.0.6"]  # scaled to two
    assert peers.refresh() == (
        ["tcp://10.0.0.5:5556", "tcp://10.0.0.6:5556"],
        ["tcp://broker:5556"],
    )


def test_fixed_endpoints_are_never_due() -> None:
    peers = EndpointSet(["tcp://127.0.0.1:5556", "ipc:///tmp/x"], resolver=Table(), clock=Clock())
    peers.refresh()
    assert not peers.due() and peers.seconds_until_due() == float("inf")


def test_split_endpoints_reads_repeated_options_and_space_separated_variables() -> None:
    assert split_endpoints(["tcp://a:1 tcp://b:1", "tcp://c:1", " tcp://a:1 "]) == [
        "tcp://a:1",
        "tcp://b:1",
        "tcp://c:1",
    ]
    with pytest.raises(ValueError):
        EndpointSet([])
