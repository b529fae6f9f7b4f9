"""Joining a broker: HELLO until WELCOME, with backoff, and saying why it takes long.

A worker (re)joins on a fresh DEALER each time: it sends HELLO (its models and credit)
and waits for WELCOME, retrying with exponential backoff. While it waits it keeps
taking its backend's outcomes (the ``idle`` callback), wakes at once for a stop
request, and warns now and then that it has not joined -- naming what answered
instead when that was no broker's backend (e.g. a frontend port). A handshake the
broker refuses (its keys: the socket's monitor sees it) is logged at ERROR at once,
with the reason, and retried like any other: a SIGHUP may admit the key.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from ipuserve import protocol as wire
from ipuserve import transport
from ipuserve.errors import IpuserveError
from ipuserve.worker.config import WorkerConfig

log = logging.getLogger(__name__)

#: A worker still without a WELCOME this long after it began (re)joining its broker
#: says so at WARNING, then again every JOIN_WARNING_EVERY_S while it keeps retrying.
JOIN_WARNING_AFTER_S = 3.0
JOIN_WARNING_EVERY_S = 30.0

#: the handshake outcomes the join watches: the broker refused this worker
_REFUSALS = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


@dataclass(frozen=True, slots=True)
class Joined:
    """A new connection: its socket and the broker's WELCOME."""

    socket: zmq.Socket[Any]
    welcome: wire.Welcome


class Joiner:
    """Makes connections to one broker; :meth:`join` returns one, or None if stopped."""

    def __init__(
        self,
        config: WorkerConfig,
        context: zmq.Context[Any],
        hello: wire.Hello,
        wake_fd: int,
        *,
        stopping: Callable[[], bool],
        idle: Callable[[], None],
        credit: Callable[[], int] | None = None,
    ) -> None:
        """``wake_fd`` is polled beside the socket: ``idle`` runs when it fires (the
        worker's mailbox: outcomes, and the doorbell of a stop request). ``credit``,
        if given, is asked before each HELLO for the credit it announces (a worker
        with several brokers: :mod:`ipuserve.worker.credit`)."""
        self._credit = credit
        self._config = config
        self._context = context
        self._hello = hello
        self._wake_fd = wake_fd
        self._stopping = stopping
        self._idle = idle
        self._limits = wire.Limits(max_payload_bytes=config.max_payload_bytes)
        #: the broker refused every model we serve: stop, and exit 1
        self.refused = False
        #: while joining: when it began, when to warn next, what answered HELLO instead
        self._since = 0.0
        self._warning_at = 0.0
        self._answer: str | None = None
        #: the last refusal logged since the last join (each new reason is logged), and
        #: the handshakes dropped without a word: one is a broker that died mid-way
        self._refusal: str | None = None
        self._silent_drops = 0

    def retarget(self, config: WorkerConfig) -> None:
        """Join ``config.broker`` from the next attempt on (the same broker, renamed)."""
        self._config = config

    def join(self) -> Joined | None:
        """HELLO until WELCOME, backing off between attempts; None if asked to stop (or
        refused: then :attr:`refused` is set)."""
        delay = self._config.reconnect_min_ms / 1000
        self._since = time.monotonic()
        self._warning_at = self._since + JOIN_WARNING_AFTER_S
        self._answer = None
        while not self._stopping() and not self.refused:
            joined = self._handshake()
            if joined is not None:
                return joined
            if self._stopping() or self.refused:  # no retry to announce
                break
            log.info("no WELCOME from %s; retrying in %.0f ms", self._config.broker, delay * 1e3)
            self.wait(delay)
            delay = min(2 * delay, self._config.reconnect_max_ms / 1000)
        return None

    def wait(self, seconds: float) -> None:
        """Sleep, but wake at once for a stop request (the wake fd is its doorbell)."""
        deadline = time.monotonic() + seconds
        poller = zmq.Poller()
        poller.register(self._wake_fd, zmq.POLLIN)
        while not self._stopping() and (left := deadline - time.monotonic()) > 0:
            if poller.poll(self._poll_ms(left)):
                self._idle()
            self._warn_if_not_joined()

    def _handshake(self) -> Joined | None:
        sock = self._new_socket()
        monitor: zmq.Socket[Any] = sock.get_monitor_socket(_REFUSALS)  # before connect
        try:
            sock.connect(self._config.broker)
            joined = self._await_welcome(sock, monitor)
        finally:
            with contextlib.suppress(zmq.ZMQError):  # (closed already when not joined)
                sock.disable_monitor()
            monitor.close(linger=0)
        if joined is not None:
            self._refusal, self._silent_drops = None, 0
        return joined

    def _await_welcome(self, sock: zmq.Socket[Any], monitor: zmq.Socket[Any]) -> Joined | None:
        hello = self._hello
        if self._credit is not None:
            hello = msgspec.structs.replace(hello, credit=self._credit())
        transport.send(sock, hello.encode())
        deadline = time.monotonic() + self._config.handshake_timeout_ms / 1000
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_fd, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while not self._stopping() and (left := deadline - time.monotonic()) > 0:
            events = dict(poller.poll(self._poll_ms(left)))
            if self._wake_fd in events:
                self._idle()
            if monitor in events:
                self._on_refused(monitor)
            if sock in events:
                welcome = self._welcome(sock)
                if welcome is not None:
                    return Joined(sock, welcome)
                if self.refused:
                    return None
            self._warn_if_not_joined()
        sock.close(linger=0)
        return None

    def _new_socket(self) -> zmq.Socket[Any]:
        sock: zmq.Socket[Any] = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.MAXMSGSIZE, transport.max_frame_bytes(self._config.max_payload_bytes))
        if self._config.keys is not None:  # before connect: libzmq reads it then
            self._config.keys.apply(sock)
        return sock

    def _on_refused(self, monitor: zmq.Socket[Any]) -> None:
        """ERROR, once per reason, that the broker refused the handshake: a refused
        peer gets no answer, so this is all the operator learns on this side."""
        while monitor.poll(0):
            event = recv_monitor_message(monitor)
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                self._silent_drops += 1
                if self._silent_drops < 2:
                    continue
            why = self._refusal_reason(int(event["event"]), int(event["value"]))
            if why is not None and why != self._refusal:
                self._refusal = why
                log.error(
                    "the broker at %s refused this worker's connection: %s; still retrying",
                    self._config.broker,
                    why,
                )

    def _refusal_reason(self, event: int, value: int) -> str | None:
        """The worker's words for a failed handshake (None: not one to name)."""
        keys = self._config.keys
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH and keys is not None:
            return (
                f"ZAP status {value}: its key {keys.pair.fingerprint} is not in the broker's "
                "--worker-keys (copy its public key file there, then SIGHUP the broker)"
            )
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return (
                f"ZAP status {value}: a keyless broker in protected mode admits only peers "
                "on its host (give both keys, or start the broker with --insecure)"
            )
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH or (
            event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and keys is None
        ):
            return (
                "the broker speaks another security mechanism (a broker with keys needs "
                "--curve-secret-key and --broker-public-key, one without neither)"
            )
        if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL or value in (
            zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC,
            zmq.PROTOCOL_ERROR_ZMTP_KEY_EXCHANGE,
        ):
            return "the CURVE handshake failed: is --broker-public-key the broker's public key?"
        return None

    def _poll_ms(self, left: float) -> int:
        """A poll timeout for ``left`` seconds that wakes in time for the next warning."""
        until_warning = max(0.0, self._warning_at - time.monotonic())
        return int(min(left, until_warning) * 1000) + 1

    def _welcome(self, sock: zmq.Socket[Any]) -> wire.Welcome | None:
        try:
            message = wire.decode(transport.recv(sock), self._limits)
        except IpuserveError as exc:
            log.warning("malformed message during the handshake: %s", exc)
            self._answer = f"a malformed message ({exc})"
            return None
        if isinstance(message, wire.ErrorReply):  # what a frontend says to a HELLO
            self._answer = f"ERROR {message.code} ({message.message})"
        if not isinstance(message, wire.Welcome):
            return None
        if self._refused_everything(sock, message):
            return None
        return message

    def _refused_everything(self, sock: zmq.Socket[Any], welcome: wire.Welcome) -> bool:
        """Say which models the broker refused; if it refused them all, leave (BYE) and
        stop with exit code 1, so that an operator or a supervisor sees it and a restart
        tries again, rather than idle as a worker that gets no traffic."""
        for model, why in welcome.refused:
            log.error("the broker at %s refused model %r: %s", self._config.broker, model, why)
        refused = {model for model, _why in welcome.refused}
        if not refused or {spec.name for spec in self._hello.models} - refused:
            return False
        transport.send(sock, wire.Bye().encode())
        sock.close(linger=1000)  # let the BYE go: the broker then drops us at once
        log.error(
            "worker %s stops: the broker refused every model it serves",
            self._config.worker_id,
        )
        self.refused = True
        return True

    def _warn_if_not_joined(self) -> None:
        """WARNING (now and then) that the broker has not let us in: silence would look
        like a working worker that gets no traffic."""
        now = time.monotonic()
        if now < self._warning_at:
            return
        self._warning_at = now + JOIN_WARNING_EVERY_S
        if self._answer is not None:
            hint = (
                f"it answered HELLO with {self._answer}: that is no broker's backend, "
                "likely its frontend (client) endpoint; point --broker at the broker's "
                "backend (worker) endpoint, e.g. tcp://HOST:5556"
            )
        else:
            hint = (
                "check that the broker is running and that this is its backend (worker) "
                "endpoint, e.g. tcp://HOST:5556, not its frontend (client) one"
            )
            if self._config.keys is not None:  # a refused handshake looks just like this
                hint += (
                    f"; and that the broker admits this worker's key "
                    f"{self._config.keys.pair.fingerprint} (its public key file in the "
                    "broker's --worker-keys) and --broker-public-key is the broker's"
                )
        log.warning(
            "worker %s has not joined the broker at %s after %.0f s (no WELCOME to its "
            "HELLO); still retrying: %s",
            self._config.worker_id,
            self._config.broker,
            now - self._since,
            hint,
        )
