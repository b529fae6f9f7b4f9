"""ipuserve: serve models on a fleet of (simulated) Graphcore IPUs over ZeroMQ.

The package root is the common ground every component may import: the wire
protocol (:mod:`ipuserve.protocol`), the exception tree (:mod:`ipuserve.errors`)
and logging setup. The components live in ``ipuserve.runtime``,
``ipuserve.worker``, ``ipuserve.broker`` and ``ipuserve.client``.
"""

from ipuserve._version import __version__

__all__ = ["__version__"]
