"""ipuserve.protocol as a package: what it re-exports, that it imports no zmq, and that
its modules use only each other's public names."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from ipuserve import protocol

PACKAGE = Path(protocol.__file__).parent


def test_every_name_in_all_exists() -> None:
    missing = [name for name in protocol.__all__ if not hasattr(protocol, name)]
    assert missing == []
    assert len(set(protocol.__all__)) == len(protocol.__all__)


def test_importing_the_protocol_does_not_import_zmq() -> None:
    # A fresh interpreter: this test process has zmq loaded already.
    code = (
        "import sys; import ipuserve.protocol as wire; wire.decode(wire.Ping().encode()); "
        "print(sorted(m for m in sys.modules if m == 'zmq' or m.startswith('zmq.')))"
    )
    found = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert found.stdout.strip() == "[]", found.stdout + found.stderr


def test_no_module_imports_another_modules_private_names() -> None:
    private = []
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ipuserve"):
                private += [
                    f"{path.name}: {node.module}.{alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_")
                ]
    assert private == []
