"""What one abusive case costs the gateway and its other clients, measured from outside.

:class:`Watch` wraps one case: it resets the gateway process's peak-RSS mark
(``/proc/PID/clear_refs``), notes its RSS and open descriptors, and runs two honest
clients beside the case on their own threads, from another loopback address
(``127.0.0.2``, so a cap per peer address does not count them with an abuser on
``127.0.0.1``):

* a **probe**: ``GET /v2/health/ready`` on a new connection each time, as a kubelet does;
* an **infer client**: the ``mlp`` model over one kept-alive connection (a new one after
  a failure), every answer checked against the model's numpy reference.

When the case is done, :meth:`Watch.finish` lets the honest clients make a few more
calls (so a case too quick for them still has them measured after it), stops them,
waits for the gateway's descriptors to come back near where they were, and returns a
:class:`Report`. The tests assert the memory and the honest clients' answers; the
latencies are recorded, never asserted (they are the benchmark's:
``benchmarks/abuse.py`` runs the suite with ``IPUSERVE_ABUSE_REPORT`` set and prints
them).
"""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

#: the honest clients' own address, beside an abuser on 127.0.0.1
HONEST_ADDRESS = "127.0.0.2"
#: honest calls each client makes after the case before the watch ends
AFTER_CASE_CALLS = 10
#: a call that takes longer than this counts as failed (and bounds a hung one)
HONEST_TIMEOUT_S = 10.0
#: how long finish() waits for the gateway's descriptors to come back
SETTLE_S = 30.0
#: descriptors the gateway may still hold after a case beyond its baseline (kept-alive
#: honest connections, a connection in its linger)
FD_SLACK = 16
MIB = 1024 * 1024
#: where the reports go, one JSON object per line, when the variable is set
REPORT_ENV = "IPUSERVE_ABUSE_REPORT"


def rss_bytes(pid: int, key: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {key} for process {pid}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def reset_peak(pid: int) -> None:
    """Set the process's peak RSS (VmHWM) to its RSS now (Linux, clear_refs 5)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


@dataclass
class HonestRecord:
    """One honest client's calls during a watch."""

    latencies_s: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def calls(self) -> int:
        return len(self.latencies_s) + len(self.failures)

    def summary(self) -> dict[str, Any]:
        lat = np.asarray(self.latencies_s or [0.0]) * 1000
        return {
            "answered": len(self.latencies_s),
            "failed": len(self.failures),
            "p99_ms": round(float(np.percentile(lat, 99)), 2),
            "max_ms": round(float(lat.max()), 2),
            "first_failures": self.failures[:3],
        }


#: how many times grpcio holds a received message as it hands it to Python (its slices,
#: their join, the bytes object) before any of the gateway's code can look at it
GRPC_COPIES = 3


@dataclass
class Report:
    case: str
    declared_bytes: int
    #: what the transport must hold before the gateway's code sees the request (a gRPC
    #: message that passed the token check, GRPC_COPIES times); 0 for HTTP, whose body
    #: the gateway reads itself
    transport_bytes: int
    rss_rise_bytes: int
    fds_before: int
    fds_after: int
    probe: HonestRecord
    infer: HonestRecord

    @property
    def rss_bound(self) -> int:
        """The issue's bound, 3x the declared tensor bytes + 32 MiB and never over 256
        MiB, plus what the transport holds before the gateway can look (still within
        the 256 MiB)."""
        return min(3 * self.declared_bytes + self.transport_bytes + 32 * MIB, 256 * MIB)

    def check(self) -> None:
        """The memory bound, the descriptors back, and the honest clients served."""
        self.record()
        assert self.rss_rise_bytes <= self.rss_bound, (
            f"{self.case}: the gateway's RSS rose {self.rss_rise_bytes / MIB:.1f} MiB "
            f"(bound {self.rss_bound / MIB:.1f} MiB)"
        )
        assert self.fds_after <= self.fds_before + FD_SLACK, (self.fds_before, self.fds_after)
        for name, record in (("probe", self.probe), ("infer", self.infer)):
            assert record.calls >= AFTER_CASE_CALLS, (name, record)
            assert len(record.failures) * 100 <= record.calls, (
                f"{self.case}: the honest {name} failed {len(record.failures)} of "
                f"{record.calls}: {record.failures[:3]}"
            )

    def record(self) -> None:
        target = os.environ.get(REPORT_ENV)
        if not target:
            return
        row = asdict(self) | {"probe": self.probe.summary(), "infer": self.infer.summary()}
        with open(target, "a", encoding="utf-8") as out:
            out.write(json.dumps(row) + "\n")


class _Honest(threading.Thread):
    """Calls ``call`` in a loop until told to stop, recording each call."""

    def __init__(self, call: Callable[[], None]) -> None:
        super().__init__(daemon=True)
        self._call = call
        self.record = HonestRecord()
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            start = time.perf_counter()
            try:
                self._call()
            except Exception as exc:  # a failed call is what is being counted
                self.record.failures.append(f"{type(exc).__name__}: {exc}"[:200])
            else:
                self.record.latencies_s.append(time.perf_counter() - start)
            time.sleep(0.005)  # pacing, not synchronisation: ~100 calls/s at most


class HonestInfer:
    """The mlp over HTTP JSON on one kept-alive connection, checked against numpy."""

    def __init__(
        self,
        host: str,
        port: int,
        x: np.ndarray[Any, Any],
        want: np.ndarray[Any, Any],
        token: str | None = None,
    ) -> None:
        self._host, self._port = host, port
        self._headers = {"Content-Type": "application/json"}
        if token is not None:
            self._headers["Authorization"] = f"Bearer {token}"
        self._body = json.dumps(
            {
                "inputs": [
                    {
                        "name": "input",
                        "datatype": "FP32",
                        "shape": list(x.shape),
                        "data": x.reshape(-1).tolist(),
                    }
                ],
                "outputs": [{"name": "logits"}],
            }
        ).encode()
        self._want = want
        self._conn: http.client.HTTPConnection | None = None

    def __call__(self) -> None:
        if self._conn is None:
            self._conn = http.client.HTTPConnection(
                self._host, self._port, timeout=HONEST_TIMEOUT_S,
                source_address=(HONEST_ADDRESS, 0),
            )  # fmt: skip
        try:
            self._conn.request("POST", "/v2/models/mlp/infer", self._body, self._headers)
            response = self._conn.getresponse()
            body = response.read()
        except Exception:
            self.close()
            raise
        if response.status != 200:
            raise AssertionError(f"{response.status}: {body[:200]!r}")
        [out] = json.loads(body)["outputs"]
        got = np.asarray(out["data"], np.float32).reshape(out["shape"])
        np.testing.assert_allclose(got, self._want, rtol=1e-4, atol=1e-4)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def probe(host: str, port: int) -> Callable[[], None]:
    def call() -> None:
        conn = http.client.HTTPConnection(
            host, port, timeout=HONEST_TIMEOUT_S, source_address=(HONEST_ADDRESS, 0)
        )
        try:
            conn.request("GET", "/v2/health/ready")
            response = conn.getresponse()
            response.read()
            if response.status != 200:
                raise AssertionError(f"ready probe answered {response.status}")
        finally:
            conn.close()

    return call


class Watch:
    """Measures one case; use as ``with watcher.case("name", declared) as w: ...``."""

    def __init__(self, pid: int, host: str, port: int, infer: HonestInfer) -> None:
        self.pid, self._host, self._port, self._infer = pid, host, port, infer

    def case(self, name: str, declared_bytes: int, transport_bytes: int = 0) -> _Case:
        return _Case(self, name, declared_bytes, transport_bytes)


class _Case:
    def __init__(self, watch: Watch, name: str, declared: int, transport: int) -> None:
        self._watch, self.name, self.declared, self.transport = watch, name, declared, transport
        self.report: Report | None = None

    def __enter__(self) -> _Case:
        pid = self._watch.pid
        self._fds = open_fds(pid)
        reset_peak(pid)
        self._rss = rss_bytes(pid)
        self._probe = _Honest(probe(self._watch._host, self._watch._port))
        self._infer = _Honest(self._watch._infer)
        self._probe.start()
        self._infer.start()
        return self

    def honest_calls(self, count: int = AFTER_CASE_CALLS) -> None:
        """Wait until each honest client has made ``count`` more calls: a case whose
        harm lasts while it holds something (connections) calls this while it holds."""
        marks = {t: t.record.calls for t in (self._probe, self._infer)}
        deadline = time.monotonic() + 4 * count * HONEST_TIMEOUT_S
        for thread, mark in marks.items():
            while thread.record.calls < mark + count and thread.is_alive():
                assert time.monotonic() < deadline, "the honest clients stopped calling"
                time.sleep(0.01)

    def __exit__(self, kind: object, *_: object) -> None:
        self.honest_calls()
        for thread in (self._probe, self._infer):
            thread.stop.set()
            thread.join(HONEST_TIMEOUT_S * 2)
        self._watch._infer.close()
        pid = self._watch.pid
        peak = rss_bytes(pid, "VmHWM")
        settle = time.monotonic() + SETTLE_S
        while open_fds(pid) > self._fds + FD_SLACK and time.monotonic() < settle:
            time.sleep(0.05)
        self.report = Report(
            self.name, self.declared, self.transport, max(0, peak - self._rss), self._fds,
            open_fds(pid),
            self._probe.record, self._infer.record,
        )  # fmt: skip
        if kind is None:
            self.report.check()
