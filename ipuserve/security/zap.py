"""The broker's ZAP handler (RFC 27): one thread answering libzmq's questions.

libzmq asks ``inproc://zeromq.zap.01`` of the socket's own context whether a peer
may complete its handshake on a socket that has a ZAP domain. This handler binds
that endpoint on the broker's context and answers with :func:`policy.decide`.

Why not pyzmq's ``ThreadAuthenticator``: its allow-any switch and address lists
are global to the context, not per domain; it has no roles; it logs every refusal
(a refused client retries every 100 ms, so the log would fill); and it runs an
asyncio loop for a REP socket. What it does right, this keeps: its own thread, so a
slow broker loop never stalls handshakes, and (with keys) the key as User-Id.

Start it **before** binding the broker's sockets: a CURVE server socket whose
context has no ZAP handler admits every key (libzmq's default).
Allow-lists are re-read by :meth:`ZapHandler.reload` (wire SIGHUP to it with
:func:`reload_on_sighup`). ZAP is asked only during a handshake, so with keys the
User-Id it gives a peer is its public key, not a role: the broker asks
:meth:`ZapHandler.role_of` for the role of each message's sender against the lists
in force then, and a key removed (and SIGHUP) is refused from its next message on
an open connection too (:meth:`ZapHandler.refuse_message` says why and counts it).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import signal
import threading
from collections.abc import Mapping
from pathlib import Path
from types import FrameType, TracebackType

import zmq
from zmq.utils.monitor import recv_monitor_message

from ipuserve.errors import ConfigError
from ipuserve.security.allowlists import DOMAIN_ROLES, AllowLists, Role
from ipuserve.security.keys import Z85_KEY_BYTES, fingerprint
from ipuserve.security.policy import LOOPBACK_NETWORKS, Mode, Verdict, decide
from ipuserve.security.roles import Roles

log = logging.getLogger(__name__)

#: numbers the handlers' inproc control endpoints, unique in the process
_HANDLER_NUMBERS = itertools.count()

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_VERSION = b"1.0"
#: distinct refused peers logged by name; past this, refusals are only counted, so a
#: peer that makes up a new key per attempt cannot fill the log or the memory
MAX_LOGGED_PEERS = 1024
#: handshake failures that never reach ZAP (those that do are counted as they are judged)
FAILED_BEFORE_ZAP = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
_HANDSHAKE_FAILURES: dict[int, str] = {
    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: "with another security mechanism "
    "(no CURVE on a CURVE socket, or CURVE on a keyless one)",
    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: "whose CURVE handshake failed "
    "(a wrong broker public key?)",
    zmq.PROTOCOL_ERROR_ZMTP_KEY_EXCHANGE: "whose CURVE key exchange failed",
}


class ZapHandler:
    """Admits peers to the broker's sockets by key and role (or by address, keyless).

    ``lists`` None means keyless: protected mode, or insecure mode with ``insecure``.
    Counters are read by the broker's metrics from another thread: read them through
    the properties, which copy under a lock."""

    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        lists: AllowLists | None = None,
        *,
        insecure: bool = False,
    ) -> None:
        if lists is not None and insecure:
            raise ConfigError("insecure applies to a broker without keys; it was given keys")
        self.context = context
        self.mode = (
            Mode.CURVE if lists is not None else (Mode.INSECURE if insecure else Mode.PROTECTED)
        )
        self._lists = lists
        self._roles = Roles.of(lists) if lists is not None else Roles.keyless()
        self._lock = threading.Lock()
        self._counted = threading.Condition(self._lock)  # notified on every refusal
        self._refused: dict[str, int] = dict.fromkeys(DOMAIN_ROLES, 0)
        self._refused_messages: dict[str, int] = dict.fromkeys(DOMAIN_ROLES, 0)
        self._admitted: dict[str, int] = {role.value: 0 for role in Role}
        self._logged: set[str] = set()
        self._unnamed = False  # MAX_LOGGED_PEERS reached: refusals only counted
        self._thread: threading.Thread | None = None
        # a number of its own, not id(self): a handler collected while its thread's
        # control socket still held the endpoint (freed later on ZeroMQ's reaper thread)
        # could pass its id to the next one, whose bind then failed "address in use"
        self._control_endpoint = f"inproc://ipuserve.zap-control.{next(_HANDLER_NUMBERS)}"
        self._control: zmq.Socket[bytes] | None = None
        self._watched = 0  # monitor endpoints handed out by watch()

    @classmethod
    def from_dirs(
        cls,
        context: zmq.Context[zmq.Socket[bytes]],
        *,
        client_keys: Path | str | None = None,
        worker_keys: Path | str | None = None,
        admin_keys: Path | str | None = None,
        insecure: bool = False,
    ) -> ZapHandler:
        """The handler for the broker's options: keys given (client and worker both
        required, admin optional) or none at all (protected or insecure)."""
        given = {Role.CLIENT: client_keys, Role.WORKER: worker_keys, Role.ADMIN: admin_keys}
        dirs = {role: Path(d) for role, d in given.items() if d is not None}
        if not dirs:
            return cls(context, None, insecure=insecure)
        missing = [r.value for r in (Role.CLIENT, Role.WORKER) if r not in dirs]
        if missing:
            raise ConfigError(
                f"key directories given for some roles but not for {' and '.join(missing)}; "
                "a broker with keys needs --client-keys and --worker-keys"
            )
        return cls(context, AllowLists.load(dirs), insecure=insecure)

    # -- life cycle ---------------------------------------------------------------
    def start(self) -> None:
        """Bind the ZAP endpoint (here, so a clash is raised to the caller) and start
        answering in a daemon thread."""
        zap = self.context.socket(zmq.REP)
        zap.linger = 0
        try:
            zap.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as exc:
            zap.close()
            raise ConfigError(f"this context already has a ZAP handler: {exc}") from exc
        control = self.context.socket(zmq.PAIR)
        control.linger = 0
        try:
            control.bind(self._control_endpoint)
        except zmq.ZMQError:  # not left holding the ZAP endpoint for the next try
            zap.unbind(ZAP_ENDPOINT)
            zap.close()
            control.close()
            raise
        self._control = self.context.socket(zmq.PAIR)
        self._control.linger = 0
        self._control.connect(self._control_endpoint)
        self._thread = threading.Thread(
            target=self._serve, args=(zap, control), name="ipuserve-zap", daemon=True
        )
        self._thread.start()
        if self.mode is Mode.INSECURE:
            log.warning("%s", self.startup_line())
        else:
            log.info("%s", self.startup_line())

    def watch(self, sock: zmq.Socket[bytes], domain: str) -> None:
        """Also count handshakes on ``sock`` that fail before ZAP is asked: a peer
        without CURVE on a CURVE socket (mechanism mismatch), one with a wrong broker
        key, a ZMTP error. They are refused peers too, but no ZAP request tells of
        them, so the ZAP thread reads ``sock``'s monitor. Call after :meth:`start`,
        before ``sock`` binds; it returns once the thread listens."""
        if self._control is None:
            raise ConfigError("start the ZapHandler before watching a socket")
        self._watched += 1
        endpoint = f"inproc://ipuserve.zap-watch.{id(self)}.{self._watched}"
        sock.monitor(endpoint, FAILED_BEFORE_ZAP)
        self._control.send_multipart([b"WATCH", endpoint.encode(), domain.encode()])
        self._control.recv()  # the thread's monitor is connected: no event is lost

    def wait_refused(self, domain: str, count: int, timeout: float) -> bool:
        """Whether ``domain`` has refused ``count`` handshakes within ``timeout``
        seconds: for tests and probes, which must not poll the counter in a loop."""
        with self._counted:
            return self._counted.wait_for(lambda: self._refused.get(domain, 0) >= count, timeout)

    def stop(self) -> None:
        """End the thread and close its sockets (idempotent)."""
        if self._control is None or self._thread is None:
            return
        self._control.send(b"STOP")
        self._thread.join()
        self._control.close()
        self._control = None
        self._thread = None

    def __enter__(self) -> ZapHandler:
        self.start()
        return self

    def __exit__(
        self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- what the broker reads -----------------------------------------------------
    @property
    def refused_by_domain(self) -> dict[str, int]:
        """Refused handshakes per socket (``frontend``, ``backend``), for metrics."""
        with self._lock:
            return dict(self._refused)

    @property
    def refused_messages_by_domain(self) -> dict[str, int]:
        """Messages refused on open connections (:meth:`refuse_message`), per socket."""
        with self._lock:
            return dict(self._refused_messages)

    @property
    def admitted_by_role(self) -> dict[str, int]:
        """Admitted handshakes per role (``client``, ``worker``, ``admin``)."""
        with self._lock:
            return dict(self._admitted)

    @property
    def key_counts(self) -> dict[str, int]:
        """Keys per role in force now (empty without keys)."""
        lists = self._lists
        return lists.counts() if lists is not None else {}

    def startup_line(self) -> str:
        return startup_line(self.mode, self._lists)

    def role_of(self, frame: zmq.Frame, domain: str) -> Role | None:
        """The role the sender of ``frame`` (any frame of a message received with
        ``copy=False`` on ``domain``'s socket) has **now**, under the lists in force
        since the last reload; None: its key is in none of the socket's lists any more
        (refuse the message: :meth:`refuse_message`). Without keys, the most the socket
        grants (admin on the frontend, worker on the backend). What an "admin only"
        check reads; called from the broker's loop, it costs one frame read and one
        dict lookup."""
        return self._roles.role_of(frame, domain)

    def refuse_message(self, frame: zmq.Frame, domain: str) -> str:
        """Count a message :meth:`role_of` found no role for, log its key once (until
        the next reload), and return why, for the error the peer is answered."""
        sender = _peer_key(frame)
        admitting = " or ".join(r.value for r in DOMAIN_ROLES[domain])
        reason = (
            f"no longer in the {admitting} allow-list (removed, and the broker's lists "
            "reloaded): this connection's messages are refused from now on"
        )
        who = f"key {fingerprint(sender)}" if sender else "a peer without a key"
        with self._lock:
            self._refused_messages[domain] = self._refused_messages.get(domain, 0) + 1
            self._log_refusal_once(domain, Verdict(False, who=who, reason=reason))
        return f"this peer's {who} is {reason}; connect with an allowed key"

    def reload(self) -> dict[str, int]:
        """Re-read the allow-lists; new handshakes use them, open connections stay.

        A bad directory or file raises ConfigError and the lists in force stay as
        they were. Returns the keys per role now in force."""
        if self._lists is None:
            log.info("allow-lists not reloaded: the broker has no keys (%s mode)", self.mode.value)
            return {}
        lists = self._lists.reloaded()
        # reference swaps: the ZAP thread and the broker's loop see old or new; open
        # connections are judged by the new roles from their next message
        self._lists, self._roles = lists, Roles.of(lists)
        with self._lock:
            self._logged.clear()  # a key refused again after a change is worth a line
            self._unnamed = False
        counts = lists.counts()
        log.warning("allow-lists reloaded: %s", _counts_text(counts))
        return counts

    # -- the thread ---------------------------------------------------------------
    def _serve(self, zap: zmq.Socket[bytes], control: zmq.Socket[bytes]) -> None:
        poller = zmq.Poller()
        poller.register(zap, zmq.POLLIN)
        poller.register(control, zmq.POLLIN)
        monitors: dict[zmq.Socket[bytes], str] = {}
        try:
            while True:
                ready = dict(poller.poll())
                if control in ready:
                    command = control.recv_multipart()
                    if command[0] == b"STOP":
                        return
                    monitors[self._monitor(poller, command[1])] = command[2].decode()
                    control.send(b"OK")
                if zap in ready:
                    zap.send_multipart(self._answer(zap.recv_multipart()))
                for monitor in [m for m in monitors if m in ready]:
                    if not self._on_monitor_event(monitor, monitors[monitor]):
                        poller.unregister(monitor)
                        del monitors[monitor]
                        monitor.close(linger=0)
        finally:
            # unbind first: close() frees an inproc endpoint only later (ZeroMQ's reaper
            # thread), and a new handler on this context (a broker started again in the
            # same process) must be able to bind it as soon as stop() returns
            with contextlib.suppress(zmq.ZMQError):
                zap.unbind(ZAP_ENDPOINT)
            with contextlib.suppress(zmq.ZMQError):
                control.unbind(self._control_endpoint)
            for sock in (zap, control, *monitors):
                sock.close(linger=0)

    def _monitor(self, poller: zmq.Poller, endpoint: bytes) -> zmq.Socket[bytes]:
        monitor = self.context.socket(zmq.PAIR)
        monitor.linger = 0
        monitor.connect(endpoint.decode())
        poller.register(monitor, zmq.POLLIN)
        return monitor

    def _on_monitor_event(self, monitor: zmq.Socket[bytes], domain: str) -> bool:
        """Count a handshake that failed before ZAP; False once the socket is gone."""
        event = recv_monitor_message(monitor)
        if event["event"] == zmq.EVENT_MONITOR_STOPPED:
            return False
        reason = _HANDSHAKE_FAILURES.get(int(event["value"]), "whose handshake failed")
        self._count(domain, Verdict(False, who="a peer", reason=reason))
        return True

    def _answer(self, request: list[bytes]) -> list[bytes]:
        """The reply to one request; never raises (a dead ZAP thread would leave every
        later handshake hanging), an unexpected error is a 500 and a logged trace."""
        if len(request) < 6 or request[0] != ZAP_VERSION:
            log.error("malformed ZAP request (%d frames) refused", len(request))
            request_id = request[1] if len(request) > 1 else b""
            return [ZAP_VERSION, request_id, b"400", b"refused", b"", b""]
        _version, request_id, domain_b, address_b, _identity, mechanism = request[:6]
        domain = domain_b.decode("utf-8", "replace")
        try:
            verdict = decide(
                self.mode,
                self._lists,
                domain,
                address_b.decode("utf-8", "replace"),
                mechanism,
                request[6:],
            )
        except Exception:
            log.exception("ZAP handler failed on a request for %r: refused", domain)
            return [ZAP_VERSION, request_id, b"500", b"internal error", b"", b""]
        self._count(domain, verdict)
        if verdict.admitted:
            return [ZAP_VERSION, request_id, b"200", b"OK", verdict.user_id.encode(), b""]
        return [ZAP_VERSION, request_id, b"400", b"refused", b"", b""]

    def _count(self, domain: str, verdict: Verdict) -> None:
        """Count the verdict; log a refused peer the first time only (it retries).

        The line is logged under the lock, so whoever sees the count (wait_refused,
        metrics) can also find the line: logging never calls back into this class."""
        with self._lock:
            if verdict.admitted:
                self._admitted[verdict.role] = self._admitted.get(verdict.role, 0) + 1
                return
            self._refused[domain] = self._refused.get(domain, 0) + 1
            self._log_refusal_once(domain, verdict)
            self._counted.notify_all()

    def _log_refusal_once(self, domain: str, verdict: Verdict) -> None:
        peer = f"{domain}/{verdict.who}/{verdict.reason}"
        if peer in self._logged or self._unnamed:
            return
        if len(self._logged) >= MAX_LOGGED_PEERS:
            self._unnamed = True
            log.warning(
                "%d distinct peers refused: further ones are only counted", MAX_LOGGED_PEERS
            )
            return
        self._logged.add(peer)
        log.warning(
            "refused a peer on the %s socket: %s %s (logged once per peer)",
            domain,
            verdict.who,
            verdict.reason,
        )


def startup_line(mode: Mode, lists: AllowLists | None) -> str:
    """The line a broker logs at start saying which protection is in force."""
    if mode is Mode.CURVE and lists is not None:
        return (
            f"security: CURVE, peers admitted by key: {_counts_text(lists.counts())} "
            f"(allow-lists re-read on SIGHUP)"
        )
    if mode is Mode.INSECURE:
        return (
            "security: INSECURE: no keys and --insecure, so every address is admitted "
            "and nothing is encrypted or authenticated; anyone who reaches the backend "
            "port can serve as a worker and read every request"
        )
    return (
        f"security: protected mode: no keys, so only peers on this host "
        f"({LOOPBACK_NETWORKS}, ipc://) are admitted; give keys "
        f"(docs/security.md) or --insecure to admit other addresses"
    )


def reload_on_sighup(handler: ZapHandler) -> None:
    """Make SIGHUP re-read ``handler``'s allow-lists (main thread only, as any
    ``signal.signal``); a bad list is logged and the lists in force stay."""

    def on_sighup(_signum: int, _frame: FrameType | None) -> None:
        try:
            handler.reload()
        except ConfigError as exc:
            log.error("SIGHUP: allow-lists not reloaded, the previous ones stay: %s", exc)

    signal.signal(signal.SIGHUP, on_sighup)


def _peer_key(frame: zmq.Frame) -> str | None:
    """The sender's public key (Z85) of a frame on a CURVE socket, or None."""
    try:
        user_id = frame.get("User-Id")
    except zmq.ZMQError:
        return None
    text = str(user_id) if user_id else ""
    return text if len(text) == Z85_KEY_BYTES else None


def _counts_text(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{n} {role} key{'s' if n != 1 else ''}" for role, n in counts.items())
