"""A worker serving several brokers: one WorkerNode per broker, one backend, one capacity.

``ipuserve worker --broker tcp://b1:5556 --broker tcp://b2:5556`` (or a name that
resolves to several addresses, Swarm's ``tasks.broker``) serves every broker those
endpoints stand for. Each broker gets a :class:`~ipuserve.worker.node.WorkerNode` of
its own -- socket loop, JobBook and connection, on its own thread -- and all of them
share the backend and a :class:`~ipuserve.worker.credit.CreditPool`, so the worker
never holds more jobs than its capacity, whichever broker sends them.

The :class:`BrokerNodes` follows the endpoints (:class:`ipuserve.discovery.EndpointSet`):
it re-resolves them on the set's interval and whenever a node loses its broker, starts
a node for each address that appears and lets a node whose address is gone leave
(it hands that broker its jobs back with BYE, then waits for what already runs).
On a stop request (SIGTERM) every node drains as a lone worker would. The exit code
is the highest of the nodes': 0 after a drain, 1 if a broker refused every model or
a loop crashed -- which also stops the others, so that a supervisor sees it.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import zmq

from ipuserve.discovery import EndpointSet, Resolver, resolve_ipv4
from ipuserve.worker.backend import Backend
from ipuserve.worker.config import WorkerConfig
from ipuserve.worker.control import Control
from ipuserve.worker.credit import CreditPool, Share
from ipuserve.worker.metrics import CreditMetrics
from ipuserve.worker.node import WorkerNode

log = logging.getLogger(__name__)


class _Running:
    """A node on its thread, and its exit code once it ended."""

    def __init__(
        self, node: WorkerNode, share: Share, name: str, on_end: Callable[[], None]
    ) -> None:
        self.node = node
        self.share = share
        self.code: int | None = None
        self._on_end = on_end
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        try:
            self.code = self.node.run()
        finally:
            self._on_end()


class BrokerNodes:
    """One :class:`WorkerNode` per broker ``endpoints`` stand for, over one backend and one
    capacity, until stopped."""

    def __init__(
        self,
        backend: Backend,
        config: WorkerConfig,
        endpoints: Sequence[str],
        *,
        on_joined: Callable[[str], None] | None = None,
        metrics: CreditMetrics | None = None,
        endpoint_set: EndpointSet | None = None,
        resolver: Resolver = resolve_ipv4,
        control: Control | None = None,
    ) -> None:
        """``endpoint_set`` (default: one for ``endpoints``) and ``resolver`` are a test's
        to replace: the same resolver for both. ``control``: every node is a repository
        worker's host node (:class:`~ipuserve.worker.node.Control`)."""
        self._control = control
        self._backend = backend
        self._config = config
        self._on_joined = on_joined
        capacity = config.credit or backend.capacity()
        self.pool = CreditPool(capacity, metrics or CreditMetrics(capacity))
        self._endpoints = endpoint_set or EndpointSet(endpoints)
        self._context: zmq.Context[Any] = zmq.Context.instance()
        self._nodes: dict[str, _Running] = {}
        #: the one address each node's endpoint reached when it was last resolved
        self._peers: dict[str, str | None] = {}
        self._resolver = resolver
        self._leaving: list[_Running] = []
        self._ended: list[_Running] = []
        self._wake = threading.Event()
        self._stopping = False
        self._lost = False
        self._supervising = False

    def request_stop(self) -> None:
        """Drain every node and exit; safe from a signal handler."""
        self._stopping = True
        self._wake.set()

    def run(self) -> int:
        """Serve until stopped (or a node fails); the worker's exit code."""
        self._supervising = True
        try:
            code = self._supervise()
        except Exception:
            log.exception("worker %s: its broker nodes crashed", self._config.worker_id)
            code = 1
        finally:
            self._supervising = False
            self._stop_all()
        return max([code, *(r.code or 0 for r in self._ended)])

    # ------------------------------------------------------------ probes (another thread)

    def live(self) -> tuple[bool, str]:
        """Live while BrokerNodes supervises and its nodes' loops run."""
        if not self._supervising:
            return False, "the worker is not serving"
        dead = [e for e, r in list(self._nodes.items()) if not r.thread.is_alive()]
        if dead:
            return False, f"the loop serving {', '.join(dead)} ended"
        return True, "ok"

    def ready(self) -> tuple[bool, str]:
        """Ready while serving and registered with at least one broker (the model is
        loaded before BrokerNodes starts): brokers may send it jobs."""
        if self._stopping:
            return False, "the worker is draining"
        nodes = list(self._nodes.items())
        if not self._supervising or not any(r.node.joined for _, r in nodes):
            brokers = ", ".join(e for e, _ in nodes) or "none resolved yet"
            return False, f"not registered with any broker (brokers: {brokers})"
        return True, "ok"

    # ------------------------------------------------------------ following endpoints

    def _supervise(self) -> int:
        self._follow()
        while not self._stopping:
            self._wake.wait(min(self._endpoints.seconds_until_due(), 3600.0))
            self._wake.clear()
            if self._stopping:
                break
            self._ended += [r for r in self._leaving if not r.thread.is_alive()]
            self._leaving = [r for r in self._leaving if r.thread.is_alive()]
            if any(not r.thread.is_alive() for r in self._nodes.values()):
                return 1  # refused every model, or crashed: the others stop too
            if self._lost or self._endpoints.due():
                self._lost = False
                self._follow()
        return 0

    def _follow(self) -> None:
        """Re-resolve; serve what appeared, let go of what disappeared."""
        added, removed = self._endpoints.refresh()
        moved = self._same_peers(added, removed)
        for new, old in moved.items():  # the same broker, named another way
            running = self._nodes.pop(old)
            self._nodes[new] = running
            self._peers[new] = self._peers.pop(old)
            running.node.retarget(new)
            self.pool.rename(running.share, new)
            log.info("broker %s is now reached as %s", old, new)
        for endpoint in removed:
            gone = self._nodes.pop(endpoint, None) if endpoint not in moved.values() else None
            if gone is not None:
                log.warning("broker %s is gone from the endpoints: leaving it", endpoint)
                self._peers.pop(endpoint, None)
                gone.node.request_leave()
                self._leaving.append(gone)
        for endpoint in added:
            if endpoint not in moved:
                self._peers[endpoint] = self._peer(endpoint)
                self._start(endpoint)

    def _peer(self, endpoint: str) -> str | None:
        """The one address ``endpoint`` reaches now, as ``tcp://ADDRESS:PORT`` (None if
        unknown): a name kept because it resolves to one address reaches that one."""
        if not endpoint.startswith("tcp://"):
            return endpoint
        host, _colon, port = endpoint[len("tcp://") :].rpartition(":")
        try:
            ipaddress.ip_address(host.strip("[]"))
            return endpoint  # an address already
        except ValueError:
            pass
        try:
            addresses = set(self._resolver(host))
        except OSError:
            return None
        return f"tcp://{addresses.pop()}:{port}" if len(addresses) == 1 else None

    def _same_peers(self, added: list[str], removed: list[str]) -> dict[str, str]:
        """Added endpoints that reach the broker a removed one did: a name's addresses
        went from several to one (the name is used again, discovery.py) or from one
        to several. That broker's connection goes on; leaving it would hand back its
        jobs for nothing."""
        by_peer = {self._peers.get(old): old for old in removed if self._peers.get(old)}
        moved = {}
        for new in added:
            old = by_peer.pop(self._peer(new), None)
            if old is not None:
                moved[new] = old
        return moved

    def _start(self, endpoint: str) -> None:
        config = replace(self._config, broker=endpoint)
        share = self.pool.share(endpoint)
        node = WorkerNode(
            self._backend,
            config,
            self._context,
            on_joined=self._on_joined,
            share=share,
            on_lost=self._on_lost,
            owns_backend=False,
            control=self._control,
        )
        name = f"worker-node-{len(self._nodes) + len(self._ended)}"
        running = _Running(node, share, name, self._wake.set)
        running.thread.start()  # before the probes can see it: not started reads as ended
        self._nodes[endpoint] = running

    def _on_lost(self) -> None:
        """A node lost its broker (from its thread): re-resolve, it may have moved."""
        self._lost = True
        self._wake.set()

    # ------------------------------------------------------------ stopping

    def _stop_all(self) -> None:
        every = [*self._nodes.values(), *self._leaving]
        for running in every:
            running.node.request_stop()
        for running in every:
            running.thread.join()
            if running not in self._ended:
                self._ended.append(running)
        self._backend.close()  # answers what still runs: the nodes' mailboxes take it
        for running in self._ended:
            running.node.mailbox.close()
        self._nodes.clear()
        self._leaving.clear()
