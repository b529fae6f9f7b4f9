"""The broker's liveness as one client sees it: when to PING, when a silence or a
new connection or a new epoch means the pending requests must go again, and what
to tell a caller about an endpoint that never answered.

Decisions only: :class:`Liveness` touches no socket. Its link
(:mod:`ipuserve.client.link`) tells it what happened (a message heard, a PONG, a
connection event, a turn of the loop) and does what it answers (send a PING, re-send
everything pending, send what was held for the broker's payload limit). Its state is
the core's, guarded as the core is by its driver.

The rules: a PING goes out at connect and every ``ping_interval_s``, busy or idle
(so an idle broker's health is known before a request needs it); PONG carries the
broker's epoch. A new epoch (the broker restarted and lost its queue), a new
connection, or silence past ``liveness_s`` re-sends every pending request with its
original id; the broker drops duplicates it still holds, and replies for ids no
longer pending are dropped and counted. Until anything at
all has arrived (a PONG answers the PING sent at connect), the warning about
silence and every DEADLINE_EXCEEDED say that nothing has answered at the endpoint
since the client started: the usual cause is a wrong endpoint or port or no broker
at all.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import zmq

from ipuserve import protocol as wire
from ipuserve.client.config import ClientConfig, ClientStats
from ipuserve.errors import HandshakeRefusedError, UnavailableError

log = logging.getLogger(__name__)


#: handshakes the broker refused: the link's requests fail at once, saying why
HANDSHAKE_REFUSED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)

#: handshakes cut without a word, in a row, that make a refusal: a CURVE broker that
#: cannot decrypt the client's HELLO (the client has the wrong ``broker_public_key``)
#: just drops the connection, which the client sees as EVENT_HANDSHAKE_FAILED_NO_DETAIL;
#: a broker killed mid-handshake does so once, not again at the reconnection
SILENT_DROPS_REFUSE = 2


def connection_monitor(sock: zmq.Socket[Any]) -> zmq.Socket[Any]:
    """The events of ``sock``'s connections the I/O loop acts on; attach before connect()."""
    return sock.get_monitor_socket(
        zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | HANDSHAKE_REFUSED
    )


def handshake_problem(event: int, value: int) -> str | None:
    """Why the broker refused a handshake, in the client's words (None: not a refusal
    a client can act on). A refused peer gets no answer at all, so this is all it learns."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return (  # which side lacks what, the event does not say: name each case
            "the broker dropped the connection during the handshake: with keys, "
            "broker_public_key (--broker-public-key) is not the broker's public key (compare "
            "it with `ipuserve keys show FILE` on the broker's public key file); without "
            "keys, the broker has keys (give curve_secret_key and broker_public_key, "
            "--curve-secret-key and --broker-public-key), or this is no broker's frontend port"
        )
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (  # the event does not say which mechanism was refused: name both causes
            f"the broker refused this client (ZAP status {value}): with keys, its public "
            "key is in none of the broker's allow-lists for clients (`ipuserve keys show "
            "FILE` prints it for the broker's operator); without keys, it is not on the "
            "broker's host and the broker, keyless too, runs in protected mode (it admits "
            "other hosts only with keys, or with --insecure)"
        )
    if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return (
            "the broker speaks another security mechanism: a broker with keys needs "
            "curve_secret_key and broker_public_key (--curve-secret-key, "
            "--broker-public-key), one without keys neither"
        )
    if value in (zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC, zmq.PROTOCOL_ERROR_ZMTP_KEY_EXCHANGE):
        return "the CURVE handshake failed: is broker_public_key the broker's public key?"
    return None


class Liveness:
    """What the client knows of its broker's health, and what it should do about it."""

    def __init__(self, config: ClientConfig, endpoint: str, suspect_after_s: float) -> None:
        """``suspect_after_s``: silence since the start after which "is the broker
        running?" is a fair question (a PONG on a working connection takes ms)."""
        self._config = config
        self._endpoint = endpoint
        self._suspect_after_s = suspect_after_s
        self.connected = False
        self._ever_connected = False
        #: pending requests went to the new connection since the last PONG: a new
        #: epoch in that PONG needs no second re-send
        self._resent_on_reconnect = False
        self.last_heard = time.monotonic()
        #: anything at all arrived from the socket since the client started
        self.heard_anything = False
        #: pending requests were re-sent in the current silence (once is enough)
        self._resent_in_silence = False
        self._hinted = False
        #: the peer spoke the worker protocol: this is a broker's backend port
        self.backend_port = False
        #: the broker said BROKER_SHUTDOWN, and no broker has answered a PING since
        self.broker_shut_down = False
        #: why the broker refused the last handshake (None: none refused since one passed)
        self.refused: str | None = None
        #: handshakes dropped without a word since the last that passed
        self._silent_drops = 0
        self._next_ping = 0.0
        self._born = time.monotonic()

    # ------------------------------------------------------------ events

    def heard(self, now: float) -> None:
        """A message arrived: the broker is alive, whatever it said."""
        self.last_heard = now
        self.heard_anything = True
        self._resent_in_silence = False

    def pinged(self, now: float) -> None:
        self._next_ping = now + self._config.ping_interval_s

    def ping_due(self, now: float) -> bool:
        return now >= self._next_ping

    def seconds_to_ping(self, now: float) -> float:
        return self._next_ping - now

    def on_pong(self, pong: wire.Pong, stats: ClientStats, pending: int) -> bool:
        """A broker answers; True: re-send every pending request (a new epoch that no
        reconnection has re-sent to yet), else send what was held for its limit."""
        self.broker_shut_down = False  # a broker answers again
        self.connected = True  # (its handshake event may still wait in the monitor)
        known = stats.epoch
        stats.epoch = pong.epoch
        stats.max_payload_bytes = pong.max_payload_bytes
        resent, self._resent_on_reconnect = self._resent_on_reconnect, False
        if known is None or known == pong.epoch:
            return False
        stats.epoch_changes += 1
        if resent:  # the reconnection re-sent them, all but those held
            log.warning("broker restarted (epoch %s -> %s)", known, pong.epoch)
            return False
        log.warning("broker restarted (epoch %s -> %s); re-sending %d", known, pong.epoch, pending)
        return True

    def on_connection_event(
        self, event: int, stats: ClientStats, pending: int, value: int = 0
    ) -> bool:
        """A connection came or went; True: reconnected, PING and re-send what is pending.

        A new connection means replies sent meanwhile were lost (the broker drops what
        it cannot deliver, and a client it could not reach loses its queue after a
        while). What went out on the lost connection may be lost with it; what was sent
        since waited in the socket's pipe and goes out now by itself, once more with
        this re-send.
        """
        if event == zmq.EVENT_DISCONNECTED:
            self.connected = False
            return False
        if event & HANDSHAKE_REFUSED:  # no connection: ZeroMQ tries again by itself
            self._on_refused(event, value)
            return False
        self.connected = True  # EVENT_HANDSHAKE_SUCCEEDED
        self.refused = None
        self._silent_drops = 0
        if not self._ever_connected:
            self._ever_connected = True
            return False
        stats.reconnects += 1
        # The peer may be another broker, with a smaller payload limit: until its PONG
        # hold what could exceed it, as before the first PONG. A frame beyond that
        # broker's limit + slack makes ZeroMQ drop the connection; re-sent on each
        # reconnection under the old limit, it once made hundreds of them a minute.
        stats.max_payload_bytes = None
        if pending:
            log.info("reconnected to the broker; re-sending %d", pending)
            self._resent_on_reconnect = True
        return True

    def _on_refused(self, event: int, value: int) -> None:
        """A handshake failed; :attr:`refused` says why once it is a refusal (every
        failure but a lone silent drop), and the link's requests then fail at once."""
        if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            self._silent_drops += 1
            if self._silent_drops < SILENT_DROPS_REFUSE:
                return
        problem = handshake_problem(event, value)
        if problem is not None and self.refused is None:
            log.warning("%s refused the connection: %s", self._endpoint, problem)
        self.refused = problem or self.refused

    def silence(self, now: float, pending: int) -> bool:
        """Called each turn while requests are pending; True: re-send them all.

        Once per silence, and only over a connection: ZeroMQ keeps what is sent while
        the broker is away and delivers it all when one is back, so a re-send every
        liveness window multiplied the work of a broker coming back (a chaos review:
        3000 runs for 1000 requests after 20 s away). Reconnecting re-sends.
        """
        silent_s = now - self.last_heard
        if silent_s <= self._config.liveness_s or self._resent_in_silence:
            return False
        self._resent_in_silence = True
        if not self.connected:
            log.warning(
                "broker silent for %.1f s, not connected; %d pending go again once it is%s",
                silent_s,
                pending,
                self._first_silence_hint(),
            )
            return False
        # connected, yet silent: a hung broker may have lost them
        log.warning(
            "broker silent for %.1f s; re-sending %d%s",
            silent_s,
            pending,
            self._first_silence_hint(),
        )
        return True

    # ------------------------------------------------------------ questions

    def broker_answers(self) -> bool:
        """The broker spoke lately: its own answer to an expired request is on the way."""
        return (
            self._config.deadline_grace_s > 0
            and self.heard_anything
            and not self.backend_port
            and time.monotonic() - self.last_heard < self._config.liveness_s
        )

    def dead_end(self) -> UnavailableError | None:
        """Why nothing sent here can be answered now (None: it may be): the endpoint is
        a backend port, or the broker refused the handshake. The link's requests fail at
        once with it when no other link can take them; ZeroMQ goes on trying, and a
        handshake that passes later (the broker's allow-list reloaded) clears it."""
        if self.backend_port:
            return UnavailableError(self.silence_hint().removeprefix(": "))
        if self.refused is not None and not self.connected:
            where = self._endpoint or "the endpoint"
            return HandshakeRefusedError(f"{where} refused the connection: {self.refused}")
        return None

    def silence_hint(self) -> str:
        """``": nothing has answered at ENDPOINT ..."`` while nothing ever has (and what is
        wrong when the backend port answered), else ``""``."""
        where = self._endpoint or "the endpoint"
        if self.broker_shut_down:
            return f": the broker at {where} shut down and no broker has answered since"
        if self.backend_port:
            return (
                f": {where} answers as a broker's backend (worker) port; clients connect to "
                "its frontend (client) port"
            )
        if self.refused is not None and not self.connected:
            return f": {where} refused the connection: {self.refused}"
        if self.heard_anything or time.monotonic() - self._born < self._suspect_after_s:
            return ""  # too soon to blame the endpoint (a timeout of 0.1 ms once did)
        return (
            f": nothing has answered at {where} since the client started; is the broker "
            "running, and is this its frontend (client) port?"
        )

    def _first_silence_hint(self) -> str:
        """The hint, once: later warnings repeat only the figures."""
        hint = "" if self._hinted else self.silence_hint()
        self._hinted = self._hinted or bool(hint)
        return hint
