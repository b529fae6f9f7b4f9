"""A repository worker's link to its brokers: one host node per broker, and its lifetime.

A host node is an ordinary :class:`~ipuserve.worker.node.WorkerNode` -- the same join
(HELLO until WELCOME, backoff, refusals), heartbeats, reconnects and following of the
endpoints (:class:`~ipuserve.worker.brokers.BrokerNodes`) -- over a backend with no
models and no credit: HELLO(worker_id=HOST_ID, models=(), credit=0), so a broker never
sends it a job. Its :class:`~ipuserve.worker.host.ModelHost` is the node's
:class:`~ipuserve.worker.control.Control`: the node hands it LOAD and UNLOAD and sends
its HOST report right after every WELCOME (a reconnect, a restarted broker) and on
every change. The versions it hosts join the same brokers as workers of their own.

:func:`serve_host` runs it all until SIGTERM/SIGINT: then every hosted version drains
(as a SIGTERMed worker does) while the host nodes still report, and the host nodes
leave last.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Sequence

from ipuserve import probes
from ipuserve.errors import UnknownModelError
from ipuserve.protocol import ModelSpec
from ipuserve.worker.backend import Done, Refused, WorkItem
from ipuserve.worker.brokers import BrokerNodes
from ipuserve.worker.config import WorkerConfig
from ipuserve.worker.host import ModelHost

log = logging.getLogger(__name__)


class NoModels:
    """A host node's backend: it serves no model and holds no job (credit 0)."""

    def describe(self) -> list[ModelSpec]:
        return []

    def capacity(self) -> int:
        return 0

    def submit_all(self, jobs: Sequence[WorkItem], done: Done) -> list[Refused]:
        why = "this is a repository worker's host node: its versions are workers of their own"
        return [(job, UnknownModelError(why)) for job in jobs]

    def room_for(self, jobs: Sequence[WorkItem]) -> int:
        return len(jobs)  # refused at once, never kept waiting

    def close(self) -> None:
        pass


def host_nodes(
    host: ModelHost,
    config: WorkerConfig,
    endpoints: Sequence[str],
    on_joined: Callable[[str], None] | None = None,
) -> BrokerNodes:
    """The host's nodes: one per broker ``endpoints`` stand for (``config.worker_id`` is
    the host's id)."""
    return BrokerNodes(NoModels(), config, endpoints, on_joined=on_joined, control=host)


def serve_host(
    host: ModelHost,
    config: WorkerConfig,
    endpoints: Sequence[str],
    loads: Sequence[tuple[str, str | None]] = (),
    *,
    on_joined: Callable[[str], None] | None = None,
    health: dict[str, probes.Probe] | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT (or the host nodes fail), loading ``loads`` (name,
    version or None for the latest) at start; the exit code. On the way out every hosted
    version drains and frees its IPUs before the host nodes say BYE."""
    nodes = host_nodes(host, config, endpoints, on_joined)
    if health is not None:
        health[probes.LIVE], health[probes.READY] = nodes.live, nodes.ready
    stop = threading.Event()
    codes: list[int] = []

    def run() -> None:
        try:
            codes.append(nodes.run())
        finally:
            stop.set()  # the host nodes ended by themselves: refused, or crashed

    def on_signal(signum: int, _frame: object) -> None:
        log.warning("repository worker received %s: draining", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    thread = threading.Thread(target=run, name="host-nodes", daemon=True)
    thread.start()
    for name, version in loads:
        host.load(name, version)
    stop.wait()
    host.close()  # the host nodes report the drains as they go
    nodes.request_stop()
    thread.join()
    return max(codes or [0])
