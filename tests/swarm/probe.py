"""A client inside the swarm: run by the swarm tests in a container on the stack's overlay.

Swarm's routing mesh needs IPVS, which the CI machines lack, and two broker tasks on
one node cannot publish the same host port; so the tests reach the brokers from a
``docker run --network STACK_fabric`` container of the project image, which runs this
file (``python -c SOURCE MODE ...``: no bind mount, so a remote engine works too). It
uses only ipuserve's public client API. Results go back to the host, which checks
them against its own numpy reference: requests are made from ``(seed, index)``, so
the host makes the same inputs.

Modes (one JSON document on the last line of stdout):

* ``infer ENDPOINT COUNT SEED``: COUNT one-sample requests through ENDPOINT, with
  the one-broker client (``Client(ENDPOINT)``).
* ``infer-all ENDPOINT COUNT SEED``: the same with the client of every broker behind
  ENDPOINT's name (``Client([ENDPOINT])``).
* ``load ENDPOINT SEED WINDOW MAX_S``: one-sample requests through every broker
  behind ENDPOINT, WINDOW outstanding at a time, until SIGUSR1 (or MAX_S): then no
  new ones, the outstanding ones awaited.
  Prints ``progress N`` as results come in, so the host can act under load.
* ``gateway URL COUNT SEED``: COUNT one-sample requests through the gateway at URL
  (``http://gateway:8000``) in the Open Inference Protocol's JSON, the model's
  inputs read from its metadata there (``GET /v2/models/mlp``): no ipuserve client.

Keys come in the environment (IPUSERVE_PROBE_CLIENT_SECRET, IPUSERVE_PROBE_BROKER_PUBLIC:
the files' contents), written to files here, as the CLI and the client read files.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
import types
import urllib.request
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np

from ipuserve.client import Client

MODEL = "mlp"
REQUEST_TIMEOUT_S = 60.0
PROGRESS_EVERY = 50


def key_files() -> dict[str, Path]:
    """The client's CURVE key files, written from the environment."""
    folder = Path(tempfile.mkdtemp(prefix="probe-keys-"))
    files = {}
    for argument, variable in (
        ("curve_secret_key", "IPUSERVE_PROBE_CLIENT_SECRET"),
        ("broker_public_key", "IPUSERVE_PROBE_BROKER_PUBLIC"),
    ):
        path = folder / variable.lower()
        path.write_text(os.environ[variable])
        path.chmod(0o600)
        files[argument] = path
    return files


def make_inputs(spec: Any, seed: int, index: int) -> dict[str, np.ndarray]:
    """Request ``index``: one sample of each input, from ``(seed, index)`` (the host
    tests make the same with tests/swarm/harness.py's ``probe_inputs``)."""
    rng = np.random.default_rng([seed, index])
    inputs = {}
    for tensor in spec.inputs:
        shape = list(tensor.shape)
        if spec.batching_dim is not None:
            shape[spec.batching_dim] = 1
        inputs[tensor.name] = rng.standard_normal(shape).astype(tensor.dtype)
    return inputs


def pack(outputs: dict[int, dict[str, np.ndarray]]) -> str:
    """Every request's outputs as one base64 .npz: ``index`` (the request indices) and,
    per output NAME, the requests' arrays stacked in that order."""
    indices = sorted(outputs)
    arrays: dict[str, np.ndarray] = {"index": np.array(indices, dtype=np.int64)}
    for name in outputs[indices[0]] if indices else ():
        arrays[name] = np.stack([outputs[i][name] for i in indices])
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)  # type: ignore[arg-type]
    return base64.b64encode(buffer.getvalue()).decode()


def describe(spec: Any) -> dict[str, Any]:
    """What the host needs to make the same inputs (harness.py's ``probe_inputs``)."""
    return {
        "inputs": [
            {"name": i.name, "shape": list(i.shape), "dtype": str(np.dtype(i.dtype))}
            for i in spec.inputs
        ],
        "batching_dim": spec.batching_dim,
    }


def spec_of(client: Client) -> Any:
    for info in client.models(timeout=10):
        if info.spec.name == MODEL:
            return info.spec
    raise SystemExit(f"{MODEL} is not served")


def connect(endpoint: str, several: bool) -> tuple[Client, str]:
    """A client of ``endpoint``; with ``several``, of every broker behind its name.

    ``Client([endpoint])`` (a list) is the client of several brokers: it resolves the
    name to every address, spreads over them, fails over and follows the name. A
    plain string is the one-broker client, as ever. An ipuserve without the former
    takes the latter; the report says which ran ("several" or "one"), so the test
    can insist on "several" where it deploys several brokers.
    """
    if several:
        try:
            return Client([endpoint], timeout=REQUEST_TIMEOUT_S, **key_files()), "several"
        except (TypeError, ValueError, AttributeError) as exc:
            print(f"no client of several brokers here ({exc!r}): one broker", flush=True)
    return Client(endpoint, timeout=REQUEST_TIMEOUT_S, **key_files()), "one"


def infer(endpoint: str, count: int, seed: int, several: bool) -> dict[str, Any]:
    connected, kind = connect(endpoint, several)
    with connected as client:
        spec = spec_of(client)
        futures = [client.infer_async(MODEL, make_inputs(spec, seed, i)) for i in range(count)]
        outputs = {i: f.result(timeout=REQUEST_TIMEOUT_S + 10) for i, f in enumerate(futures)}
    report = {"endpoint": endpoint, "client": kind, "seed": seed, "sent": count}
    report["spec"] = describe(spec)
    return {**report, "outputs": pack(outputs)}


class Load:
    """Closed-loop load: ``window`` requests outstanding until told to stop."""

    def __init__(self, client: Client, spec: Any, seed: int, window: int) -> None:
        self.client, self.spec, self.seed = client, spec, seed
        self.slots = threading.Semaphore(window)
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.outputs: dict[int, dict[str, np.ndarray]] = {}
        self.errors: list[str] = []
        self.duplicates = 0
        self.sent = 0
        self.last = time.monotonic()
        self.max_gap = 0.0

    def done(self, index: int, future: Future[Any]) -> None:
        now = time.monotonic()
        with self.lock:
            self.max_gap = max(self.max_gap, now - self.last)
            self.last = now
            if index in self.outputs or any(e.startswith(f"{index}:") for e in self.errors):
                self.duplicates += 1
            elif future.exception() is not None:
                self.errors.append(f"{index}: {future.exception()!r}")
            else:
                self.outputs[index] = future.result()
            answered = len(self.outputs) + len(self.errors)
        self.slots.release()
        if answered % PROGRESS_EVERY == 0:
            print(f"progress {answered}", flush=True)

    def run(self, max_s: float) -> None:
        deadline = time.monotonic() + max_s
        while not self.stop.is_set() and time.monotonic() < deadline:
            if not self.slots.acquire(timeout=0.1):
                continue
            index = self.sent
            future = self.client.infer_async(MODEL, make_inputs(self.spec, self.seed, index))
            self.sent += 1
            future.add_done_callback(lambda f, i=index: self.done(i, f))
        wait_until = time.monotonic() + REQUEST_TIMEOUT_S + 10
        while time.monotonic() < wait_until:
            with self.lock:
                if len(self.outputs) + len(self.errors) >= self.sent:
                    return
            time.sleep(0.05)


class Warnings(logging.Handler):
    """Counts the client's warnings (failovers, re-sends): reported, for the log."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def load(endpoint: str, seed: int, window: int, max_s: float) -> dict[str, Any]:
    warnings = Warnings()
    logging.getLogger("ipuserve").addHandler(warnings)
    connected, kind = connect(endpoint, several=True)
    with connected as client:
        spec = spec_of(client)
        runner = Load(client, spec, seed, window)
        signal.signal(signal.SIGUSR1, lambda *_: runner.stop.set())
        print("progress 0", flush=True)
        runner.run(max_s)
    return {
        "endpoint": endpoint,
        "client": kind,
        "seed": seed,
        "spec": describe(spec),
        "sent": runner.sent,
        "answered": len(runner.outputs),
        "errors": runner.errors[:10],
        "error_count": len(runner.errors),
        "duplicates": runner.duplicates,
        "max_gap_s": round(runner.max_gap, 3),
        "client_warnings": warnings.messages[-10:],
        "outputs": pack(runner.outputs),
    }


#: the Open Inference Protocol's datatypes of the models' tensors
DATATYPES = {"FP32": np.float32, "FP16": np.float16, "FP64": np.float64, "INT32": np.int32}


def http_json(url: str, body: Any = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
        return json.loads(response.read())


def gateway_spec(url: str) -> Any:
    """The model's inputs as the gateway describes them (-1: the batching dimension)."""
    metadata = http_json(f"{url}/v2/models/{MODEL}")
    inputs = [
        types.SimpleNamespace(
            name=i["name"], shape=[max(d, 1) for d in i["shape"]], dtype=DATATYPES[i["datatype"]]
        )
        for i in metadata["inputs"]
    ]
    dims = [i["shape"].index(-1) for i in metadata["inputs"] if -1 in i["shape"]]
    return types.SimpleNamespace(inputs=inputs, batching_dim=dims[0] if dims else None)


def gateway(url: str, count: int, seed: int) -> dict[str, Any]:
    spec = gateway_spec(url)
    outputs = {}
    for index in range(count):
        inputs = make_inputs(spec, seed, index)
        body = {
            "id": str(index),
            "inputs": [
                {"name": n, "datatype": "FP32", "shape": list(a.shape), "data": a.ravel().tolist()}
                for n, a in inputs.items()
            ],
        }
        answer = http_json(f"{url}/v2/models/{MODEL}/infer", body)
        if answer.get("id") != str(index):
            raise SystemExit(f"request {index} answered as {answer.get('id')!r}")
        outputs[index] = {
            o["name"]: np.array(o["data"], DATATYPES[o["datatype"]]).reshape(o["shape"])
            for o in answer["outputs"]
        }
    report = {"endpoint": url, "client": "http", "seed": seed, "sent": count}
    return {**report, "spec": describe(spec), "outputs": pack(outputs)}


def main(argv: list[str]) -> None:
    mode, endpoint, *rest = argv
    if mode in ("infer", "infer-all"):
        report = infer(endpoint, int(rest[0]), int(rest[1]), several=mode == "infer-all")
    elif mode == "gateway":
        report = gateway(endpoint, int(rest[0]), int(rest[1]))
    elif mode == "load":
        report = load(endpoint, int(rest[0]), int(rest[1]), float(rest[2]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
