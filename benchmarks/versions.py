"""Models at run time: how long a load and an unload take, and what a switch of versions
costs the requests running through it.

    python benchmarks/versions.py --runs 3 --json versions.json

Starts a broker and two repository workers (``ipuserve worker --repository``, 4 IPUs
each, each its own simulated machine) on loopback over a repository holding the
example ``mlp`` (default size) and ``simple`` as versions 1 and 2, then in each run:

* **load and unload**: for each model, ``load`` version 1 on one worker and time it
  from the command to the index saying READY (asked every millisecond), then
  ``unload`` it and time it to the index saying UNAVAILABLE (the worker reports a
  version gone once its IPUs are free);
* **switch**: eight client threads send one-sample ``mlp`` requests without pause;
  with v1 loaded on both workers, ``--steady-s`` seconds of steady state, then load v2
  on both and unload v1 (the switch), then ``--steady-s`` more; p50 and p99 of the
  requests sent during the switch against those sent in the steady windows, same run,
  and any request that failed.

Prints the medians over runs. No device machine needed: the IPUs are simulated.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from ipuserve.bench.processes import PYTHON, ChildProcesses, endpoint, free_port
from ipuserve.client import Client
from ipuserve.latency import latency_us

MODELS = ("mlp", "simple")
THREADS = 8


def write_repository(root: Path) -> None:
    for name in MODELS:
        for version in ("1", "2"):
            argv = [*PYTHON, "ipuserve", "model", "example", name, "--repository", str(root)]
            argv += ["--version", version, "--seed", version]
            subprocess.run(argv, check=True, capture_output=True)


def state(client: Client, name: str, version: str) -> str:
    for entry in client.repository_index():
        if entry.name == name and entry.version == version:
            return str(entry.state)
    return "ABSENT"


def timed(
    client: Client, name: str, version: str, want: str, start: float, timeout_s: float = 60.0
) -> float:
    """Seconds from ``start`` until ``name`` ``version`` is in state ``want`` (asked
    every millisecond)."""
    while state(client, name, version) != want:
        if time.perf_counter() - start > timeout_s:
            raise TimeoutError(f"{name} {version} not {want} after {timeout_s} s")
        time.sleep(0.001)
    return time.perf_counter() - start


def load_unload(client: Client, name: str) -> tuple[float, float]:
    start = time.perf_counter()
    client.load_model(name, "1", workers=1, wait=False)
    loaded = timed(client, name, "1", "READY", start)
    start = time.perf_counter()
    client.unload_model(name, "1", wait=False)
    return loaded, timed(client, name, "1", "UNAVAILABLE", start)


class Traffic:
    """Eight threads of one-sample requests; (send time, latency s, ok) of each."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.records: list[tuple[float, float, bool]] = []
        self.threads = [threading.Thread(target=self._loop, args=(n,)) for n in range(THREADS)]

    def __enter__(self) -> Traffic:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()

    def _loop(self, n: int) -> None:
        rng = np.random.default_rng(n)
        while not self.stop.is_set():
            inputs = {"input": rng.standard_normal((1, 784)).astype(np.float32)}
            sent = time.perf_counter()
            try:
                self.client.infer("mlp", inputs)
                ok = True
            except Exception:
                ok = False
            with self.lock:
                self.records.append((sent, time.perf_counter() - sent, ok))

    def window(self, start: float, end: float) -> dict[str, float]:
        with self.lock:
            inside = [(lat, ok) for sent, lat, ok in self.records if start <= sent < end]
        summary = latency_us([int(lat * 1e9) for lat, ok in inside if ok])
        return {
            "requests": len(inside),
            "failed": sum(1 for _, ok in inside if not ok),
            "p50_us": summary["p50"],
            "p99_us": summary["p99"],
        }


def switch(client: Client, steady_s: float) -> dict[str, dict[str, float]]:
    client.load_model("mlp", "1", workers=2)
    with Traffic(client) as traffic:
        time.sleep(steady_s)  # steady state: the window the benchmark measures
        began = time.perf_counter()
        client.load_model("mlp", "2", workers=2)
        client.unload_model("mlp", "1")
        ended = time.perf_counter()
        time.sleep(steady_s)
        after = time.perf_counter()
    client.unload_model("mlp", "2")
    steady = traffic.window(began - steady_s, began)
    later = traffic.window(ended, after)
    during = traffic.window(began, ended) | {"duration_ms": (ended - began) * 1e3}
    return {"steady_before": steady, "switch": during, "steady_after": later}


def one_run(frontend: str, steady_s: float) -> dict[str, Any]:
    with Client(frontend, timeout=60.0) as client:
        found: dict[str, Any] = {}
        for name in MODELS:
            load_s, unload_s = load_unload(client, name)
            found[name] = {"load_ms": load_s * 1e3, "unload_ms": unload_s * 1e3}
        found["switch"] = switch(client, steady_s)
        return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steady-s", type=float, default=3.0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        workdir = Path(work)
        write_repository(workdir / "repo")
        front, back, port = endpoint(), endpoint(), free_port()
        env = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        with ChildProcesses(workdir, env) as procs:
            argv = [*PYTHON, "ipuserve", "broker", "--frontend", front, "--backend", back]
            procs.start("broker", [*argv, "--metrics-port", str(port)])
            for n in (1, 2):
                argv = [*PYTHON, "ipuserve", "worker", "--broker", back, "--repository"]
                argv += [str(workdir / "repo"), "--ipus", "4", "--worker-id", f"host{n}"]
                machine = {"IPUSERVE_SIM_LOCK_DIR": str(workdir / f"ipus{n}")}
                procs.start(f"host{n}", argv, env=machine)
            deadline = time.monotonic() + 60
            while _hosts(port) < 2:
                procs.check()
                if time.monotonic() > deadline:
                    raise TimeoutError("the repository workers did not report to the broker")
                time.sleep(0.05)
            runs = []
            for n in range(args.runs):
                runs.append(one_run(front, args.steady_s))
                print(f"run {n + 1}: {json.dumps(runs[-1])}", file=sys.stderr)
    summary = summarise(runs)
    print(json.dumps(summary, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps({"runs": runs, "summary": summary}, indent=2))
    return 0


def _hosts(port: int) -> int:
    """The repository workers the broker has heard from (its ``ipuserve_broker_hosts``)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as page:
            text = page.read().decode()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith("ipuserve_broker_hosts"):
            return int(float(line.split()[-1]))
    return 0


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    med = statistics.median
    out: dict[str, Any] = {}
    for name in MODELS:
        out[name] = {
            key: {"median": med(r[name][key] for r in runs), "max": max(r[name][key] for r in runs)}
            for key in ("load_ms", "unload_ms")
        }
    out["switch"] = {
        phase: {
            key: med(r["switch"][phase][key] for r in runs)
            for key in ("requests", "failed", "p50_us", "p99_us", "duration_ms")
            if key in runs[0]["switch"][phase]
        }
        for phase in ("steady_before", "switch", "steady_after")
    }
    return out


if __name__ == "__main__":
    sys.exit(main())
