"""The HTTP door's request body: read within the limit, inflated by the gateway itself.

aiohttp would inflate a ``Content-Encoding: gzip`` or ``deflate`` body on its own and
check the limit only on what it had already inflated (a 1 MiB gzip bomb cost 330-510 MB
before its 413), so the server runs with ``auto_decompress=False`` and the body is
inflated here with ``zlib.decompressobj(...).decompress(data, max_length)``: the output
can never pass the body limit, and a body inflating more than :data:`MAX_RATIO` times
its size (past its first MiB) is refused as a bomb. A body that is not what its
encoding says is a 400. The body is read into one buffer of its ``Content-Length``
(no second copy); the HTTP door inflates large ones off the event loop
(gateway/offload.py).
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Callable

from aiohttp import StreamReader

from ipuserve.errors import PayloadTooLargeError, RequestError

#: a compressed body may inflate at most this many times its size (past its first MiB):
#: deflate reaches ~1,000:1 on a run of one byte, real tensors 1-10:1
MAX_RATIO = 200
#: ... it is allowed any ratio up to this many bytes of output
RATIO_FREE_BYTES = 1 << 20
#: the encodings the gateway inflates: zlib's ``wbits`` for each
ENCODINGS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
_STEP = 1 << 20
#: the options whose limits a refusal names
BODY_OPTION = "--max-body-bytes"
JSON_OPTION = "--max-json-bytes"


def encoding_of(header: str | None) -> str | None:
    """The ``Content-Encoding`` to undo (None: identity); 415-worthy ones refused 400."""
    encoding = (header or "identity").strip().lower()
    if encoding in ("", "identity"):
        return None
    if encoding not in ENCODINGS:
        raise RequestError(
            f"Content-Encoding {encoding[:40]!r} is not supported (gzip, deflate or identity)"
        )
    return encoding


async def read_raw(
    content: StreamReader,
    length: int | None,
    limit: int,
    option: str = BODY_OPTION,
    prefix: bytes = b"",
) -> bytearray:
    """The body as sent, at most ``limit`` bytes (else :class:`PayloadTooLargeError`
    naming ``option``): into one buffer of ``length`` when the client gave it.
    ``prefix``: its first bytes, already read (:func:`read_head`)."""
    if length is not None:
        if length > limit:
            raise PayloadTooLargeError(too_large(length, limit, option=option))
        body, got = bytearray(length), len(prefix)
        body[:got] = prefix
        while got < length:
            chunk = await content.readany()
            if not chunk:
                raise RequestError(f"the body ended after {got} of its {length} bytes")
            body[got : got + len(chunk)] = chunk
            got += len(chunk)
        return body
    body = bytearray(prefix)
    while chunk := await content.readany():
        body += chunk
        if len(body) > limit:
            raise PayloadTooLargeError(too_large(None, limit, option=option))
    return body


async def read_head(content: StreamReader, size: int) -> bytes:
    """The body's first ``size`` bytes (a binary-extension body's JSON header)."""
    try:
        return await content.readexactly(size)
    except asyncio.IncompleteReadError as exc:
        raise RequestError(
            f"the body ended after {len(exc.partial)} bytes, within its {size}-byte JSON header"
        ) from None


def inflate(
    raw: bytearray,
    encoding: str,
    limit: int,
    option: str = BODY_OPTION,
    head: int = 0,
    binary_size: Callable[[bytes], int] | None = None,
) -> bytearray:
    """``raw`` inflated, at most ``limit`` bytes and :data:`MAX_RATIO` times its size.
    With ``binary_size``: once the first ``head`` bytes (a binary body's JSON header)
    are out, no more is inflated than ``binary_size`` says they declare, so a body that
    lies about its tensors costs its header, not the limit."""
    inflater = zlib.decompressobj(ENCODINGS[encoding])
    out = bytearray()
    data = memoryview(raw)
    cap = limit if binary_size is None else min(head, limit)
    try:
        while data and not inflater.eof:
            out += inflater.decompress(data, min(_STEP, cap + 1 - len(out)))
            data = memoryview(inflater.unconsumed_tail)
            _check_growth(len(out), len(raw) - len(data), limit, option)
            if binary_size is not None and len(out) >= head:
                cap = min(limit, head + binary_size(bytes(out[:head])))
                binary_size = None
            if len(out) > cap:
                raise RequestError(
                    f"the body inflates to more than the {cap} bytes its JSON header and "
                    "its inputs' binary_data_size declare"
                )
        out += inflater.flush()
    except zlib.error as exc:
        raise RequestError(f"the body is not valid {encoding} data: {exc}") from None
    if not inflater.eof or inflater.unused_data:
        raise RequestError(f"the body is not one complete {encoding} stream")
    return out


def _check_growth(produced: int, consumed: int, limit: int, option: str) -> None:
    if produced > limit:
        raise PayloadTooLargeError(too_large(None, limit, "inflated ", option))
    if produced > RATIO_FREE_BYTES and produced > MAX_RATIO * max(consumed, 1):
        raise PayloadTooLargeError(
            f"the request body inflates more than {MAX_RATIO} times its size "
            f"({consumed} bytes to over {produced}): refused as a compression bomb"
        )


def too_large(size: int | None, limit: int, what: str = "", option: str = BODY_OPTION) -> str:
    given = "" if size is None else f" ({size} bytes)"
    message = f"the {what}request body{given} is over the gateway's limit of {limit} bytes"
    if option == JSON_OPTION:
        return (
            f"{message} for JSON ({option}): send large tensors as binary data "
            "(the binary tensor data extension, tritonclient's default)"
        )
    return f"{message} ({option})"
