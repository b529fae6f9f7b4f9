"""The paths ``benchmarks/gateway.py`` drives: closed loops of one-sample requests
through ``Client``, ``AsyncClient``, ``tritonclient``'s HTTP and gRPC asyncio clients
through the gateway, and a raw HTTP/1.1 client that costs almost nothing (one
pre-built binary request written again and again on keep-alive connections). Each
returns a :class:`Window` of the latencies that ended inside the measurement window.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ipuserve.client import AsyncClient, Client
from ipuserve.protocol import ModelSpec


@dataclass
class Window:
    """Latencies of the requests that finished inside the measurement window."""

    start: float
    end: float
    latencies_us: list[float] = field(default_factory=list)
    errors: int = 0

    def record(self, sent: float, done: float, ok: bool) -> None:
        if self.start <= done <= self.end:
            if ok:
                self.latencies_us.append((done - sent) * 1e6)
            else:
                self.errors += 1

    def figures(self) -> dict[str, float]:
        values = np.asarray(self.latencies_us)
        seconds = self.end - self.start
        return {
            "req_per_s": round(values.size / seconds, 1),
            "p50_us": round(float(np.percentile(values, 50)), 1) if values.size else 0.0,
            "p99_us": round(float(np.percentile(values, 99)), 1) if values.size else 0.0,
            "errors": self.errors,
        }


def one_sample(spec: ModelSpec) -> dict[str, np.ndarray[Any, Any]]:
    """One sample of every input: the batching dimension (or the first) is 1."""
    rng = np.random.default_rng(0)
    inputs = {}
    for tensor in spec.inputs:
        shape = list(tensor.shape)
        shape[spec.batching_dim if spec.batching_dim is not None else 0] = 1
        inputs[tensor.name] = rng.random(shape).astype(tensor.dtype)
    return inputs


def drive_client(
    client: Client, model: str, inputs: dict[str, Any], level: int, args: Any
) -> Window:
    """A closed loop of ``level`` requests in flight through the sync Client's futures."""
    now = time.perf_counter()
    window = Window(now + args.warmup_s, now + args.warmup_s + args.seconds)
    stop_at = window.end
    done = threading.Event()
    live = [level]
    lock = threading.Lock()

    def send() -> None:
        sent = time.perf_counter()
        future = client.infer_async(model, inputs, copy=False)
        future.add_done_callback(lambda f: finished(sent, f.exception() is None))

    def finished(sent: float, ok: bool) -> None:
        now = time.perf_counter()
        window.record(sent, now, ok)
        if now < stop_at:
            send()
            return
        with lock:
            live[0] -= 1
            if live[0] == 0:
                done.set()

    for _ in range(level):
        send()
    done.wait(args.seconds + args.warmup_s + 60)
    return window


async def closed_loop(call: Callable[[], Awaitable[Any]], level: int, args: Any) -> Window:
    """``level`` asyncio tasks, each sending its next request when its last is answered."""
    return await closed_loop_each([call] * level, args)


async def closed_loop_each(calls: list[Callable[[], Awaitable[Any]]], args: Any) -> Window:
    """As :func:`closed_loop`, with a call of its own per task (one per connection)."""
    now = time.perf_counter()
    window = Window(now + args.warmup_s, now + args.warmup_s + args.seconds)

    async def worker(call: Callable[[], Awaitable[Any]]) -> None:
        while time.perf_counter() < window.end:
            sent = time.perf_counter()
            try:
                await call()
            except Exception:
                window.record(sent, time.perf_counter(), False)
            else:
                window.record(sent, time.perf_counter(), True)

    await asyncio.gather(*(worker(call) for call in calls))
    return window


async def drive_async(
    frontend: str, model: str, inputs: dict[str, Any], level: int, args: Any
) -> Window:
    async with AsyncClient(frontend, timeout=30.0) as client:
        await client.infer(model, inputs)
        return await closed_loop(lambda: client.infer(model, inputs, copy=False), level, args)


async def drive_http(
    url: str, model: str, inputs: dict[str, Any], outputs: list[str], level: int, args: Any
) -> Window:
    """Binary tensor data both ways: inputs, and ``outputs`` asked for binary (without
    ``outputs`` tritonclient asks for none, and the gateway answers in JSON)."""
    import tritonclient.http as http
    import tritonclient.http.aio as http_aio

    client = http_aio.InferenceServerClient(url=url, conn_limit=max(level, 1))
    try:

        def request() -> list[Any]:
            tensors = []
            for name, array in inputs.items():
                tensor = http.InferInput(name, list(array.shape), _datatype(array))
                tensor.set_data_from_numpy(array, binary_data=True)
                tensors.append(tensor)
            return tensors

        def wanted() -> list[Any]:
            return [http.InferRequestedOutput(name, binary_data=True) for name in outputs]

        async def call() -> Any:
            return await client.infer(model, request(), outputs=wanted())

        await call()
        return await closed_loop(call, level, args)
    finally:
        await client.close()


async def drive_grpc(url: str, model: str, inputs: dict[str, Any], level: int, args: Any) -> Window:
    """One channel, or with several gateway processes two channels a process (each its
    own connection: grpcio shares one per target unless told not to), tasks spread over
    them: the kernel spreads connections, not calls, over the processes."""
    import tritonclient.grpc as grpc
    import tritonclient.grpc.aio as grpc_aio

    channels = 1 if args.gateway_processes == 1 else min(level, 2 * args.gateway_processes)
    own = [("grpc.use_local_subchannel_pool", 1)] if channels > 1 else None
    clients = [grpc_aio.InferenceServerClient(url=url, channel_args=own) for _ in range(channels)]
    try:

        def request() -> list[Any]:
            tensors = []
            for name, array in inputs.items():
                tensor = grpc.InferInput(name, list(array.shape), _datatype(array))
                tensor.set_data_from_numpy(array)
                tensors.append(tensor)
            return tensors

        def caller(client: Any) -> Callable[[], Awaitable[Any]]:
            async def call() -> Any:
                return await client.infer(model, request())

            return call

        calls = [caller(clients[task % channels]) for task in range(level)]
        for call in calls[:channels]:
            await call()
        return await closed_loop_each(calls, args)
    finally:
        for client in clients:
            await client.close()


def raw_request(http: str, model: str, inputs: dict[str, Any]) -> bytes:
    """One binary-extension infer request, every byte of it, built once."""
    from tritonclient.utils import np_to_triton_dtype

    header = json.dumps(
        {
            "inputs": [
                {
                    "name": name,
                    "datatype": np_to_triton_dtype(array.dtype),
                    "shape": list(array.shape),
                    "parameters": {"binary_data_size": array.nbytes},
                }
                for name, array in inputs.items()
            ],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    body = header + b"".join(np.ascontiguousarray(a).tobytes() for a in inputs.values())
    return (
        f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: {http}\r\n"
        f"Content-Type: application/octet-stream\r\n"
        f"Inference-Header-Content-Length: {len(header)}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        if line:
            key, _, value = line.partition(":")
            headers[key.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return int(status_line.split()[1]), headers, body


def raw_outputs(headers: dict[str, str], body: bytes) -> dict[str, np.ndarray[Any, Any]]:
    """A binary-extension response's outputs (to check the first against the Client's)."""
    from tritonclient.utils import triton_to_np_dtype

    length = int(headers["inference-header-content-length"])
    offset, outputs = length, {}
    for item in json.loads(body[:length])["outputs"]:
        size = item["parameters"]["binary_data_size"]
        dtype = triton_to_np_dtype(item["datatype"])
        outputs[item["name"]] = np.frombuffer(body[offset : offset + size], dtype).reshape(
            item["shape"]
        )
        offset += size
    return outputs


async def drive_raw(
    http: str,
    model: str,
    inputs: dict[str, Any],
    expected: dict[str, Any],
    level: int,
    args: Any,
) -> Window:
    """``level`` keep-alive connections, each writing the same request bytes in a loop."""
    host, port = http.rsplit(":", 1)
    request = raw_request(http, model, inputs)
    streams = [await asyncio.open_connection(host, int(port)) for _ in range(level)]
    try:
        reader, writer = streams[0]
        writer.write(request)
        status, headers, body = await read_response(reader)
        got = raw_outputs(headers, body) if status == 200 else {}
        if status != 200 or any(
            not np.allclose(got[name], value, rtol=1e-5) for name, value in expected.items()
        ):
            raise RuntimeError(f"the raw path's answer is wrong: {status} {body[:200]!r}")

        def caller(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Any:
            async def call() -> None:
                writer.write(request)
                status, _, body = await read_response(reader)
                if status != 200:
                    raise RuntimeError(f"{status}: {body[:200]!r}")

            return call

        calls = [caller(r, w) for r, w in streams]
        return await closed_loop_each(calls, args)
    finally:
        for _, writer in streams:
            writer.close()


def _datatype(array: np.ndarray[Any, Any]) -> str:
    from tritonclient.utils import np_to_triton_dtype

    return str(np_to_triton_dtype(array.dtype))
