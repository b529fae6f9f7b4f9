"""One call per socket to put it under the broker's protection, or to reach it.

Call these **before** ``bind``/``connect``: libzmq reads the mechanism options when
a connection starts, so a socket configured after connecting stays plaintext.

    curve_server(frontend, "broker.key_secret", FRONTEND_DOMAIN)   # broker, keys given
    keyless_server(frontend, FRONTEND_DOMAIN)                       # broker, no keys
    curve_client(dealer, "client.key_secret", "broker.key")         # client / worker

A server socket always gets a ZAP domain, keyed or not, so the ZapHandler decides
for every peer and every received frame carries a User-Id (:func:`peer_user_id`).
"""

from __future__ import annotations

from dataclasses import dataclass

import zmq

from ipuserve.errors import ConfigError
from ipuserve.security.keys import KeyPair, KeySource, load_public_key, load_secret_key


def curve_server(sock: zmq.Socket[bytes], secret_key: KeySource | KeyPair, domain: str) -> KeyPair:
    """Make ``sock`` a CURVE server with the broker's key, its peers judged by the ZAP
    handler under ``domain``. Returns the pair (its public half is what peers need)."""
    pair = secret_key if isinstance(secret_key, KeyPair) else load_secret_key(secret_key)
    sock.curve_secretkey = pair.secret
    sock.curve_publickey = pair.public
    sock.curve_server = True
    sock.zap_domain = domain.encode()
    return pair


def keyless_server(sock: zmq.Socket[bytes], domain: str) -> None:
    """A plaintext server socket whose peers the ZAP handler still judges (by address,
    in protected mode): without a domain libzmq would not ask it at all."""
    sock.zap_domain = domain.encode()


def server_socket(
    sock: zmq.Socket[bytes], domain: str, secret_key: KeySource | KeyPair | None
) -> None:
    """:func:`curve_server` with a key, :func:`keyless_server` without: the broker's
    one line per socket."""
    if secret_key is None:
        keyless_server(sock, domain)
    else:
        curve_server(sock, secret_key, domain)


def curve_client(
    sock: zmq.Socket[bytes], secret_key: KeySource | KeyPair, broker_public_key: KeySource
) -> KeyPair:
    """Make ``sock`` a CURVE client: its own pair (from the secret alone) and the
    broker's public key, which authenticates the broker to it."""
    pair = secret_key if isinstance(secret_key, KeyPair) else load_secret_key(secret_key)
    server = load_public_key(broker_public_key)
    if server == pair.public:
        raise ConfigError("the broker's public key is this peer's own key; give the broker's")
    sock.curve_secretkey = pair.secret
    sock.curve_publickey = pair.public
    sock.curve_serverkey = server
    return pair


@dataclass(frozen=True)
class ClientKeys:
    """A client's or worker's CURVE keys, loaded once: its own pair and the broker's
    public key. Loaded at start, so a bad file fails there and not at every reconnect."""

    pair: KeyPair
    broker_public: bytes

    def apply(self, sock: zmq.Socket[bytes]) -> None:
        """Make ``sock`` a CURVE client with these keys (before it connects)."""
        curve_client(sock, self.pair, self.broker_public)


#: how the two keys are named in a message: the CLI's options by default
OPTION_NAMES = ("--curve-secret-key", "--broker-public-key")


def client_keys(
    secret_key: KeySource | KeyPair | None,
    broker_public_key: KeySource | None,
    *,
    names: tuple[str, str] = OPTION_NAMES,
) -> ClientKeys | None:
    """Both keys loaded, or None when neither is given (plaintext). One without the
    other is a ConfigError naming the missing one (``names``: how the caller calls
    them): a half-configured client would silently talk plaintext to a broker that
    refuses it."""
    if secret_key is None and broker_public_key is None:
        return None
    if secret_key is None or broker_public_key is None:
        given, needed = names if secret_key is not None else names[::-1]
        raise ConfigError(f"{given} needs {needed} too (CURVE takes both)")
    pair = secret_key if isinstance(secret_key, KeyPair) else load_secret_key(secret_key)
    server = load_public_key(broker_public_key)
    if server == pair.public:
        raise ConfigError("the broker's public key is this peer's own key; give the broker's")
    return ClientKeys(pair, server)


def client_socket(
    sock: zmq.Socket[bytes],
    secret_key: KeySource | KeyPair | None,
    broker_public_key: KeySource | None,
) -> None:
    """:func:`curve_client` when both keys are given, plaintext when neither is; one
    without the other is a ConfigError (:func:`client_keys`)."""
    keys = client_keys(secret_key, broker_public_key)
    if keys is not None:
        keys.apply(sock)


def peer_user_id(frame: zmq.Frame) -> str | None:
    """The User-Id the ZAP handler gave the frame's sender (with keys its public key in
    Z85, without them its role, e.g. ``"admin"``), or None when its socket has no ZAP
    domain. Needs frames received with ``copy=False``; read it from any frame of the
    message. For the sender's role now, ask :meth:`ZapHandler.role_of`."""
    try:
        user_id = frame.get("User-Id")
    except zmq.ZMQError:
        return None
    return str(user_id) if user_id else None
