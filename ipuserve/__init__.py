"""ipuserve: serve models on a fleet of (simulated) Graphcore IPUs over ZeroMQ.

The package root is the common ground every component may import: the wire
protocol (:mod:`ipuserve.protocol`), the exception tree (:mod:`ipuserve.errors`)
and logging setup; it imports no component. The components live in
``ipuserve.runtime``, ``ipuserve.worker``, ``ipuserve.broker``, ``ipuserve.client``
and ``ipuserve.bench``; :mod:`ipuserve.face` (the CLI root, the demo and the
configuration reference) is the one place above them.
"""

from pathlib import Path as _Path

from ipuserve._version import __version__

__all__ = ["__version__"]

# In a source checkout the components sit beside this folder (DESIGN.md §1), and an
# install maps them into this package. Python started in the checkout's root imports
# this folder, not the installed package, so without this line `import
# ipuserve.client` failed there after the README's `pip install .`.
_CHECKOUT = _Path(__file__).resolve().parent.parent
if (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT / "runtime" / "model_runner").is_dir():
    __path__.append(str(_CHECKOUT))
