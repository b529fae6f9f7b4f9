"""One fuzz run against real processes: a broker, a well-behaved ``add`` worker (what
the probe needs), and the fuzzer's raw sockets. Shared by the test and the script."""

from __future__ import annotations

from tests.fuzz.backend import BackendFuzzer
from tests.fuzz.engine import RSS_BOUND_BYTES, Report
from tests.fuzz.frontend import FrontendFuzzer
from tests.fuzz.hosts import HostFuzzer
from tests.helpers import Processes, start_broker, start_worker

SOCKETS = ("frontend", "backend", "host")


def fuzz(
    procs: Processes, socket: str, messages: int, seed: int, ops: list[str] | None = None
) -> Report:
    """Fuzz one broker socket with ``messages`` messages, mutated by ``ops`` (default
    all of engine.OPS; NESTING_OPS: the nesting run); the report of every check."""
    # a liveness window long enough that a fuzzer busy checking answers is not dropped
    broker = start_broker(procs, liveness_ms=2000)
    start_worker(procs, broker)

    def alive() -> bool:  # a broker gone fails every message after: stop at once
        return broker.proc.popen.poll() is None

    if socket == "frontend":
        front = FrontendFuzzer(broker.frontend, broker.proc.pid, seed, ops)
        try:
            report = front.run(messages, alive)
        finally:
            front.close()
    elif socket == "host":
        host = HostFuzzer(broker.frontend, broker.backend, broker.proc.pid, seed, ops)
        try:
            report = host.run(messages, alive)
        finally:
            host.close()
    else:
        back = BackendFuzzer(broker.frontend, broker.backend, broker.proc.pid, seed, ops)
        try:
            report = back.run(messages, alive)
        finally:
            back.close()
    if not alive():
        report.violate("the broker stays up", f"exit code {broker.proc.popen.poll()}")
    grown = report.rss_after - report.rss_before
    if grown > RSS_BOUND_BYTES:
        report.violate(
            "the broker's RSS stays bounded",
            f"grew by {grown >> 20} MiB (bound {RSS_BOUND_BYTES >> 20} MiB)",
            "header-cache-rss" if socket == "frontend" else None,
        )
    return report
