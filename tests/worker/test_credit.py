"""CreditPool: one capacity split between broker connections, never more held in all.

The random test drives the pool with model brokers that behave as the real one does
(a job placed only while fewer than its credit are outstanding; a credit change
echoed after the jobs sent before it; a lost connection forgets what it placed),
with every message on the wire for a random while, and checks after each step
that the worker holds no more than its capacity and that the pool's invariant holds.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

import pytest

from ipuserve.worker.credit import REBALANCE_S, SATURATED_S, CreditPool, Share


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Link:
    """One broker connection: the broker's side, the wire both ways, the worker's books."""

    share: Share
    up: bool = False
    credit: int = 0  # what the broker counts
    outstanding: int = 0  # jobs placed and not answered (the broker's view)
    to_worker: deque[tuple[str, int]] = field(default_factory=deque)
    to_broker: deque[tuple[str, int]] = field(default_factory=deque)
    connection: int = 0
    held: list[int] = field(default_factory=list)  # the connection each held job came on
    sent_seq: int = 0
    refused: int = 0

    def report(self) -> None:
        current = sum(1 for s in self.held if s == self.connection)
        self.share.update(len(self.held), current)

    def join(self) -> None:
        self.connection += 1
        self.to_worker.clear()
        self.to_broker.clear()
        self.credit = self.share.hello(len(self.held))
        self.outstanding, self.up = 0, True
        self.sent_seq = self.share.pending_seq  # a raise decided by the HELLO's rebalance
        if self.share.pending is not None:
            self.sent_seq -= 1  # is still to be sent

    def lose(self) -> None:
        """The connection is gone: nothing more arrives, the broker forgets its jobs."""
        self.up = False
        self.to_worker.clear()
        self.to_broker.clear()
        self.share.lost()

    # the broker
    def place(self) -> None:
        if self.up and self.outstanding < self.credit:
            self.outstanding += 1
            self.to_worker.append(("job", 0))

    def broker_reads(self) -> None:
        if not self.up or not self.to_broker:
            return
        kind, value = self.to_broker.popleft()
        if kind == "result":
            self.outstanding -= 1
        else:
            self.credit = value
            self.to_worker.append(("echo", value))  # after every job placed before it

    # the worker
    def worker_reads(self) -> None:
        if not self.up or not self.to_worker:
            return
        kind, value = self.to_worker.popleft()
        if kind == "echo":
            self.report()
            self.share.confirm(value)
        elif self.share.solo or self.share.admits():
            self.held.append(self.connection)
            self.report()
        else:
            self.refused += 1
            self.to_broker.append(("result", 0))

    def finish(self, rng: random.Random) -> None:
        if not self.held:
            return
        connection = self.held.pop(rng.randrange(len(self.held)))
        if self.up and connection == self.connection:
            self.to_broker.append(("result", 0))
        self.report()

    def send_credit(self) -> None:
        share = self.share
        seq, pending = share.pending_seq, share.pending
        if self.up and pending is not None and seq != self.sent_seq:
            self.sent_seq = seq
            self.to_broker.append(("credit", pending))


def check(pool: CreditPool, links: list[Link], capacity: int) -> None:
    held = sum(len(link.held) for link in links)
    assert held <= capacity, f"the worker holds {held} jobs; its capacity is {capacity}"
    assert pool.reserved() <= capacity


@pytest.mark.parametrize("seed", range(40))
def test_random_traffic_never_holds_more_than_the_capacity(seed: int) -> None:
    rng = random.Random(seed)
    capacity = rng.choice([1, 2, 3, 5, 8, 16])
    clock = Clock()
    pool = CreditPool(capacity, clock=clock)
    links: list[Link] = []
    for step in range(3000):
        live = [link for link in links if not link.share.leaving]
        roll = rng.random()
        if not live or (roll < 0.01 and len(live) < 4):
            link = Link(pool.share(f"b{step}"))
            links.append(link)
            link.join()
        elif roll < 0.015 and len(live) > 1:
            leaving = rng.choice(live)
            leaving.lose()
            leaving.share.leave()
        elif roll < 0.03:
            link = rng.choice(live)
            if link.up:
                link.lose()
            else:
                link.join()
        else:
            link = rng.choice(links)
            action = rng.choice(["place", "place", "broker", "worker", "finish", "credit"])
            if action == "place" and not link.share.leaving:
                link.place()
            elif action == "broker":
                link.broker_reads()
            elif action == "worker":
                link.worker_reads()
            elif action == "finish":
                link.finish(rng)
            elif action == "credit":
                link.send_credit()
        if rng.random() < 0.05:
            clock.now += rng.choice([0.01, REBALANCE_S, SATURATED_S])
        check(pool, links, capacity)
    assert sum(link.refused for link in links) == 0  # brokers that keep to their credit


def _settle(links: list[Link], rounds: int = 50) -> None:
    """Deliver everything both ways (no new jobs)."""
    for _ in range(rounds):
        for link in links:
            link.send_credit()
            while link.to_broker:
                link.broker_reads()
            while link.to_worker:
                link.worker_reads()


def test_one_broker_gets_the_whole_capacity() -> None:
    pool = CreditPool(8)
    link = Link(pool.share("b1"))
    link.join()
    assert link.credit == 8


def test_a_second_broker_gets_half_once_the_first_confirmed_its_lower_credit() -> None:
    clock = Clock()
    pool = CreditPool(8, clock=clock)
    first, second = Link(pool.share("b1")), Link(pool.share("b2"))
    first.join()
    second.join()
    assert (first.credit, second.credit) == (8, 0)  # nothing free yet
    assert first.share.pending == 4
    _settle([first, second])
    assert (first.credit, second.credit) == (4, 4)


def test_credit_shifts_to_the_busy_broker_and_back() -> None:
    clock = Clock()
    pool = CreditPool(8, clock=clock)
    busy, idle = Link(pool.share("busy")), Link(pool.share("idle"))
    busy.join()
    idle.join()
    _settle([busy, idle])
    for _ in range(10):  # only "busy" has traffic: it keeps its whole credit in use
        while busy.outstanding < busy.credit:
            busy.place()
        _settle([busy, idle])
        clock.now += REBALANCE_S
        busy.report()
        _settle([busy, idle])
    assert (busy.credit, idle.credit) == (7, 1)
    assert pool.metrics.value("ipuserve_worker_broker_credit", broker="busy") == 7
    while busy.held:  # its traffic ends; the other's starts
        busy.finish(random.Random(0))
    _settle([busy, idle])
    for _ in range(20):
        while idle.outstanding < idle.credit:
            idle.place()
        _settle([busy, idle])
        clock.now += REBALANCE_S
        idle.report()
        _settle([busy, idle])
    assert (busy.credit, idle.credit) == (1, 7)


def test_a_broker_that_leaves_frees_its_share_once_its_jobs_are_done() -> None:
    clock = Clock()
    pool = CreditPool(4, clock=clock)
    staying, leaving = Link(pool.share("a")), Link(pool.share("b"))
    staying.join()
    leaving.join()
    _settle([staying, leaving])
    leaving.place()
    leaving.place()
    _settle([staying, leaving])
    leaving.lose()
    leaving.share.leave()
    _settle([staying, leaving])
    assert staying.credit == 2  # the leaving broker's 2 jobs still run
    leaving.finish(random.Random(0))
    leaving.finish(random.Random(0))
    _settle([staying, leaving])
    assert staying.credit == 4 and pool.shares == [staying.share]
    assert pool.held_max == 2


def test_a_reconnect_announces_only_what_the_jobs_still_held_leave_free() -> None:
    pool = CreditPool(4)
    link = Link(pool.share("b1"))
    link.join()
    link.place()
    link.place()
    _settle([link])
    link.lose()
    link.join()  # the two jobs of the old connection still run
    assert link.credit == 2
    link.finish(random.Random(0))
    _settle([link])
    assert link.credit == 3
