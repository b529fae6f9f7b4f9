"""The runtime knows no network: no module under ipuserve.runtime imports zmq, even
indirectly (DESIGN.md §1). A fresh interpreter imports each module in turn and names
the first one after which zmq is loaded, so a new import chain shows where it starts."""

from __future__ import annotations

import subprocess
import sys

IMPORT_EVERY_RUNTIME_MODULE = """
import importlib, pkgutil, sys
import ipuserve.runtime as runtime
names = [runtime.__name__] + [
    info.name for info in pkgutil.walk_packages(runtime.__path__, runtime.__name__ + ".")
]
for name in names:
    importlib.import_module(name)
    if "zmq" in sys.modules:
        print("zmq loaded by", name)
        sys.exit(1)
print(len(names), "modules")
"""


def test_no_runtime_module_imports_zmq() -> None:
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_EVERY_RUNTIME_MODULE],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # The walk reached the package's depths: the queues, the runner, the tools.
    assert int(done.stdout.split()[0]) > 40, done.stdout
