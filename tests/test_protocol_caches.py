"""The protocol's caches are bounded in bytes, not only in entries (issue 16): a peer
sending distinct valid headers, each near the header limit, cannot make a process
keep them all."""

from __future__ import annotations

import json

import numpy as np

from ipuserve import protocol as wire
from ipuserve.protocol.fastpath import FIELDS_CACHE

SPEC = {"name": "x", "dtype": "float32", "shape": [2, 8]}
ROWS = np.zeros((2, 8), np.float32).tobytes()
#: what the header cache may hold, at most (it was 1,024 headers of up to 256 KiB)
BOUND = 8 << 20


def padded_request(pad: int) -> list[bytes]:
    """A valid REQUEST whose header is ``pad`` spaces longer than it needs to be."""
    header = json.dumps({"model": "add", "tensors": [SPEC]})[:-1] + " " * pad + "}"
    return [wire.envelope(wire.Command.REQUEST, b"r"), header.encode(), ROWS]


def cached_bytes() -> int:
    return sum(len(raw) for _command, raw in FIELDS_CACHE)


def test_distinct_huge_headers_do_not_fill_the_header_cache() -> None:
    FIELDS_CACHE.clear()
    for n in range(300):  # 300 distinct valid headers of about 250 KiB: 75 MB
        message = wire.decode(padded_request(250_000 + n))
        assert isinstance(message, wire.Request) and message.model == "add"
        assert cached_bytes() <= BOUND
    # what the cache is for still works: a client's small header, repeated
    small = padded_request(1)
    wire.decode(small)
    assert (wire.Command.REQUEST, small[1]) in FIELDS_CACHE


def test_distinct_small_headers_are_bounded_by_bytes_too() -> None:
    FIELDS_CACHE.clear()
    for n in range(3000):  # more entries than any cache keeps: it is cleared, not grown
        wire.decode(padded_request(20_000 + n))
        assert cached_bytes() <= BOUND
    assert 0 < len(FIELDS_CACHE) <= 1024


def test_a_budget_clears_its_table_when_full_and_refuses_oversized_entries() -> None:
    from ipuserve.protocol.envelope import CacheBudget

    budget = CacheBudget(max_bytes=100, entries=3, max_entry_bytes=60)
    table: dict[int, int] = {}
    assert not budget.admit(table, 61)  # too big to keep at all
    for key in range(3):
        assert budget.admit(table, 10)
        table[key] = key
    assert budget.admit(table, 10) and table == {}  # the fourth entry: cleared first
    table[3] = 3
    assert budget.admit(table, 60) and table == {3: 3}  # 70 bytes: fits
    table[4] = 4
    assert budget.admit(table, 60) and table == {}  # 130 would not: cleared
