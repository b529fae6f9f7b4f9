"""The seam between a worker node's loop and a repository worker's host.

A host node (:mod:`ipuserve.worker.host_node`) is a :class:`~ipuserve.worker.node.WorkerNode`
without models or credit whose loop also takes LOAD and UNLOAD from its broker and
sends the host's HOST reports: this is all the loop needs to know of the host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ipuserve import protocol as wire


class Control(Protocol):
    """What a node without models adds to the loop: a repository worker's host node
    (:mod:`ipuserve.worker.host_node`) takes LOAD and UNLOAD and sends HOST reports.

    :meth:`report` is sent after every WELCOME and whenever :attr:`seq` changed since
    the last one sent; whoever changes it rings the doorbells given to :meth:`watch`
    (from any thread), which wakes the loop to send it."""

    @property
    def seq(self) -> int: ...

    def report(self) -> wire.Message: ...

    def handle(self, message: wire.Load | wire.Unload) -> None:
        """Called on the node's thread: must not block."""
        ...

    def watch(self, wake: Callable[[], None]) -> None: ...

    def unwatch(self, wake: Callable[[], None]) -> None:
        """Called when the node's loop ended, before its doorbell closes."""
        ...
