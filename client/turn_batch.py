"""Batching: what one turn of the client's I/O loop hands over leaves together.

The requests a turn takes from the inbox, and those future callbacks make while
replies are read, wait here until the turn ends (or until ``batch_requests`` of
them wait: the next stage starts on those while this one prepares the rest).
Small requests leave together, as one REQUESTS message (the broker then answers
them together, in REPLIES), and runs of them that can share a job as groups, as
big as the broker said the model takes (:mod:`ipuserve.client.groups`; the broker
carries a group as it is, never cut); a lone request, a big one or a models() query
leaves on its own. Under load that is
one message for many requests at every hop; with one request at a time nothing
changes and nothing waits.

A request a caller sends from its own thread (the socket idle) never comes here:
it is alone by definition.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Protocol

from ipuserve import protocol as wire
from ipuserve import transport
from ipuserve.client.config import ClientConfig, ClientStats
from ipuserve.client.groups import GroupRules
from ipuserve.client.pending import Pending


class Sender(Protocol):
    """What a turn batch needs of the loop that owns the socket."""

    def send(self, pending: Pending) -> None:
        """Send one request by itself, under every per-request rule (limit, hold, HWM)."""

    def send_frames(self, frames: list[wire.Frame]) -> bool:
        """Send one encoded message; False when the socket's pipe was full."""

    def defer(self, request_ids: list[bytes]) -> None:
        """Send these again, in order, once the socket's pipe has room."""

    def ask_models(self) -> None:
        """Ask the broker for its models (its MODELS_REPLY updates the group rules)."""


class TurnBatch:
    """The requests handed over this turn, in order; :meth:`flush` sends them.

    A batch, not a backlog: it empties at every flush (what the socket does not take
    the link defers), where the broker's ``Backlog`` keeps what a client's pipe could
    not take until it can. A link holds one, as ``Link.batch``."""

    def __init__(
        self,
        config: ClientConfig,
        stats: ClientStats,
        sender: Sender,
        current: Callable[[bytes], Pending | None],
        groups: GroupRules,
    ) -> None:
        """``current`` says which request an id stands for now (None once answered);
        ``groups`` how big a group the broker takes, per model."""
        self._config = config
        self._stats = stats
        self._sender = sender
        self._current = current
        self._groups = groups
        self._waiting: list[Pending] = []

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def add(self, pending: Pending) -> None:
        self._waiting.append(pending)
        if len(self._waiting) >= self._config.batch_requests:
            self.flush()

    def flush(self) -> None:
        """Send what waits, in order: runs of small requests together."""
        if not self._waiting:
            return
        waiting, self._waiting = self._waiting, []
        batch: list[Pending] = []
        for pending in waiting:
            if self._current(pending.request_id) is not pending:
                continue  # answered (expired) in this same turn
            if self._batchable(pending):
                batch.append(pending)
                continue
            self._send_together(batch)
            batch = []
            self._sender.send(pending)
        self._send_together(batch)

    def _send_together(self, batch: list[Pending]) -> None:
        if len(batch) == 1:
            self._sender.send(batch[0])
        elif batch:
            self._send_batch(batch)

    def _batchable(self, pending: Pending) -> bool:
        size, limit = pending.payload_bytes, self._stats.max_payload_bytes
        return (
            isinstance(pending.message, wire.Request)
            and size <= self._config.batch_payload_bytes
            and (limit is None or size <= limit)
        )

    def _send_batch(self, batch: list[Pending]) -> None:
        now = time.perf_counter_ns()
        requests = [m for p in batch if isinstance(m := p.message_at(now), wire.Request)]
        rules = self._groups
        if rules.ask_now(now / 1e9, all(rules.knows(r.model) for r in requests)):
            self._sender.ask_models()  # a model joined since, or the advice moved on
        limit = self._stats.max_payload_bytes or transport.FRAME_SLACK_BYTES
        message = wire.Requests(tuple(grouped(requests, limit, rules.members)))
        sizes = [len(row.group) for row in message.requests if row.group]
        self._stats.grouped += sum(sizes)
        self._stats.groups += len(sizes)
        for frames in wire.encode_batch(message):  # the broker decodes with the defaults
            if not self._sender.send_frames(frames):
                # which rows did not go is not known: all go again
                self._sender.defer([p.request_id for p in batch])
                break
        self._stats.batched += len(batch)


def share_a_job(first: wire.Request, other: wire.Request) -> bool:
    """The same model and version asked for, and the same tensor specs (what
    :meth:`wire.Tensors.group` requires); whether the model takes groups, and how many
    requests one holds, the broker said (``members`` of :func:`grouped`)."""
    return (
        other.model == first.model
        and other.version == first.version
        and other.tensors.specs == first.tensors.specs
    )


def grouped(
    requests: list[wire.Request], max_bytes: int, members: Callable[[wire.Request], int]
) -> Iterator[wire.Request]:
    """Runs of requests that may share a job, as groups: the broker and the worker
    handle a group as one job, so its requests cost them little more than one. A
    group holds at most ``members(first)`` requests (what the broker takes for that
    model and those shapes: 1 when it takes no groups or has not said), and its
    tensors stay within ``max_bytes`` (the broker's payload limit): each of its frames
    holds every member's tensor, and a frame past the limit would be refused by
    ZeroMQ. A group's timeout is its members' latest (the I/O thread still times out
    each request at its own deadline)."""
    run: list[wire.Request] = []
    size = most = 0
    for request in requests:
        nbytes = request.tensors.nbytes
        if run and (
            len(run) >= most or not share_a_job(run[0], request) or size + nbytes > max_bytes
        ):
            yield _group(run)
            run, size = [], 0
        if not run:
            most = members(request)
        run.append(request)
        size += nbytes
    if run:
        yield _group(run)


def _group(run: list[wire.Request]) -> wire.Request:
    if len(run) == 1:
        return run[0]
    timeouts = [r.timeout_ms for r in run]
    first = run[0]
    return wire.Request(
        first.request_id,
        first.model,
        wire.Tensors.group([r.tensors for r in run]),
        None if None in timeouts else max(t for t in timeouts if t is not None),
        tuple(r.request_id for r in run),
        first.version,
    )
