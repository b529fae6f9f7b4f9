"""The client's I/O thread: the only code that touches the client's DEALER socket.

Callers hand :class:`Pending` requests over through :meth:`IoLoop.submit` — a
deque plus a :class:`Waker` written only on the empty -> non-empty transition;
the check and the append share a lock with the thread's swap, and the thread
clears the waker *before* swapping, so a wake-up is never lost (a racing
submit causes at most one spurious one). Code already running on this thread
(future callbacks) hands over directly instead: no hand-off, no hop.

Batching: what a turn of the loop hands over (the inbox it took, the requests
future callbacks made while replies were read) leaves at the end of the turn.
Small requests leave together, as one REQUESTS message (the broker then answers
them together, in REPLIES); a lone request, a big one or a models() query leaves
on its own. Under load that is one message for many requests at every hop; with
one request at a time nothing changes and nothing waits.

Payload limit: PONG carries the broker's payload limit. A request above it fails
here with PayloadTooLargeError instead of being sent; one too big to send safely
before the limit is known (beyond ``protocol.FRAME_SLACK_BYTES``: the broker's
ZeroMQ would drop the connection, and nobody could answer) waits for the first
PONG.

Liveness: a PING goes out at connect and every ``ping_interval_s`` while
requests are pending; PONG carries the broker's epoch. A new epoch (the broker
restarted and lost its queue) or silence past ``liveness_s`` re-sends every
pending request with its original id; the broker drops duplicates it still
holds, and replies for ids no longer pending are dropped here and counted.
Until anything at all has arrived (a PONG answers the PING sent at connect), the
warning about silence and every DEADLINE_EXCEEDED say that nothing has answered
at the endpoint since the client started: the usual cause is a wrong endpoint
or port or no broker at all. A broker's backend (worker) port does answer, with
worker-protocol messages: those fail every pending request at once with
UnavailableError saying to connect to the frontend (client) port instead.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from ipuserve import protocol as wire
from ipuserve.client.pending import EXPECTS, Pending
from ipuserve.client.waker import Waker
from ipuserve.errors import (
    BrokerShutdownError,
    ClosedError,
    ConfigError,
    DeadlineExceeded,
    IpuserveError,
    PayloadTooLargeError,
    ProtocolError,
    RuntimeUsageError,
    UnavailableError,
)

log = logging.getLogger(__name__)

#: what a broker's backend sends its workers: a client that receives one has been
#: pointed at the backend (worker) port
_TO_WORKERS = frozenset(
    {wire.Command.WELCOME, wire.Command.JOBS, wire.Command.HEARTBEAT, wire.Command.RECONNECT}
)
#: The longest poll: a deadline years away must not overflow poll's int milliseconds.
_MAX_POLL_MS = 60_000
#: The deadline heap is rebuilt without answered requests past this size (and 4x pending).
_COMPACT_AT = 1024
#: Silence since the client started after which "is the broker running?" is a fair
#: question: a PONG on a working connection takes milliseconds.
_SUSPECT_SILENCE_S = 0.05
#: How long close() waits for the I/O thread: a done-callback blocked for good must not
#: hang close() and the interpreter's exit (which closes every client) with it.
CLOSE_WAIT_S = 5.0


@dataclass(frozen=True, kw_only=True)
class ClientConfig:
    """Tuning of one client; the defaults suit a broker on the same network."""

    ping_interval_s: float = 1.0
    liveness_s: float = 3.0
    reconnect_max_s: float = 2.0
    send_hwm: int = 100_000
    recv_batch: int = 256
    #: requests with bigger payloads are never batched (they gain nothing from it)
    batch_payload_bytes: int = 64 << 10
    #: a batch leaves once it holds this many requests, without waiting for the turn
    #: to end: the next stage starts on it while this one prepares the rest
    batch_requests: int = 32
    routing_id: bytes | None = None
    #: past a request's timeout, how long a client whose broker answers waits for the
    #: broker's own DEADLINE_EXCEEDED, which says where the request waited (queue or
    #: worker, and whether any worker serves the model), before failing it itself
    deadline_grace_s: float = 0.05

    def __post_init__(self) -> None:
        if not 0 < self.ping_interval_s < self.liveness_s:
            raise ConfigError(
                f"need 0 < ping_interval_s ({self.ping_interval_s}) < liveness_s "
                f"({self.liveness_s}): a broker is only silent if it was asked"
            )
        # ZeroMQ would say only "Invalid argument", and recv_batch 0 never reads
        for name in ("send_hwm", "recv_batch", "batch_requests"):
            if getattr(self, name) < 1:
                raise ConfigError(f"ClientConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("reconnect_max_s", "batch_payload_bytes", "deadline_grace_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"ClientConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.routing_id is not None and not (
            isinstance(self.routing_id, bytes)
            and 0 < len(self.routing_id) <= 255
            and self.routing_id[0] != 0
        ):
            raise ConfigError(
                "ClientConfig.routing_id must be 1 to 255 bytes not starting with a zero "
                "byte (ZeroMQ reserves those), got "
                f"{self.routing_id!r:.80}"
            )


@dataclass
class ClientStats:
    """Counters kept by the I/O thread (read them from anywhere; they only grow)."""

    sent: int = 0
    #: of those, sent inside REQUESTS messages (several requests per message)
    batched: int = 0
    #: of those, sent as members of groups (one job for several requests)
    grouped: int = 0
    resent: int = 0
    #: requests a stopping broker let go of, kept pending for the broker after it
    held_over_shutdown: int = 0
    replies: int = 0
    dropped_replies: int = 0
    malformed: int = 0
    expired: int = 0
    epoch_changes: int = 0
    #: connections to the broker made again after the first (a blip, a restart)
    reconnects: int = 0
    epoch: str | None = None
    #: the broker's payload limit, from its PONG (None until the first)
    max_payload_bytes: int | None = None


def connection_monitor(sock: zmq.Socket[Any]) -> zmq.Socket[Any]:
    """The events of ``sock``'s connections the I/O loop acts on; attach before connect()."""
    return sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)


class IoLoop:
    """Owns the socket, the pending table, the deadlines and the broker's liveness."""

    def __init__(
        self,
        sock: zmq.Socket[Any],
        monitor: zmq.Socket[Any],
        config: ClientConfig,
        *,
        endpoint: str = "",
    ) -> None:
        """``monitor`` (:func:`connection_monitor`) must watch ``sock`` from before it
        connects: a first handshake it missed left the client thinking it never
        connected, so it re-sent nothing when silent or after its first reconnection."""
        self.config = config
        self.endpoint = endpoint
        self.stats = ClientStats()
        self._sock = sock
        # A new connection means replies sent meanwhile were lost (the broker drops what
        # it cannot deliver, and a client it could not reach loses its queue after a
        # while): re-send what is pending when one is made again.
        self._monitor = monitor
        self._connected = False
        self._ever_connected = False
        #: pending requests went to the new connection since the last PONG: a new
        #: epoch in that PONG needs no second re-send
        self._resent_on_reconnect = False
        self._waker = Waker()
        self._inbox: deque[Pending] = deque()
        self._lock = threading.Lock()
        self._closed = False
        self._pending: dict[bytes, Pending] = {}
        #: ids of pending requests too big to send before the broker's limit is known
        self._held: dict[bytes, None] = {}
        #: handed over this turn of the loop; sent by _flush_outgoing at its end
        self._outgoing: list[Pending] = []
        self._deadlines: list[tuple[int, int, bytes]] = []
        self._seq = itertools.count()
        self._last_heard = time.monotonic()
        #: anything at all arrived from the socket since the client started
        self._heard_anything = False
        #: pending requests were re-sent in the current silence (once is enough)
        self._resent_in_silence = False
        self._hinted = False
        #: the peer spoke the worker protocol: this is a broker's backend port
        self._backend_port = False
        #: the broker said BROKER_SHUTDOWN, and no broker has answered a PING since
        self._broker_shut_down = False
        self._next_ping = 0.0
        self._born = time.monotonic()
        #: requests that found the socket's pipe full, to send once it has room
        self._unsent: dict[bytes, None] = {}
        #: a forked child inherits this object but not its thread: it must not use it
        self._pid = os.getpid()
        #: what ended the I/O thread, if it failed (then calls say so, not "closed")
        self._crash: Exception | None = None
        self.thread = threading.Thread(target=self._run, name="ipuserve-client-io", daemon=True)

    # ------------------------------------------------------------ any thread

    def submit(self, pending: Pending) -> None:
        """Hand a request to the I/O thread (or send it now when called on it)."""
        if os.getpid() != self._pid:
            raise RuntimeUsageError(
                "this Client was created in another process (this one was forked from "
                "it): its I/O thread and socket stay there; create a new Client here"
            )
        if threading.current_thread() is self.thread:
            if self._closed:
                raise self._closed_error()
            self._send_new(pending)
            return
        with self._lock:
            if self._closed:
                raise self._closed_error()
            was_empty = not self._inbox
            self._inbox.append(pending)
        if was_empty:
            self._waker.wake()

    def close(self) -> None:
        forked = os.getpid() != self._pid  # a child's copy: the socket and thread are
        with self._lock:  # the parent's, so there is nothing to stop, only to fail
            if self._closed:
                return
            self._closed = True
            if forked:
                leftovers = self._take_outstanding()
        if forked:
            _fail(leftovers, ClosedError("the client is closed"))
            return
        self._waker.wake()
        if threading.current_thread() is not self.thread and self.thread.is_alive():
            self.thread.join(CLOSE_WAIT_S)  # the thread closes the waker as it ends
            if self.thread.is_alive():
                log.warning(
                    "the client's I/O thread did not stop within %g s: a done-callback "
                    "is blocking it (one that waits for another request never returns)",
                    CLOSE_WAIT_S,
                )
                # it would fail what is pending as it ends, and it may never end: fail it
                # here (a future settles once; the thread's own attempt is then a no-op)
                with self._lock:
                    stranded = self._outstanding()
                _fail(stranded, ClosedError("the client is closed"))
        if self.thread.ident is None:  # never started: nobody else will
            self._waker.close()

    def _outstanding(self) -> list[Pending]:
        """Hold the lock. Every request not yet answered: sent, or still in the inbox."""
        return [*self._pending.values(), *self._inbox]

    def _take_outstanding(self) -> list[Pending]:
        """Hold the lock. :meth:`_outstanding`, now no longer this loop's."""
        outstanding = self._outstanding()
        self._pending.clear()
        self._inbox.clear()
        return outstanding

    def _closed_error(self) -> IpuserveError:
        if self._crash is not None:  # not closed by the user: say what happened
            return UnavailableError(
                f"the client's I/O thread failed ({self._crash!r}; see the log); "
                "create a new Client"
            )
        return ClosedError("the client is closed")

    def silence_hint(self) -> str:
        """``": nothing has answered at ENDPOINT ..."`` while nothing ever has (and what is
        wrong when the backend port answered), else ``""``."""
        where = self.endpoint or "the endpoint"
        if self._broker_shut_down:
            return f": the broker at {where} shut down and no broker has answered since"
        if self._backend_port:
            return (
                f": {where} answers as a broker's backend (worker) port; clients connect to "
                "its frontend (client) port"
            )
        if self._heard_anything or time.monotonic() - self._born < _SUSPECT_SILENCE_S:
            return ""  # too soon to blame the endpoint (a timeout of 0.1 ms once did)
        return (
            f": nothing has answered at {where} since the client started; is the broker "
            "running, and is this its frontend (client) port?"
        )

    # ------------------------------------------------------------ I/O thread

    def _run(self) -> None:
        error: IpuserveError = ClosedError("the client is closed")
        try:
            self._ping(time.monotonic())
            self._loop()
        except Exception as exc:  # never leave callers waiting on a dead thread
            log.exception("client I/O thread failed")
            self._crash = exc
            error = UnavailableError(f"the client's I/O thread failed: {exc!r}")
        finally:
            with self._lock:
                self._closed = True
                leftovers = self._take_outstanding()
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._sock.close(linger=0)
            self._waker.close()  # here, not in close(): that may run on this very thread
            _fail(leftovers, error)

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._waker.fileno(), zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while not self._closed:
            # the socket's pipe was full: wait for room too, to send what did not go
            poller.modify(self._sock, zmq.POLLIN | (zmq.POLLOUT if self._unsent else 0))
            events = dict(poller.poll(self._poll_timeout_ms()))
            if self._waker.fileno() in events:
                self._take_inbox()
            if self._sock in events:
                if events[self._sock] & zmq.POLLIN:
                    self._receive()
                if events[self._sock] & zmq.POLLOUT:
                    self._send_unsent()
            if self._monitor in events:
                self._on_connection_events()
            if self._closed:  # close() gave up on a callback that blocked this turn
                break
            self._tick()
            self._flush_outgoing()

    def _on_connection_events(self) -> None:
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self._connected = False
                continue
            self._connected = True  # EVENT_HANDSHAKE_SUCCEEDED
            if not self._ever_connected:
                self._ever_connected = True
                continue
            self.stats.reconnects += 1
            # The peer may be another broker, with a smaller payload limit: until its PONG
            # hold what could exceed it, as before the first PONG. A frame beyond that
            # broker's limit + slack makes ZeroMQ drop the connection; re-sent on each
            # reconnection under the old limit, it once made hundreds of them a minute.
            self.stats.max_payload_bytes = None
            self._ping(time.monotonic())
            # What went out on the lost connection may be lost with it (and replies the
            # broker could not deliver are); what was sent since waited in the socket's
            # pipe and goes out now by itself, once more with this re-send.
            if self._pending:
                log.info("reconnected to the broker; re-sending %d", len(self._pending))
                self._resend_all()
                self._resent_on_reconnect = True

    def _take_inbox(self) -> None:
        self._waker.clear()
        with self._lock:
            items, self._inbox = self._inbox, deque()
        for pending in items:
            self._send_new(pending)

    def _send_new(self, pending: Pending) -> None:
        if not self._pending:
            self._wake_liveness(time.monotonic())
        self._pending[pending.request_id] = pending
        if pending.deadline_ns is not None:
            entry = (pending.deadline_ns, next(self._seq), pending.request_id)
            heapq.heappush(self._deadlines, entry)
            if len(self._deadlines) > max(_COMPACT_AT, 4 * len(self._pending)):
                self._compact_deadlines()
        self._outgoing.append(pending)
        self.stats.sent += 1
        if len(self._outgoing) >= self.config.batch_requests:
            self._flush_outgoing()

    def _flush_outgoing(self) -> None:
        """Send what this turn handed over, in order: runs of small requests together."""
        if not self._outgoing:
            return
        outgoing, self._outgoing = self._outgoing, []
        batch: list[Pending] = []
        for pending in outgoing:
            if self._pending.get(pending.request_id) is not pending:
                continue  # answered (expired) in this same turn
            if self._batchable(pending):
                batch.append(pending)
                continue
            self._send_together(batch)
            batch = []
            self._send(pending)
        self._send_together(batch)

    def _send_together(self, batch: list[Pending]) -> None:
        if len(batch) == 1:
            self._send(batch[0])
        elif batch:
            self._send_batch(batch)

    def _batchable(self, pending: Pending) -> bool:
        size, limit = pending.payload_bytes, self.stats.max_payload_bytes
        return (
            isinstance(pending.message, wire.Request)
            and size <= self.config.batch_payload_bytes
            and (limit is None or size <= limit)
        )

    def _send_batch(self, batch: list[Pending]) -> None:
        now = time.perf_counter_ns()
        requests = [m for p in batch if isinstance(m := p.message_at(now), wire.Request)]
        limit = self.stats.max_payload_bytes or wire.FRAME_SLACK_BYTES
        message = wire.Requests(tuple(_grouped(requests, limit)))
        self.stats.grouped += sum(len(row.group) for row in message.requests)
        for frames in wire.encode_batch(message):  # the broker decodes with the defaults
            try:
                _send_frames(self._sock, frames)
            except zmq.Again:  # which rows did not go is not known: all go again
                self._unsent.update(dict.fromkeys(p.request_id for p in batch))
                break
        self.stats.batched += len(batch)

    def _wake_liveness(self, now: float) -> None:
        """Busy again after idling: silence while idle means nothing, and PING if due.

        Not a PING per request: with one request at a time the pending table empties
        after every reply, and a PING each time would double the broker's work.
        """
        if now >= self._next_ping:
            self._last_heard = now
            self._resent_in_silence = False
            self._ping(now)

    def _send(self, pending: Pending) -> None:
        size, limit = pending.payload_bytes, self.stats.max_payload_bytes
        if limit is not None and size > limit:
            error = PayloadTooLargeError(
                f"the request's tensors take {size} bytes; the broker's limit is {limit}"
            )
            self._finish(pending.request_id, lambda p: p.fail(error))
            return
        if size > wire.FRAME_SLACK_BYTES and (limit is None or not self._connected):
            # sent by _on_pong; while disconnected too: the broker back may have a smaller
            # limit, and a frame waiting in ZeroMQ's pipe could no longer be taken back
            self._held[pending.request_id] = None
            return
        try:
            _send_frames(self._sock, pending.frames(time.perf_counter_ns()))
        except zmq.Again:
            self._unsent[pending.request_id] = None

    def _send_unsent(self) -> None:
        """Send, in order, what found the socket's pipe full (send_hwm). Nothing else
        would: the re-send after a silence never comes while the broker answers the
        rest, and such requests once waited out their timeout (or for ever)."""
        for request_id in list(self._unsent):
            del self._unsent[request_id]
            pending = self._pending.get(request_id)
            if pending is not None:  # not answered or expired meanwhile
                self._send(pending)
                if request_id in self._unsent:
                    return  # full again

    def _ping(self, now: float) -> None:
        self._next_ping = now + self.config.ping_interval_s
        try:
            _send_frames(self._sock, wire.Ping().encode())
        except zmq.Again:
            pass

    def _receive(self) -> None:
        for _ in range(self.config.recv_batch):
            frames = wire.try_recv(self._sock)
            if frames is None:
                return
            self._last_heard = time.monotonic()
            self._heard_anything = True
            self._resent_in_silence = False
            self._on_frames(frames)

    def _on_frames(self, frames: list[zmq.Frame]) -> None:
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
            self._on_pong(message)
        elif isinstance(message, wire.ErrorReply):
            self._on_error(message)
        elif isinstance(message, wire.Reply | wire.ModelsReply):
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
        """Fail the request with the error its peer reported, except that a broker's
        BROKER_SHUTDOWN keeps it pending: a restarted broker gets it again (new epoch,
        or silence, re-send everything pending), and its deadline still applies."""
        request_id = error.request_id if isinstance(error, wire.ErrorReply) else error.job_id
        if error.code == BrokerShutdownError.code and request_id in self._pending:
            self._broker_shut_down = True
            self.stats.held_over_shutdown += 1
            return
        exception = error.exception()
        self._finish(request_id, lambda p: p.fail(exception))

    def _on_backend_port(self) -> None:
        """Pointed at a broker's backend: nothing sent there will ever be answered."""
        self._backend_port = True
        error = UnavailableError(self.silence_hint().removeprefix(": "))
        for request_id in list(self._pending):
            self._finish(request_id, lambda p: p.fail(error))

    def _on_answer(self, message: wire.Reply | wire.ModelsReply) -> None:
        pending = self._pending.get(message.request_id)
        if pending is not None and EXPECTS[type(pending.message)] is not type(message):
            error = ProtocolError(f"{message.COMMAND.name} does not answer this request")
            self._finish(message.request_id, lambda p: p.fail(error))
            return
        self._finish(message.request_id, lambda p: _resolve(p, message))

    def _on_malformed(self, frames: list[zmq.Frame], error: IpuserveError) -> None:
        """A reply we cannot read fails its request (when its id is readable), never the loop."""
        self.stats.malformed += 1
        log.warning("malformed message from the broker: %s", error)
        for request_id in wire.peek_ids(frames) or [wire.peek_id(frames)]:
            if request_id in self._pending:
                self._finish(request_id, lambda p: p.fail(error))

    def _finish(self, request_id: bytes, settle: Any) -> None:
        pending = self._pending.pop(request_id, None)
        if pending is None:
            self.stats.dropped_replies += 1
            return
        self.stats.replies += 1
        if not pending.future.done():
            try:
                settle(pending)  # runs the future's callbacks on this thread
            except Exception as exc:  # e.g. numpy cannot view the reply's tensors
                log.exception("cannot hand request %s its reply", request_id.hex())
                pending.fail(ProtocolError(f"unreadable reply ({exc!r})"))  # it left the table

    def _on_pong(self, pong: wire.Pong) -> None:
        self._broker_shut_down = False  # a broker answers again
        self._connected = True  # (its handshake event may still wait in the monitor)
        known = self.stats.epoch
        self.stats.epoch = pong.epoch
        self.stats.max_payload_bytes = pong.max_payload_bytes
        held, self._held = self._held, {}
        resent, self._resent_on_reconnect = self._resent_on_reconnect, False
        if known is not None and known != pong.epoch:
            self.stats.epoch_changes += 1
            if not resent:  # else the reconnection re-sent them, all but those held
                log.warning(
                    "broker restarted (epoch %s -> %s); re-sending %d",
                    known,
                    pong.epoch,
                    len(self._pending),
                )
                self._resend_all()
                return
            log.warning("broker restarted (epoch %s -> %s)", known, pong.epoch)
        for request_id in held:
            pending = self._pending.get(request_id)
            if pending is not None:  # not expired meanwhile
                self._send(pending)

    def _resend_all(self) -> None:
        for pending in list(self._pending.values()):
            self._send(pending)
            self.stats.resent += 1

    def _tick(self) -> None:
        self._expire(time.perf_counter_ns())
        if not self._pending:
            return
        now = time.monotonic()
        if now - self._last_heard > self.config.liveness_s and not self._resent_in_silence:
            # Once per silence, and only over a connection: ZeroMQ keeps what is sent
            # while the broker is away and delivers it all when one is back, so a re-send
            # every liveness window multiplied the work of a broker coming back (a chaos
            # review: 3000 runs for 1000 requests after 20 s away). Reconnecting re-sends.
            self._resent_in_silence = True
            if not self._connected:
                log.warning(
                    "broker silent for %.1f s, not connected; %d pending go again once it is%s",
                    now - self._last_heard,
                    len(self._pending),
                    self._first_silence_hint(),
                )
            else:  # connected, yet silent: a hung broker may have lost them
                log.warning(
                    "broker silent for %.1f s; re-sending %d%s",
                    now - self._last_heard,
                    len(self._pending),
                    self._first_silence_hint(),
                )
                self._resend_all()
        if now >= self._next_ping:
            self._ping(now)

    def _first_silence_hint(self) -> str:
        """The hint, once: later warnings repeat only the figures."""
        hint = "" if self._hinted else self.silence_hint()
        self._hinted = self._hinted or bool(hint)
        return hint

    def _compact_deadlines(self) -> None:
        """Drop the entries of requests answered since: each stays in the heap until its
        deadline otherwise, so with long timeouts the heap grew with every request."""
        self._deadlines = [entry for entry in self._deadlines if entry[2] in self._pending]
        heapq.heapify(self._deadlines)

    def _expire(self, now_ns: int) -> None:
        while self._deadlines and self._deadlines[0][0] <= now_ns:
            _, _, request_id = heapq.heappop(self._deadlines)
            pending = self._pending.get(request_id)
            if pending is None or pending.deadline_ns is None or pending.deadline_ns > now_ns:
                continue
            if not pending.graced and self._broker_answers():
                pending.graced = True
                grace_ns = pending.deadline_ns + int(self.config.deadline_grace_s * 1e9)
                heapq.heappush(self._deadlines, (grace_ns, next(self._seq), request_id))
                continue
            del self._pending[request_id]
            self.stats.expired += 1
            pending.fail(
                DeadlineExceeded(
                    f"no reply within {pending.timeout_s} s (request {request_id.hex()})"
                    + self.silence_hint()
                )
            )

    def _broker_answers(self) -> bool:
        """The broker spoke lately: its own answer to an expired request is on the way."""
        return (
            self.config.deadline_grace_s > 0
            and self._heard_anything
            and not self._backend_port
            and time.monotonic() - self._last_heard < self.config.liveness_s
        )

    def _poll_timeout_ms(self) -> int:
        if self._inbox or self._outgoing:
            return 0
        waits = []
        if self._deadlines:
            waits.append((self._deadlines[0][0] - time.perf_counter_ns()) / 1e6)
        if self._pending:
            waits.append((self._next_ping - time.monotonic()) * 1e3)
        return -1 if not waits else min(max(int(min(waits)) + 1, 0), _MAX_POLL_MS)


def _grouped(requests: list[wire.Request], max_bytes: int) -> Iterator[wire.Request]:
    """Runs of requests for the same model with the same tensor specs, as groups: the
    broker and the worker handle a group as one job, so its requests cost them little
    more than one. A group's tensors stay within ``max_bytes`` (the broker's payload
    limit): each of its frames holds every member's tensor, and a frame past the limit
    would be refused by ZeroMQ. A group's timeout is its members' latest (this thread
    still times out each request at its own deadline)."""
    run: list[wire.Request] = []
    size = 0
    for request in requests:
        nbytes = request.tensors.nbytes
        if run and (
            request.model != run[0].model
            or request.tensors.specs != run[0].tensors.specs
            or size + nbytes > max_bytes
        ):
            yield _group(run)
            run, size = [], 0
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
    )


def _send_frames(sock: zmq.Socket[Any], frames: list[wire.Frame]) -> None:
    """Send without blocking and without copying tensors (the protocol's own fast send:
    pyzmq's send_multipart costs several enum operations per frame)."""
    wire.send(sock, frames, nonblock=True)


def _fail(leftovers: list[Pending], error: IpuserveError) -> None:
    for pending in leftovers:
        pending.fail(type(error)(str(error)))


def _resolve(pending: Pending, message: wire.Message) -> None:
    try:
        result = pending.parse(message, pending)
    except IpuserveError as exc:
        pending.fail(exc)
    else:
        pending.succeed(result)
