"""The fabric suite: ipuserve against a bare pyzmq relay, measured in the same run.

``ipuserve bench --suite fabric`` (or ``benchmarks/fabric.py``) starts, on
loopback, two relay/echo pairs (copying and zero-copy: each case gets the mode
that suits it, i.e. the relay at its best) and an ipuserve broker with workers on
example models written by ``ipuserve model example``:

=================  ==========================================  ================  ======
comparison         ipuserve                                    baseline          target
=================  ==========================================  ================  ======
latency p50, p99   ``noop`` (64 B), one request at a time       relay, 1 in flt   <= 1.5x
throughput         ``noop`` (64 B), 64 in flight: req/s         relay, 64 in flt  >= 70%
MLP saturation     ``mlp``, full batches, enough in flight:     ideal: workers x  >= 90%
                   samples/s, with simulated device time        replicas x batch
                                                                / device time
goodput            ``noop`` (4 MiB), 4 in flight: MB/s          relay, 4 in flt   >= 80%
=================  ==========================================  ================  ======

Each run measures every case on both sides back to back; the suite repeats the
runs and reports the median of each side and the median of the same-run ratios
(these 2-core machines vary from run to run far more than a ratio does). For the
small-request cases it also reads each process's CPU time (Linux /proc), so the
breakdown shows what a request costs the client, the broker and the worker beside
what it costs the relay's client, relay and echo. The
MLP's device time per batch is the model's cost estimate (``ipuserve model
inspect --json``) times ``IPUSERVE_SIM_TIME_SCALE``, which the suite chooses so a
batch takes ``mlp_device_ms``; the workers' own ``device_us`` is reported beside it.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from ipuserve.bench.bench import bench
from ipuserve.bench.loadgen import LoadConfig
from ipuserve.bench.processes import (
    PYTHON,
    ChildProcesses,
    endpoint,
    process_cpu_seconds,
    wait_for_models,
)
from ipuserve.bench.rawproto import protocol_closed_loop
from ipuserve.bench.relay import raw_closed_loop
from ipuserve.client.client import Client
from ipuserve.latency import latency_us

Log = Callable[[str], None]
SMALL_ELEMENTS = 16  # float32: 64-byte requests
LARGE_ELEMENTS = 1 << 20  # float32: 4 MiB requests
#: Several workers share two cores: a multi-threaded BLAS in each of them spins and
#: fights the others (and the broker) for the cores, which made MLP batches take
#: 10-100x their simulated time. One BLAS thread per process is how such hosts are run.
ONE_BLAS_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@dataclass(frozen=True, kw_only=True)
class SuiteConfig:
    runs: int = 3
    quick: bool = False
    in_flight: int = 64
    large_in_flight: int = 4
    mlp_workers: int = 2
    mlp_replicas: int = 1
    mlp_device_ms: float = 5.0
    #: full-batch MLP requests in flight per replica: enough to keep a device busy
    #: while results travel back and the next requests come in
    mlp_in_flight_per_replica: int = 8
    workdir: Path | None = None

    @property
    def seconds(self) -> float:
        """Length of one measured phase."""
        return 0.5 if self.quick else 4.0

    @property
    def warmup_s(self) -> float:
        return 0.2 if self.quick else 1.0


@dataclass(frozen=True)
class Endpoints:
    relay_small: str
    relay_large: str
    frontend: str
    backend: str


def run_suite(config: SuiteConfig, log: Log = lambda _line: None) -> dict[str, Any]:
    """Start everything, run ``config.runs`` runs, return the JSON-ready results."""
    with tempfile.TemporaryDirectory(prefix="ipuserve-bench-") as tmp:
        workdir = config.workdir or Path(tmp)
        models = write_models(workdir, config)
        scale = time_scale_for(config.mlp_device_ms / 1e3, models)
        env = {
            **ONE_BLAS_THREAD,
            "IPUSERVE_SIM_LOCK_DIR": str(workdir / "locks"),
            "IPUSERVE_SIM_IPUS": "16",
        }
        with ChildProcesses(workdir, env) as procs:
            ends = start_processes(procs, config, models, scale)
            meters = cpu_meters(procs)
            log(f"processes up (logs in {workdir}); {config.runs} run(s)")
            runs = [one_run(config, ends, meters, i, log) for i in range(config.runs)]
            procs.check()
    device_s = config.mlp_device_ms / 1e3  # what the scale makes the MLP take
    return results(config, runs, device_s, int(models["mlp_batch"]))


# ---------------------------------------------------------------- setting up


def time_scale_for(target_s: float, models: dict[str, Any]) -> float:
    """The IPUSERVE_SIM_TIME_SCALE that makes an MLP run take ``target_s``: only its
    steps scale, not its launch (runtime/simulator/cost.py's time_scale_for, from what
    ``ipuserve model inspect --json`` says, as bench may not import the runtime)."""
    launch = models["mlp_launch_seconds"]
    return float((target_s - launch) / (models["mlp_seconds"] - launch))


def write_models(workdir: Path, config: SuiteConfig) -> dict[str, Any]:
    """Write noop (small, large) and mlp model files; return paths and the MLP's cost."""
    paths = {name: workdir / f"{name}.popef" for name in ("noop_small", "noop_large", "mlp")}
    model = [*PYTHON, "ipuserve", "model"]
    for name, elements in (("noop_small", SMALL_ELEMENTS), ("noop_large", LARGE_ELEMENTS)):
        _run([*model, "example", "noop", str(paths[name]), "--elements", str(elements)])
    _run([*model, "example", "mlp", str(paths["mlp"])])
    inspected = json.loads(_run([*model, "inspect", "--json", str(paths["mlp"])]))
    [main] = [p for p in inspected["programs"] if p["phase"] == "main"]
    return {
        **paths,
        "mlp_seconds": float(main["estimated_seconds"]),
        "mlp_launch_seconds": float(main["launch_seconds"]),
        "mlp_batch": int(inspected["batch_size"]),
    }


def _run(argv: list[str]) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{done.stderr[-2000:]}")
    return done.stdout


def start_processes(
    procs: ChildProcesses, config: SuiteConfig, models: dict[str, Any], scale: float
) -> Endpoints:
    ends = Endpoints(endpoint(), endpoint(), endpoint(), endpoint())
    relay = [*PYTHON, "ipuserve.bench.relay"]
    for name, front, copy in (
        ("small", ends.relay_small, ["--copy"]),
        ("large", ends.relay_large, []),
    ):
        back = endpoint()
        procs.start(
            f"relay-{name}", [*relay, "relay", "--frontend", front, "--backend", back, *copy]
        )
        procs.start(f"echo-{name}", [*relay, "echo", "--backend", back, *copy])
    broker = [*PYTHON, "ipuserve", "broker", "--frontend", ends.frontend, "--backend", ends.backend]
    procs.start("broker", [*broker, "--queue-limit", "100000"])
    worker = [*PYTHON, "ipuserve", "worker", "--broker", ends.backend]
    procs.start("worker-noop", [*worker, "--model", str(models["noop_small"]), "--name", "noop"])
    echo = [*PYTHON, "ipuserve.worker.echo", "--broker", ends.backend]
    procs.start("worker-echo", [*echo, "--elements", str(SMALL_ELEMENTS)])
    procs.start(
        "worker-noop4m", [*worker, "--model", str(models["noop_large"]), "--name", "noop4m"]
    )
    for i in range(config.mlp_workers):
        procs.start(
            f"worker-mlp{i}",
            [
                *worker,
                "--model",
                str(models["mlp"]),
                "--name",
                "mlp",
                "--replicas",
                str(config.mlp_replicas),
            ],
            env={"IPUSERVE_SIM_TIME_SCALE": f"{scale:.6g}"},
        )
    expected = {"noop": 1, "noop4m": 1, "echo": 1, "mlp": config.mlp_workers}
    wait_for_models(procs, ends.frontend, expected)
    return ends


#: The processes each small-request stack runs through besides the client (this
#: process), by role: the relay pair is the baseline's broker and worker.
STACKS = {
    "relay": {"broker": "relay-small", "worker": "echo-small"},
    "echo": {"broker": "broker", "worker": "worker-echo"},
    "protocol": {"broker": "broker", "worker": "worker-noop"},
    "fabric": {"broker": "broker", "worker": "worker-noop"},
}
ROLES = ("client", "broker", "worker")


class CpuMeter:
    """CPU per request of each process a case runs through, every thread counted.

    CPU time over the whole case (warm-up included) divided by its wall time gives
    the cores each process kept busy; divided by the measured request rate, the CPU
    each request cost it. Where the time goes when latency or throughput falls short
    of the relay's: in which process, and how much more than the relay's.
    """

    def __init__(self, pids: dict[str, int]) -> None:
        self._pids = pids

    def measure(self, case: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        before, started = self._read(), time.monotonic()
        result = case()
        wall, after = time.monotonic() - started, self._read()
        rate = result["throughput"]["req_per_s"]
        if before is None or after is None or rate <= 0:
            return result  # no /proc here: the figures stand without it
        result["cpu_us_per_request"] = {
            role: round((after[role] - before[role]) / wall / rate * 1e6, 1) for role in ROLES
        }
        return result

    def _read(self) -> dict[str, float] | None:
        seconds = {role: process_cpu_seconds(pid) for role, pid in self._pids.items()}
        if any(value is None for value in seconds.values()):
            return None
        return {role: float(value or 0.0) for role, value in seconds.items()}


def cpu_meters(procs: ChildProcesses) -> dict[str, CpuMeter]:
    by_name = {child.name: child.popen.pid for child in procs.children}
    return {
        stack: CpuMeter({"client": os.getpid(), **{r: by_name[n] for r, n in roles.items()}})
        for stack, roles in STACKS.items()
    }


# ---------------------------------------------------------------- one run


def one_run(
    config: SuiteConfig, ends: Endpoints, meters: dict[str, CpuMeter], index: int, log: Log
) -> dict[str, Any]:
    """Every case on both sides, back to back; returns the raw figures of this run."""
    run: dict[str, Any] = {}
    seconds, warm = config.seconds, config.warmup_s
    with Client(ends.frontend, timeout=60) as client:
        small = 4 * SMALL_ELEMENTS
        for label, n in (("latency", 1), ("throughput", config.in_flight)):
            cases = (
                ("relay", partial(_relay, ends.relay_small, small, n, seconds)),
                ("fabric", partial(_fabric, client, "noop", n, seconds, warm)),
                ("protocol", partial(_protocol, ends.frontend, n, seconds)),
                ("echo", partial(_protocol, ends.frontend, n, seconds, "echo")),
            )
            for stack, case in cases:
                run[f"{stack}_{label}"] = meters[stack].measure(case)
            log(f"run {index + 1}: {label} done")
        run["relay_goodput"] = _relay(
            ends.relay_large, 4 * LARGE_ELEMENTS, config.large_in_flight, seconds
        )
        run["fabric_goodput"] = _fabric(client, "noop4m", config.large_in_flight, seconds, warm)
        log(f"run {index + 1}: goodput done")
        replicas = config.mlp_workers * config.mlp_replicas
        mlp_in_flight = config.mlp_in_flight_per_replica * replicas
        run["fabric_mlp"] = _fabric(client, "mlp", mlp_in_flight, seconds, warm)
        log(f"run {index + 1}: mlp done")
    return run


def _relay(address: str, payload: int, in_flight: int, seconds: float) -> dict[str, Any]:
    raw = raw_closed_loop(
        address,
        payload_bytes=payload,
        in_flight=in_flight,
        duration_s=seconds,
        warmup=max(20, 2 * in_flight),
    )
    per_s = raw.requests / max(raw.elapsed_s, 1e-9)
    return {
        "requests": raw.requests,
        "throughput": {
            "req_per_s": round(per_s, 1),
            "mb_per_s": round(per_s * 2 * payload / 1e6, 2),
        },
        "latency_us": latency_us(raw.latencies_ns),
    }


def _protocol(address: str, in_flight: int, seconds: float, model: str = "noop") -> dict[str, Any]:
    """The fabric through a bare protocol loop: the client's own cost, by difference (and,
    with the runtime-free ``echo`` worker, the runtime's)."""
    inputs = {"input": np.zeros((1, SMALL_ELEMENTS), np.float32)}
    raw = protocol_closed_loop(
        address,
        model,
        inputs,
        in_flight=in_flight,
        duration_s=seconds,
        warmup=max(20, 2 * in_flight),
    )
    return {
        "requests": raw.requests,
        "throughput": {"req_per_s": round(raw.requests / max(raw.elapsed_s, 1e-9), 1)},
        "latency_us": latency_us(raw.latencies_ns),
    }


def _fabric(
    client: Client, model: str, in_flight: int, seconds: float, warm: float
) -> dict[str, Any]:
    load = LoadConfig(warmup_s=warm, duration_s=seconds, in_flight=in_flight)
    return bench(client, model, load)


# ---------------------------------------------------------------- results


def _row(
    name: str, unit: str, pairs: list[tuple[float, float]], target: str, higher_is_better: bool
) -> dict[str, Any]:
    ratios = [ours / base if base else 0.0 for ours, base in pairs]
    ratio = statistics.median(ratios)
    bound = float(target.split()[-1])
    return {
        "name": name,
        "unit": unit,
        "ipuserve": round(statistics.median(p[0] for p in pairs), 1),
        "baseline": round(statistics.median(p[1] for p in pairs), 1),
        "ratio": round(ratio, 3),
        "target": target,
        "met": ratio >= bound if higher_is_better else ratio <= bound,
        "per_run": [
            {"ipuserve": o, "baseline": b, "ratio": round(r, 3)}
            for (o, b), r in zip(pairs, ratios, strict=True)
        ],
    }


def results(
    config: SuiteConfig, runs: list[dict[str, Any]], device_s: float, batch: int
) -> dict[str, Any]:
    def pairs(ours: str, base: str, *path: str) -> list[tuple[float, float]]:
        return [(_get(r[ours], path), _get(r[base], path)) for r in runs]

    ideal = config.mlp_workers * config.mlp_replicas * batch / device_s
    mlp = [(_get(r["fabric_mlp"], ("throughput", "samples_per_s")), ideal) for r in runs]
    comparisons = [
        _row(
            "latency p50",
            "us",
            pairs("fabric_latency", "relay_latency", "latency_us", "p50"),
            "<= 1.5",
            False,
        ),
        _row(
            "latency p99",
            "us",
            pairs("fabric_latency", "relay_latency", "latency_us", "p99"),
            "<= 1.5",
            False,
        ),
        _row(
            f"throughput, {config.in_flight} in flight",
            "req/s",
            pairs("fabric_throughput", "relay_throughput", "throughput", "req_per_s"),
            ">= 0.7",
            True,
        ),
        _row("MLP saturation vs ideal", "samples/s", mlp, ">= 0.9", True),
        _row(
            "goodput, 4 MiB tensors",
            "MB/s",
            pairs("fabric_goodput", "relay_goodput", "throughput", "mb_per_s"),
            ">= 0.8",
            True,
        ),
    ]
    diagnostics = [
        _row(
            "client vs bare protocol loop, p50",
            "us",
            pairs("fabric_latency", "protocol_latency", "latency_us", "p50"),
            "<= 1.1",
            False,
        ),
        _row(
            f"client vs bare protocol loop, {config.in_flight} in flight",
            "req/s",
            pairs("fabric_throughput", "protocol_throughput", "throughput", "req_per_s"),
            ">= 0.9",
            True,
        ),
    ]
    device_us = [_get(r["fabric_mlp"], ("split_us", "device")) for r in runs]
    breakdown = [
        _stage(runs, name, key)
        for name, key in (
            ("pyzmq relay and echo (the baseline)", "relay"),
            ("+ broker and worker loops, no runtime (echo worker, bare loop)", "echo"),
            ("+ the runtime (noop ModelRunner worker, bare loop)", "protocol"),
            ("+ the Client (what users get)", "fabric"),
        )
    ]
    return {
        "suite": "fabric",
        "runs": len(runs),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
        "mlp": {
            "device_ms_per_batch": round(device_s * 1e3, 3),
            "batch": batch,
            "ideal_samples_per_s": round(ideal, 1),
            "reported_device_us_median": round(statistics.median(device_us), 1),
        },
        "comparisons": comparisons,
        "diagnostics": diagnostics,
        "breakdown": breakdown,
        "split_us": {
            case: runs[-1][f"fabric_{case}"]["split_us"]
            for case in ("latency", "throughput", "goodput", "mlp")
        },
        "detail": runs,
    }


def _stage(runs: list[dict[str, Any]], name: str, key: str) -> dict[str, Any]:
    """One step from the relay to the whole fabric: its latency and throughput (medians)
    and each as a ratio to the relay's of the same run."""

    def median(case: str, *path: str) -> float:
        return statistics.median(_get(r[f"{key}_{case}"], path) for r in runs)

    def ratio(case: str, *path: str) -> float:
        return statistics.median(
            _get(r[f"{key}_{case}"], path) / _get(r[f"relay_{case}"], path) for r in runs
        )

    stage = {
        "name": name,
        "latency_p50_us": round(median("latency", "latency_us", "p50"), 1),
        "latency_vs_relay": round(ratio("latency", "latency_us", "p50"), 3),
        "req_per_s": round(median("throughput", "throughput", "req_per_s"), 1),
        "req_per_s_vs_relay": round(ratio("throughput", "throughput", "req_per_s"), 3),
    }
    if all("cpu_us_per_request" in r[f"{key}_{case}"] for r in runs for case in CASES):
        stage["cpu_us_per_request"] = {
            case: {role: round(median(case, "cpu_us_per_request", role), 1) for role in ROLES}
            for case in CASES
        }
    return stage


CASES = ("latency", "throughput")


def _get(tree: dict[str, Any], path: tuple[str, ...]) -> float:
    node: Any = tree
    for key in path:
        node = node[key]
    return float(node)
