"""Slow, half-open and greedy HTTP clients cannot hold the gateway: the headers' and the
body's deadlines, the connection cap and the body size limit, each while other clients
are served. Raw sockets, so nothing between the test and the gateway fixes the bytes."""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.gateway.conftest import Fabric, GatewayProc, mlp_input, start_gateway
from tests.helpers import wait_until

pytestmark = pytest.mark.slow

#: how long a test waits for the gateway to act on a deadline of ~1 s
PATIENCE_S = 60.0


@contextmanager
def _connection(gateway: GatewayProc) -> Iterator[socket.socket]:
    host, port = gateway.host_port.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=PATIENCE_S)
    try:
        yield sock
    finally:
        sock.close()


def _read_all(sock: socket.socket) -> bytes:
    """Everything the gateway sends until it closes the connection."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _infer_ok(fabric: Fabric, gateway: GatewayProc) -> None:
    """A well-behaved client is served, correctly."""
    x = mlp_input(2, seed=11)
    tensor = httpclient.InferInput("input", [2, 64], "FP32")
    tensor.set_data_from_numpy(x)
    with httpclient.InferenceServerClient(gateway.host_port, network_timeout=PATIENCE_S) as c:
        result = c.infer("mlp", [tensor])
    want = fabric.models["mlp"].reference({"input": x})["logits"]
    np.testing.assert_allclose(result.as_numpy("logits"), want, rtol=1e-5, atol=1e-5)


def test_half_sent_headers_are_cut_off_while_others_are_served(fabric: Fabric) -> None:
    gateway = start_gateway(fabric.procs, fabric.broker, "--header-timeout-s", "1")
    with _connection(gateway) as slow:
        slow.sendall(b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: gateway\r\n")  # no end
        _infer_ok(fabric, gateway)  # served while the slow client hangs on
        assert _read_all(slow) == b""  # closed by the gateway, nothing answered
    with _connection(gateway) as idle:  # connected and silent: the same deadline
        assert _read_all(idle) == b""
    _infer_ok(fabric, gateway)


def test_a_body_that_stops_arriving_is_answered_408(fabric: Fabric) -> None:
    gateway = start_gateway(fabric.procs, fabric.broker, "--body-timeout-s", "1")
    with _connection(gateway) as slow:
        slow.sendall(
            b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: gateway\r\n"
            b'Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"inputs": '
        )
        _infer_ok(fabric, gateway)
        answer = _read_all(slow)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer
    assert "did not arrive within 1 s" in json.loads(body)["error"]


def test_connections_over_the_cap_are_refused_503_and_the_rest_served(fabric: Fabric) -> None:
    gateway = start_gateway(fabric.procs, fabric.broker, "--max-connections", "2")
    with _connection(gateway), _connection(gateway):  # two idle connections hold the cap

        def third_refused() -> bool:
            with _connection(gateway) as third:
                third.sendall(
                    b"GET /v2/health/live HTTP/1.1\r\nHost: gateway\r\nConnection: close\r\n\r\n"
                )
                return _read_all(third).startswith(b"HTTP/1.1 503")

        wait_until(third_refused, timeout=PATIENCE_S)

    # the two let go: the gateway serves again
    def served() -> bool:
        try:
            _infer_ok(fabric, gateway)
        except (InferenceServerException, OSError):
            return False
        return True

    wait_until(served, timeout=PATIENCE_S)


def _post(gateway: GatewayProc, body: Any, *, chunked: bool = False) -> tuple[int, str]:
    host, port = gateway.host_port.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=PATIENCE_S)
    try:
        if chunked:
            connection.request("POST", "/v2/models/mlp/infer", body, encode_chunked=True)
        else:
            connection.request("POST", "/v2/models/mlp/infer", body)
        response = connection.getresponse()
        return response.status, json.loads(response.read())["error"]
    finally:
        connection.close()


def _zeros(samples: int) -> httpclient.InferInput:
    tensor = httpclient.InferInput("input", [samples, 64], "FP32")
    tensor.set_data_from_numpy(np.zeros((samples, 64), np.float32))
    return tensor


def test_a_body_over_the_limit_is_413_naming_the_limit(fabric: Fabric) -> None:
    gateway = start_gateway(fabric.procs, fabric.broker, "--max-body-bytes", "2000")
    with httpclient.InferenceServerClient(gateway.host_port, network_timeout=PATIENCE_S) as client:
        tensor = httpclient.InferInput("input", [16, 64], "FP32")  # 4096 bytes of binary data
        tensor.set_data_from_numpy(mlp_input(16))
        with pytest.raises(InferenceServerException) as caught:
            client.infer("mlp", [tensor])
        assert caught.value.status() == "413"
        assert "over the gateway's limit of 2000 bytes" in caught.value.message()
        # without a Content-Length (chunked), the limit holds as the body arrives
        status, message = _post(
            gateway, iter([b"{" + b" " * 1500, b" " * 1500 + b"}"]), chunked=True
        )
        assert status == 413 and "limit of 2000 bytes" in message
        # compressed, the limit holds for the body as decompressed (no zip bombs)
        with pytest.raises(InferenceServerException) as caught:
            client.infer(
                "mlp", [_zeros(16)], request_compression_algorithm="gzip"
            )  # 4 KiB of zeros: a few dozen bytes gzipped
        assert caught.value.status() == "413"
        # a huge declared length is refused from the headers, and the connection closed
        with _connection(gateway) as greedy:
            greedy.sendall(
                b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: gateway\r\n"
                b"Content-Length: 10000000000\r\n\r\n{"
            )
            answer = _read_all(greedy)
        assert answer.startswith(b"HTTP/1.1 413"), answer
        _infer_ok(fabric, gateway)  # and a request under the limit is served
