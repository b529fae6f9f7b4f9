"""``ipuserve demo``: the whole system on one machine, checked, in well under a minute.

It writes two example models, starts a broker and one worker per model as real
processes (``python -m ipuserve broker|worker`` on free loopback ports, with a
private simulated-IPU host), sends requests of mixed models and batch sizes from
concurrent clients, checks every result against numpy, prints throughput and
latency, and stops everything -- also on Ctrl-C or an error; the children die
with it if it is killed.

This module is, like :mod:`ipuserve.face.cli`, a composition root: it uses the client
for traffic and the runtime only to compute the numpy references.
"""

from __future__ import annotations

import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from ipuserve.bench.processes import PYTHON as PYTHON_MODULE
from ipuserve.bench.processes import ChildProcesses, endpoint, wait_for_models
from ipuserve.client import Client, Timing
from ipuserve.errors import IpuserveError

PYTHON = [*PYTHON_MODULE, "ipuserve"]
MODELS = {"mlp": ["--batch-size", "16"], "simple": ["--batch-size", "4"]}


@dataclass(frozen=True)
class DemoConfig:
    requests: int = 3000
    clients: int = 8
    in_flight: int = 8  # per client
    max_batch: int = 8
    seed: int = 0
    workdir: Path | None = None


@dataclass
class Sent:
    model: str
    samples: int
    latency_s: float = 0.0
    error: str | None = None
    timing: Timing | None = None


def run_demo(config: DemoConfig, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Run the demo; the exit code (0 only if every request got a correct result)."""
    own_workdir = config.workdir is None
    workdir = config.workdir or Path(tempfile.mkdtemp(prefix="ipuserve-demo-"))
    say = _printer(out)
    kept = "removed after a clean run" if own_workdir else "kept"
    say(f"ipuserve demo: working in {workdir} (models and process logs; {kept})")
    paths = _write_models(workdir, say)
    references = _reference_functions(paths)
    env = {"IPUSERVE_SIM_LOCK_DIR": str(workdir / "ipu-locks"), "OPENBLAS_NUM_THREADS": "1"}
    frontend, backend = endpoint(), endpoint()
    with ChildProcesses(workdir, env) as procs:
        procs.start("broker", [*PYTHON, "broker", "--frontend", frontend, "--backend", backend])
        for name, path in paths.items():
            procs.start(
                f"worker-{name}", [*PYTHON, "worker", "--broker", backend, "--model", str(path)]
            )
        say("started a broker and 2 workers (mlp, simple); waiting for them to register...")
        wait_for_models(procs, frontend, {name: 1 for name in paths}, timeout_s=60)
        say(
            f"sending {config.requests} requests from {config.clients} clients "
            f"({config.in_flight} in flight each)"
        )
        progress = _progress(err, config.requests)
        sent, elapsed, crashes = _drive(frontend, config, references, progress)
        say("stopping the broker and workers")
    _report(sent, elapsed, say)
    code = _verdict(config.requests, sent, crashes, elapsed, say)
    if own_workdir:  # a folder we made: gone after a clean run, kept to read after a failure
        if code == 0:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            say(f"the process logs are kept in {workdir}")
    return code


def _write_models(workdir: Path, say: Callable[[str], None]) -> dict[str, Path]:
    import subprocess

    paths = {}
    for name, options in MODELS.items():
        path = workdir / f"{name}.popef"
        subprocess.run(
            [*PYTHON, "model", "example", name, str(path), *options],
            check=True,
            capture_output=True,
        )
        paths[name] = path
    say(f"wrote example models: {', '.join(f'{n} ({p.name})' for n, p in paths.items())}")
    return paths


Reference = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


def _reference_functions(paths: dict[str, Path]) -> dict[str, tuple[Reference, dict[str, Any]]]:
    """numpy reference and input shapes per model, read from the model files themselves."""
    from ipuserve.runtime.popef import examples, load_model

    found: dict[str, tuple[Reference, dict[str, Any]]] = {}
    for name, path in paths.items():
        model = load_model([str(path)])
        weights = examples.tensor_arrays(model)
        shapes = {
            d.name(): d.tensorInfo()
            for d in model.metadata.anchors()
            if d.name() in examples.sample_inputs(model)
        }

        def reference(
            inputs: dict[str, np.ndarray],
            name: str = name,
            weights: dict[str, np.ndarray] = weights,
        ) -> dict[str, np.ndarray]:
            return examples.reference(name, inputs, weights)

        found[name] = (reference, shapes)
    return found


class _ClientRun:
    """One client's share: make requests as needed, keep ``in_flight`` going, and check
    every result afterwards -- checking while sending would compete for the CPU with
    the traffic being measured (``--requests`` is capped to bound the memory kept)."""

    def __init__(
        self,
        index: int,
        config: DemoConfig,
        references: dict[str, Any],
        finished: Callable[[], None],
    ) -> None:
        self._indexes = range(index, config.requests, config.clients)
        self._config = config
        self._references = references
        self._finished = finished
        self._rng = np.random.default_rng(config.seed + index)
        self._pick = random.Random(config.seed + index)
        self._unchecked: dict[str, list[tuple[Sent, dict[str, np.ndarray], dict[str, Any]]]] = {}
        self.sent: list[Sent] = []
        self.crash: str | None = None

    def run(self, frontend: str) -> None:
        """Send this client's share; an unexpected error ends it early, kept in ``crash``."""
        try:
            self._run(frontend)
        except Exception as error:  # a bug, not a request's failure: reported, not raised
            self.crash = f"{type(error).__name__}: {error}"

    def _run(self, frontend: str) -> None:
        with Client(frontend, timeout=30.0) as client:
            window: list[tuple[Sent, dict[str, np.ndarray], Any, float]] = []
            for position in self._indexes:
                model = "mlp" if position % 2 else "simple"
                inputs = self._inputs(model)
                job = Sent(model, len(next(iter(inputs.values()))))
                window.append((job, inputs, client.infer_async(model, inputs), time.perf_counter()))
                if len(window) >= self._config.in_flight:
                    self._collect(*window.pop(0))
            for item in window:
                self._collect(*item)

    def check(self) -> None:
        for model in list(self._unchecked):
            self._check(model)

    def _inputs(self, model: str) -> dict[str, np.ndarray]:
        batch = self._pick.randint(1, self._config.max_batch)
        shapes = self._references[model][1]
        return {
            name: self._rng.standard_normal((batch, *info.shape()[1:])).astype(info.numpyDType())
            for name, info in shapes.items()
        }

    def _collect(
        self, job: Sent, inputs: dict[str, np.ndarray], future: Any, sent_at: float
    ) -> None:
        try:
            outputs = dict(future.result())
            job.timing = future.timing
            self._unchecked.setdefault(job.model, []).append((job, inputs, outputs))
        except IpuserveError as error:
            job.error = f"{type(error).__name__}: {error}"
        job.latency_s = time.perf_counter() - sent_at
        self.sent.append(job)
        self._finished()

    def _check(self, model: str) -> None:
        """Compare a batch of results with numpy in one reference computation."""
        pending = self._unchecked.pop(model, [])
        if not pending:
            return
        reference = self._references[model][0]
        stacked = {
            name: np.concatenate([inputs[name] for _j, inputs, _o in pending])
            for name in pending[0][1]
        }
        expected = reference(stacked)
        start = 0
        for job, _inputs, outputs in pending:
            for name, want in expected.items():
                if not np.allclose(
                    outputs[name], want[start : start + job.samples], rtol=1e-4, atol=1e-5
                ):
                    job.error = f"output {name!r} differs from the numpy reference"
            start += job.samples


def _drive(
    frontend: str, config: DemoConfig, references: dict[str, Any], progress: Callable[[int], None]
) -> tuple[list[Sent], float, list[str]]:
    """Send everything; the checked results, how long the traffic took, and why any
    client thread ended early."""
    done = [0]
    lock = threading.Lock()

    def finished() -> None:
        with lock:
            done[0] += 1
            progress(done[0])

    runs = [_ClientRun(i, config, references, finished) for i in range(config.clients)]
    threads = [threading.Thread(target=run.run, args=(frontend,), daemon=True) for run in runs]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        while thread.is_alive():
            thread.join(0.2)  # short joins keep Ctrl-C responsive in the main thread
    elapsed = time.perf_counter() - started
    for run in runs:
        run.check()
    crashes = [f"client {i}: {run.crash}" for i, run in enumerate(runs) if run.crash]
    return [job for run in runs for job in run.sent], elapsed, crashes


def _report(jobs: list[Sent], elapsed: float, say: Callable[[str], None]) -> None:
    say("")
    if not jobs:
        say("no request was answered")
        return
    say(
        f"{'model':<8} {'requests':>8} {'samples':>8} {'errors':>6} {'req/s':>7} "
        f"{'samples/s':>9} {'p50 ms':>7} {'p90 ms':>7} {'p99 ms':>7}"
    )
    for model in [*sorted({j.model for j in jobs}), "all"]:
        chosen = [j for j in jobs if model in ("all", j.model)]
        samples = sum(j.samples for j in chosen)
        errors = sum(1 for j in chosen if j.error)
        ms = np.array([j.latency_s for j in chosen]) * 1e3
        say(
            f"{model:<8} {len(chosen):>8} {samples:>8} {errors:>6} {len(chosen) / elapsed:>7.0f} "
            f"{samples / elapsed:>9.0f} {np.percentile(ms, 50):>7.2f} "
            f"{np.percentile(ms, 90):>7.2f} {np.percentile(ms, 99):>7.2f}"
        )
    timings = [j.timing for j in jobs if j.timing is not None]
    if timings:
        parts = {
            "broker queue": "broker_queue_us",
            "worker queue": "worker_queue_us",
            "device": "device_us",
            "worker other": "worker_other_us",
            "wire": "wire_us",
        }
        split = ", ".join(
            f"{label} {np.mean([getattr(t, key) for t in timings]) / 1e3:.2f}"
            for label, key in parts.items()
        )
        say(f"mean latency split (ms): {split}")


def _verdict(
    requested: int, jobs: list[Sent], crashes: list[str], elapsed: float, say: Callable[[str], None]
) -> int:
    """The exit code: 0 only if every request was sent, answered and matched numpy."""
    failed = [j for j in jobs if j.error]
    problems = []
    if len(jobs) < requested:
        problems.append(f"only {len(jobs)} of {requested} requests were answered and checked")
    if crashes:
        problems.append(f"{len(crashes)} client thread(s) died; first: {crashes[0]}")
    if failed:
        problems.append(
            f"{len(failed)} request(s) failed; first: {failed[0].model}: {failed[0].error}"
        )
    if problems:
        say("\nFAILED: " + "\n        ".join(problems))
        return 1
    say(f"\nall {len(jobs)} results matched the numpy reference ({elapsed:.1f} s of traffic)")
    return 0


def _printer(out: TextIO) -> Callable[[str], None]:
    def say(line: str) -> None:
        print(line, file=out, flush=True)

    return say


def _progress(err: TextIO, total: int) -> Callable[[int], None]:
    """A progress bar on a terminal; quarter milestones otherwise."""
    interactive = err.isatty()
    started = time.perf_counter()
    last = [0.0]

    def show(done: int) -> None:
        now = time.perf_counter()
        if interactive and (now - last[0] > 0.1 or done == total):
            last[0] = now
            filled = int(30 * done / total)
            rate = done / max(now - started, 1e-9)
            end = "\n" if done == total else ""
            err.write(
                f"\r[{'#' * filled}{'.' * (30 - filled)}] {done}/{total} {rate:,.0f} req/s{end}"
            )
            err.flush()
        elif not interactive and done * 4 % total < 4 and done:
            err.write(f"{done}/{total} requests done\n")
            err.flush()

    return show
