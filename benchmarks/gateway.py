"""The front door against the fabric's own clients, in one run.

    python benchmarks/gateway.py --runs 3 --json gateway.json

Starts a broker, a worker serving the example ``mlp`` (its device time scaled so a
batch of 16 takes ``--mlp-device-ms``, 2 ms by default), a worker serving ``noop``
with no device time, and an ``ipuserve gateway`` (HTTP and gRPC) on loopback. Then,
in each run, one-sample requests in a closed loop at each ``--in-flight`` level
through each path, the paths in a new order every run:

* ``client``: :class:`ipuserve.client.Client` (``infer_async``, callbacks re-submit);
* ``async``: :class:`ipuserve.client.AsyncClient` (one task per request in flight);
* ``http``: Triton's ``tritonclient.http.aio`` with binary tensor data, through the gateway;
* ``grpc``: Triton's ``tritonclient.grpc.aio`` (raw contents), through the gateway;
* ``raw``: one pre-built binary HTTP/1.1 infer request written again and again on
  ``level`` keep-alive connections (asyncio streams), through the gateway: what the
  gateway costs with a client that costs almost nothing, to tell the gateway's share
  of the ``http`` path from ``tritonclient``'s.

``noop`` runs at 1 and 64 in flight only: it measures the front door alone. Prints
per model, level and path the medians over runs of throughput (and for ``mlp``, the
share of the ideal: one replica x batch / device time), p50 and p99 latency, and,
for the gateway's paths, the gateway's CPU per request. Every path also gets each
process's CPU per request (load generator, gateway, broker, workers) and their sum:
with the machine's cores that bounds the throughput any path can reach here
(``cores x 1e6 / total us``), and the same bound without the gateway's share says
whether a target is this machine's limit or the gateway's. The issue's targets
(issue 20): at 64 in flight on the MLP, HTTP and gRPC >= 0.9 of Client's
throughput; at 1 in flight on noop, the gateway adds <= 200 us to Client's p50;
AsyncClient within 10 % of Client at every level. Every figure comes from this
one machine and run: compare paths, not machines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ipuserve.bench.processes import (
    PYTHON,
    ChildProcesses,
    endpoint,
    free_port,
    process_cpu_seconds,
    wait_for_models,
)
from ipuserve.client import AsyncClient, Client
from ipuserve.protocol import ModelSpec
from ipuserve.runtime.simulator.cost import time_scale_for

PATHS = ("client", "async", "http", "grpc", "raw")
GATEWAY_PATHS = ("http", "grpc", "raw")


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


def start(procs: ChildProcesses, work: Path, args: Any) -> tuple[str, str, str, float]:
    """Broker, workers and gateway; the frontend, HTTP and gRPC addresses, and the
    MLP's ideal samples/s."""
    mlp, noop = work / "mlp.popef", work / "noop.popef"
    model = [*PYTHON, "ipuserve", "model"]
    subprocess.run([*model, "example", "mlp", str(mlp)], check=True, capture_output=True)
    subprocess.run([*model, "example", "noop", str(noop)], check=True, capture_output=True)
    inspected = json.loads(
        subprocess.run(
            [*model, "inspect", "--json", str(mlp)], check=True, capture_output=True, text=True
        ).stdout
    )
    [main] = [p for p in inspected["programs"] if p["phase"] == "main"]
    scale = time_scale_for(args.mlp_device_ms / 1e3, float(main["estimated_seconds"]))
    ideal = int(inspected["batch_size"]) / (args.mlp_device_ms / 1e3)
    front, back = endpoint(), endpoint()
    procs.start("broker", [*PYTHON, "ipuserve", "broker", "--frontend", front, "--backend", back])
    worker = [*PYTHON, "ipuserve", "worker", "--broker", back]
    procs.start(
        "worker-mlp",
        [*worker, "--model", str(mlp)],
        env={"IPUSERVE_SIM_TIME_SCALE": f"{scale:.6g}"},
    )
    procs.start(
        "worker-noop", [*worker, "--model", str(noop)], env={"IPUSERVE_SIM_TIME_SCALE": "0"}
    )
    wait_for_models(procs, front, {"mlp": 1, "noop": 1})
    http, grpc = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    procs.start(
        "gateway",
        [*PYTHON, "ipuserve", "gateway", "--broker", front, "--http", http, "--grpc", grpc]
        + (["--processes", str(args.gateway_processes)] if args.gateway_processes > 1 else []),
    )
    wait_ready(procs, http)
    return front, http, grpc, ideal


def wait_ready(procs: ChildProcesses, http: str, timeout_s: float = 60.0) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        procs.check()
        try:
            with urllib.request.urlopen(f"http://{http}/v2/health/ready", timeout=2) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)  # polling a process's start-up, not synchronising a test
    raise RuntimeError(f"the gateway at {http} was not ready within {timeout_s} s")


def tree_cpu_seconds(pids: list[int]) -> float:
    """CPU of these processes and every process under them (a supervisor's children).
    Not for this process: everything the bench starts is under it."""
    total, seen, todo = 0.0, set(), list(pids)
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += process_cpu_seconds(pid) or 0.0
        for task in Path(f"/proc/{pid}/task").glob("*/children"):
            try:
                todo.extend(int(child) for child in task.read_text().split())
            except OSError:
                pass
    return total


def measure(
    path: str,
    addresses: tuple[str, str, str],
    client: Client,
    model: str,
    inputs: dict[str, Any],
    expected: dict[str, Any],
    level: int,
    roles: dict[str, list[int]],
    args: Any,
) -> dict[str, float]:
    """One path at one level; with each role's CPU per request (``roles``: pids)."""
    front, http, grpc = addresses

    def cpu(role: str) -> float:
        if role == "loadgen":  # this process alone, its threads included
            return process_cpu_seconds(os.getpid()) or 0.0
        return tree_cpu_seconds(roles[role])

    cpu_before = {role: cpu(role) for role in roles}
    if path == "client":
        window = drive_client(client, model, inputs, level, args)
    elif path == "async":
        window = asyncio.run(drive_async(front, model, inputs, level, args))
    elif path == "http":
        window = asyncio.run(drive_http(http, model, inputs, list(expected), level, args))
    elif path == "raw":
        window = asyncio.run(drive_raw(http, model, inputs, expected, level, args))
    else:
        window = asyncio.run(drive_grpc(grpc, model, inputs, level, args))
    figures = window.figures()
    # each role's CPU over the whole drive (warm-up and drain too), scaled to the
    # window's share of it, over the requests answered in the window
    answered = max(figures["req_per_s"] * args.seconds, 1.0)
    share = args.seconds / (args.seconds + args.warmup_s)
    total = 0.0
    for role in roles:
        if role == "gateway" and path not in GATEWAY_PATHS:
            continue  # idle while the fabric's own clients run
        cpu_us = (cpu(role) - cpu_before[role]) * share / answered * 1e6
        figures[f"{role}_cpu_us_per_req"] = round(cpu_us, 1)
        total += cpu_us
    figures["total_cpu_us_per_req"] = round(total, 1)
    return figures


def cases(args: Any) -> list[tuple[str, int]]:
    mlp = [("mlp", level) for level in args.in_flight]
    return [*mlp, ("noop", 1), ("noop", 64)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--in-flight", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64]
    )
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--warmup-s", type=float, default=1.0)
    parser.add_argument("--mlp-device-ms", type=float, default=2.0)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument(
        "--gateway-processes",
        type=int,
        default=1,
        help="the gateway's --processes (several processes on the doors' ports)",
    )
    parser.add_argument(
        "--paths", type=lambda s: tuple(s.split(",")), default=PATHS, help="of " + ",".join(PATHS)
    )
    args = parser.parse_args()

    runs: list[dict[str, dict[str, float]]] = []
    with (
        tempfile.TemporaryDirectory(prefix="ipuserve-gateway-bench-") as tmp,
        ChildProcesses(Path(tmp)) as procs,
    ):
        front, http, grpc, ideal = start(procs, Path(tmp), args)
        pids = {c.name: c.popen.pid for c in procs.children}
        roles = {
            "loadgen": [],  # this process: see measure
            "gateway": [pids["gateway"]],
            "broker": [pids["broker"]],
            "workers": [pids["worker-mlp"], pids["worker-noop"]],
        }
        with Client(front, timeout=30.0) as client:
            specs = {m.spec.name: m.spec for m in client.models()}
            inputs = {name: one_sample(spec) for name, spec in specs.items()}
            expected = {name: dict(client.infer(name, inputs[name])) for name in specs}
            for run in range(args.runs):
                paths = args.paths
                order = paths[run % len(paths) :] + paths[: run % len(paths)]
                figures: dict[str, dict[str, float]] = {}
                for model, level in cases(args):
                    for path in order:
                        key = f"{model}/{level}/{path}"
                        figures[key] = measure(
                            path,
                            (front, http, grpc),
                            client,
                            model,
                            inputs[model],
                            expected[model],
                            level,
                            roles,
                            args,
                        )
                        procs.check()
                        print(f"run {run + 1} {key}: {figures[key]}", file=sys.stderr)
                runs.append(figures)
    median = {
        key: {
            name: round(statistics.median(r[key][name] for r in runs), 1) for name in runs[0][key]
        }
        for key in runs[0]
    }
    result: dict[str, Any] = {
        "cores": os.cpu_count(),
        "mlp_device_ms": args.mlp_device_ms,
        "mlp_ideal_samples_per_s": ideal,
        "gateway_processes": args.gateway_processes,
        "runs": runs,
        "median": median,
    }
    print(report(median, ideal, args))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


ROLES = ("loadgen", "gateway", "broker", "workers")


def report(median: dict[str, dict[str, float]], ideal: float, args: Any) -> str:
    cores = os.cpu_count() or 1
    lines = [
        f"{cores} cores; medians of {args.runs} runs of {args.seconds:g} s; "
        f"mlp ideal {ideal:,.0f} samples/s ({args.mlp_device_ms:g} ms per batch); "
        f"gateway processes {args.gateway_processes}",
        f"{'model':6} {'in flight':>9} {'path':7} {'req/s':>9} {'% ideal':>8} {'vs Client':>9}"
        f" {'p50 us':>9} {'p99 us':>9} {'errors':>6} | CPU us/req: {'loadgen':>7} {'gateway':>7}"
        f" {'broker':>6} {'workers':>7} {'total':>6} | {cores}-core bound req/s:"
        f" {'all':>7} {'w/o gw':>7}",
    ]
    for key, figures in median.items():
        model, level, path = key.split("/")
        base = median.get(f"{model}/{level}/client")
        ratio = None if base is None else figures["req_per_s"] / max(base["req_per_s"], 1e-9)
        versus = "" if ratio is None else f"{ratio:.2f}"
        share = f"{figures['req_per_s'] / ideal:8.0%}" if model == "mlp" else f"{'':8}"
        cpu = {role: figures.get(f"{role}_cpu_us_per_req") for role in ROLES}
        total = figures.get("total_cpu_us_per_req", 0.0)
        bound = cores * 1e6 / max(total, 1e-9)
        bound_without = cores * 1e6 / max(total - (cpu["gateway"] or 0.0), 1e-9)
        cells = " ".join(
            f"{'' if cpu[role] is None else f'{cpu[role]:,.0f}':>{width}}"
            for role, width in zip(ROLES, (7, 7, 6, 7), strict=True)
        )
        lines.append(
            f"{model:6} {level:>9} {path:7} {figures['req_per_s']:>9,.0f} {share}"
            f" {versus:>9}"
            f" {figures['p50_us']:>9,.0f} {figures['p99_us']:>9,.0f} {figures['errors']:>6.0f}"
            f" |             {cells} {total:>6,.0f} |"
            f" {' ' * 19}{bound:>7,.0f} {bound_without:>7,.0f}"
        )
    noop_client = median.get("noop/1/client")
    for path in GATEWAY_PATHS:
        through = median.get(f"noop/1/{path}")
        if noop_client and through:
            added = through["p50_us"] - noop_client["p50_us"]
            lines.append(
                f"noop at 1 in flight: the {path} path through the gateway adds {added:,.0f} us"
                " to Client's p50 (target <= 200)"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
