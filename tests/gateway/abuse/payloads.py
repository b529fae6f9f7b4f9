"""What a hostile or careless client sends, built without holding more than it must.

The bodies are bytes exactly as they go on the wire (raw sockets, so no client library
fixes them up); the gzip ones are compressed chunk by chunk, so the test process never
holds the inflated text.
"""

from __future__ import annotations

import json
import socket
import threading
import zlib
from dataclasses import dataclass
from functools import cache

import numpy as np

MIB = 1024 * 1024
#: the mlp's input width in tests/gateway/conftest.py
FEATURES = 64


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def error(self) -> str:
        """The ``{"error": ...}`` message of a refusal."""
        message = json.loads(self.body)["error"]
        assert isinstance(message, str)
        return message


def infer_json(data: str, shape: list[int] | str, datatype: str = "FP32", extra: str = "") -> bytes:
    """An infer body for the mlp whose ``data`` is the JSON text given as it is."""
    shape_text = shape if isinstance(shape, str) else json.dumps(shape)
    tensor = f'{{"name":"input","datatype":"{datatype}","shape":{shape_text},"data":{data}}}'
    return f'{{"inputs":[{tensor}]{extra}}}'.encode()


def _gzip_of(prefix: bytes, unit: bytes, count: int, suffix: bytes) -> bytes:
    """gzip of ``prefix + unit * count + suffix`` made in slices."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    parts = [packer.compress(prefix)]
    block = unit * max(1, MIB // len(unit))
    whole, rest = divmod(count, MIB // len(unit) or 1)
    for _ in range(whole):
        parts.append(packer.compress(block))
    parts.append(packer.compress(unit * rest + suffix))
    parts.append(packer.flush())
    return b"".join(parts)


@cache
def nested_gzip_bomb(inflated: int = 60 * MIB) -> bytes:
    """~60 MiB of ``[[0],[0],...]`` for a ``[1, 64]`` input, gzipped (~60 KiB)."""
    head, tail = infer_json("@", [1, FEATURES]).split(b"@")
    return _gzip_of(head + b"[", b"[0],", inflated // 4, b"[0]]" + tail)


@cache
def gzip_bomb(inflated: int = 1024 * MIB) -> bytes:
    """1 GiB of JSON whitespace inside a body, gzipped (~1 MiB)."""
    return _gzip_of(b'{"inputs":', b" ", inflated, b"[]}")


@cache
def flat_list(size: int = 60 * MIB) -> bytes:
    """~60 MiB of ``[0,0,...]`` declared as a ``[1, 64]`` input."""
    return infer_json("[" + "0," * (size // 2) + "0]", [1, FEATURES])


@cache
def nested_list(size: int = 12 * MIB) -> bytes:
    """~12 MiB of ``[[0],[0],...]`` declared as a ``[1, 64]`` input, uncompressed."""
    return infer_json("[" + "[0]," * (size // 4) + "[0]]", [1, FEATURES])


def binary_lie(size: int = 60 * MIB) -> tuple[bytes, bytes]:
    """A binary-extension body whose ``[1, 64]`` FP32 input claims ``size`` bytes:
    (the JSON header, the whole body)."""
    parameters = f'"parameters":{{"binary_data_size":{size}}}'
    tensor = f'{{"name":"input","datatype":"FP32","shape":[1,{FEATURES}],{parameters}}}'
    header = f'{{"inputs":[{tensor}]}}'.encode()
    return header, header + bytes(size)


@cache
def gzip_binary_lie(size: int = 60 * MIB) -> tuple[bytes, bytes]:
    """:func:`binary_lie`, gzipped, its bytes of random bits compressing ~5:1 (well
    under the ratio cap): (the JSON header, the gzipped body)."""
    header, _ = binary_lie(size)
    bits = np.random.default_rng(0).integers(0, 2, size, dtype=np.uint8).tobytes()
    return header, zlib.compress(header + bits, 1, wbits=16 + zlib.MAX_WBITS)


def deep_json(depth: int = 100_000) -> bytes:
    return infer_json("[" * depth + "]" * depth, [1, FEATURES])


def exchange(host: str, port: int, head: bytes, body: bytes = b"", timeout: float = 60.0) -> Answer:
    """Send a request (headers as given, Content-Length added) on a new connection and
    read the answer, sending and reading at once: a server that answers before it
    has read a big body and then closes would otherwise reset a client still writing."""
    sock = socket.create_connection((host, port), timeout=timeout)
    request = head.rstrip(b"\r\n") + b"\r\nContent-Length: %d\r\n\r\n" % len(body)

    def send() -> None:
        try:
            sock.sendall(request)
            view = memoryview(body)
            for start in range(0, len(view), MIB):
                sock.sendall(view[start : start + MIB])
        except OSError:
            pass  # the server answered and closed before the body was all sent

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        return _read_answer(sock)
    finally:
        sock.close()
        sender.join(timeout)


def _read_answer(sock: socket.socket) -> Answer:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before an answer: {data[:200]!r}")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    return Answer(status, headers, rest[:length])


def post(path: str, *headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: gateway", "Content-Type: application/json"]
    return "\r\n".join([*lines, *headers]).encode("latin-1")


# ------------------------------------------------------------------ gRPC, by hand


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def bool_contents_request(count: int, model: str = "mlp") -> bytes:
    """A ModelInferRequest whose one BOOL input ``[1, 64]`` carries ``count`` packed
    ``bool_contents`` (inference.proto's field numbers), written without protobuf so
    the test holds one copy."""
    shape = _field(3, _varint(1) + _varint(FEATURES))
    contents = _field(5, _field(1, b"\x01" * count))
    tensor = _field(1, b"input") + _field(2, b"BOOL") + shape + contents
    return _field(1, model.encode()) + _field(5, tensor)


def raw_input_request(nbytes: int, model: str = "mlp") -> bytes:
    """A ModelInferRequest for an FP32 ``[1, 64]`` input with ``nbytes`` of raw contents."""
    shape = _field(3, _varint(1) + _varint(FEATURES))
    tensor = _field(1, b"input") + _field(2, b"FP32") + shape
    return _field(1, model.encode()) + _field(5, tensor) + _field(7, b"\0" * nbytes)
