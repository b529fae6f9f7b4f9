"""ZeroMQ endpoints as users type them: what is one, and a message when it is not.

One check for every place an address comes in (the CLI options through
:class:`ipuserve.clikit.Endpoint`, and :class:`ipuserve.client.Client`), so a
mistyped address is one clear line instead of ZeroMQ's ``Invalid argument``.
"""

from __future__ import annotations

#: the ZeroMQ transports an ipuserve endpoint may use
ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


def endpoint_problem(value: str, *, bind: bool = False, port: int = 5555) -> str | None:
    """Why ``value`` is not a ZeroMQ endpoint to connect (or, with ``bind``, to bind) to.

    ``None`` when it is one: ``tcp://HOST:PORT``, ``ipc://PATH`` or ``inproc://NAME``;
    a bind address may use ``*`` for the host (every interface) and the port (any free
    one). The message is one line a user can act on, with an example on ``port``.
    """
    example = f"tcp://*:{port}" if bind else f"tcp://127.0.0.1:{port}"
    use = f"use tcp://HOST:PORT (e.g. {example})"
    scheme = next((s for s in ENDPOINT_SCHEMES if value.startswith(s)), None)
    if scheme is None:
        return f"{value!r} is not a ZeroMQ endpoint; {use}"
    rest = value[len(scheme) :]
    if not rest:
        return f"{value!r} is not a ZeroMQ endpoint (nothing after {scheme}); {use}"
    if scheme != "tcp://":
        return None
    host, colon, given = rest.rpartition(":")
    if not colon or not host:
        return f"{value!r} is not a ZeroMQ endpoint (no port); {use}"
    if "*" in (host, given) and not bind:
        return f"{value!r} is a bind address ('*'); to connect, {use}"
    if given == "*" or (given.isdigit() and int(given) <= 65535 and (bind or int(given) > 0)):
        return None
    return f"{value!r} is not a ZeroMQ endpoint (port {given!r}); {use}"
