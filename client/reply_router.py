"""ReplyRouter: what the broker sends settles the pending requests, each exactly once.

Every message from a link's socket goes through :meth:`ReplyRouter.on_frames` in the
core, as its driver feeds it: a reply, a group's replies, an error reply, or a
message this client cannot read finds its request in the :class:`PendingTable`
and takes it out; one whose request is no longer there (answered already,
expired, a duplicate after a re-send) is dropped and counted. Nothing here sends.

Futures settle later, in :func:`settle`, which the driver calls with its lock let
go: a caller woken by its result then finds the sockets free and sends its next
request itself, and done-callbacks never run under the lock (one that sends takes it
like any caller).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from ipuserve import protocol as wire
from ipuserve.client.config import ClientStats
from ipuserve.client.groups import MODELS_PROBE, GroupRules
from ipuserve.client.liveness import Liveness
from ipuserve.client.pending import EXPECTS, Pending, PendingTable
from ipuserve.errors import (
    BrokerShutdownError,
    IpuserveError,
    ProtocolError,
    UnknownModelError,
)

log = logging.getLogger(__name__)

#: settled requests waiting for the driver to settle their futures, in order
Due = deque[tuple[Pending, Callable[[Pending], None]]]

#: what a broker's backend sends its workers: a client that receives one has been
#: pointed at the backend (worker) port
_TO_WORKERS = frozenset(
    {wire.Command.WELCOME, wire.Command.JOBS, wire.Command.HEARTBEAT, wire.Command.RECONNECT}
)


@dataclass(eq=False, repr=False, slots=True)
class ReplyRouter:
    """Settles the table's requests from one link's messages; PONG goes to ``on_pong``.

    Named for what it does (routes each message to the request it answers), apart
    from ``wire.Replies``, the message that carries a batch of replies.

    The table is shared by every link, so a settled request also leaves its link's
    list (``forget``). A link pointed at a broker's backend (worker) port is only
    marked unusable: the core gives the requests it had to the other links, and fails
    them when there is none. UNKNOWN_MODEL from one broker is not the fleet's answer:
    a broker just restarted (its workers not back yet) or one the model's workers
    never joined says it while another serves the model, so the request tries the
    brokers it has not tried (``elsewhere``) before it fails. The models a
    MODELS_REPLY lists are the broker's now (``serves``), and say how to group their
    requests (``groups``).
    """

    #: the requests of every link, shared; and the client's counters
    table: PendingTable
    stats: ClientStats
    #: the link's: its broker's health
    liveness: Liveness
    #: where settled requests wait for the driver (:func:`settle`), in order; each
    #: leaves only once settled, so close() can fail what a blocked callback strands
    due: Due
    on_pong: Callable[[wire.Pong], None]
    #: a settled request leaves its link's list too
    forget: Callable[[bytes], None]
    #: gives a request this broker lacks the model for to another (False: none left)
    elsewhere: Callable[[bytes], bool]
    #: what this broker said about its models' groups
    groups: GroupRules
    #: the models a MODELS_REPLY lists, as the broker's now
    serves: Callable[[list[str]], None]

    def on_frames(self, frames: list[zmq.Frame]) -> None:
        try:
            self._dispatch(frames)
        except Exception as exc:  # one reply this client cannot handle: never the loop
            log.exception("cannot handle a message from the broker")
            self._on_malformed(frames, ProtocolError(f"unreadable reply ({exc!r})"))

    def _dispatch(self, frames: list[zmq.Frame]) -> None:
        try:
            message = wire.decode(frames)
        except IpuserveError as exc:
            self._on_malformed(frames, exc)
            return
        if isinstance(message, wire.Pong):
            self.on_pong(message)
        elif isinstance(message, wire.ErrorReply):
            self._on_error(message)
        elif isinstance(message, wire.Reply | wire.ModelsReply | wire.RepositoryReply):
            self._on_answer(message)
        elif isinstance(message, wire.Replies):
            for row in message.replies:
                for reply in row.members():
                    self._on_answer(reply)
            for error in message.errors:
                self._on_error(error)
        elif message.COMMAND in _TO_WORKERS:
            self._on_backend_port()
        else:
            self._on_malformed(
                frames, ProtocolError(f"a client never expects {message.COMMAND.name}")
            )

    def _on_error(self, error: wire.ErrorReply | wire.Fail) -> None:
        """Fail the request with the error its peer reported, except that UNKNOWN_MODEL
        first tries another broker, and a broker's BROKER_SHUTDOWN keeps it pending: a
        restarted broker gets it again (new epoch, or silence, re-send everything
        pending), and its deadline still applies."""
        request_id = error.request_id if isinstance(error, wire.ErrorReply) else error.job_id
        if error.code == UnknownModelError.code and self.elsewhere(request_id):
            return
        if error.code == BrokerShutdownError.code and request_id in self.table:
            self.liveness.broker_shut_down = True
            self.stats.held_over_shutdown += 1
            return
        exception = error.exception()
        self.finish(request_id, lambda p: p.fail(exception))

    def _on_backend_port(self) -> None:
        """Pointed at a broker's backend: nothing sent there will ever be answered. The
        link is unusable from now on (the core moves or fails its requests)."""
        if not self.liveness.backend_port:
            log.error("%s", self.liveness.silence_hint().removeprefix(": "))
        self.liveness.backend_port = True

    def _on_answer(self, message: wire.Reply | wire.ModelsReply | wire.RepositoryReply) -> None:
        """A MODELS_REPLY, the link's own probe or a user's, also says which models the
        broker serves now and how to group their requests."""
        if type(message) is wire.ModelsReply:
            self.serves([info.spec.name for info in message.models])
            self.groups.learn(message.models)
            if message.request_id == MODELS_PROBE:
                return
        pending = self.table.get(message.request_id)
        if pending is not None and EXPECTS[type(pending.message)] is not type(message):
            error = ProtocolError(f"{message.COMMAND.name} does not answer this request")
            self.finish(message.request_id, lambda p: p.fail(error))
            return
        self.finish(message.request_id, lambda p: _resolve(p, message))

    def _on_malformed(self, frames: list[zmq.Frame], error: IpuserveError) -> None:
        """A reply we cannot read fails its request (when its id is readable), never the loop."""
        self.stats.malformed += 1
        log.warning("malformed message from the broker: %s", error)
        for request_id in wire.peek_ids(frames) or [wire.peek_id(frames)]:
            if request_id in self.table:
                self.finish(request_id, lambda p: p.fail(error))

    def finish(self, request_id: bytes, settle: Callable[[Pending], None]) -> None:
        """Take the request out of the table and its link's list; ``settle`` settles it
        in :func:`settle`."""
        pending = self.table.pop(request_id)
        if pending is None:
            self.stats.dropped_replies += 1
        else:
            self.stats.replies += 1
            self.due.append((pending, settle))
        self.forget(request_id)


def settle(due: Due) -> None:
    """Settle what replies and expiry took out, in order, without the driver's lock
    held (done-callbacks run here: one that sends takes the lock like any caller).
    Each leaves ``due`` only once settled, so that close() can fail what a blocked
    callback strands."""
    while due:
        pending, settle_one = due[0]
        if not pending.future.done():
            try:
                settle_one(pending)  # runs the future's callbacks on this thread
            except Exception as exc:  # e.g. numpy cannot view the reply's tensors
                log.exception("cannot hand request %s its reply", pending.request_id.hex())
                pending.fail(ProtocolError(f"unreadable reply ({exc!r})"))
        due.popleft()


def _resolve(pending: Pending, message: wire.Message) -> None:
    try:
        result = pending.parse(message, pending)
    except IpuserveError as exc:
        pending.fail(exc)
    else:
        pending.succeed(result)
