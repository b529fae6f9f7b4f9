"""ipuserve.protocol as a package: what it re-exports, which modules need zmq, and that
the batch rows' fast path and full check agree."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest

from ipuserve import protocol
from ipuserve.protocol import rows
from ipuserve.protocol.envelope import DEFAULT_LIMITS

PACKAGE = Path(protocol.__file__).parent


def test_every_name_in_all_exists() -> None:
    missing = [name for name in protocol.__all__ if not hasattr(protocol, name)]
    assert missing == []
    assert len(set(protocol.__all__)) == len(protocol.__all__)


def _runtime_imports(module: str) -> set[str]:
    """The top-level modules ``module`` imports outside ``if TYPE_CHECKING:``."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    found: set[str] = set()
    for node in tree.body:  # module level only: a function's import would show up too
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("module", ["tensors", "schema", "envelope"])
def test_the_tensor_model_and_schema_do_not_import_zmq(module: str) -> None:
    # The package's __init__ re-exports transport, so importing any submodule loads zmq
    # too; what is checked is that these modules themselves do not depend on it.
    assert "zmq" not in _runtime_imports(module)


JOB_ROWS: list[list[Any]] = [
    ["0001", 0, None],
    ["", 3, 12.5],
    ["ff" * 64, 1, -4.0],
    ["00", 2, 1e11],
]
RESULT_ROWS: list[list[Any]] = [
    ["0001", 0, {"device_us": 3.5}],
    ["", 2, {}],
    ["abcd", 1, {"a": 1.0, "b": -2.5, "c": 9.99e17}],
]
REQUEST_ROWS: list[list[Any]] = [["0001", 0, None], ["02", 1, 250.0]]


@pytest.mark.parametrize(
    ("many", "one", "items"),
    [
        (rows._job_rows, rows._job_row, JOB_ROWS),
        (rows._result_rows, rows._result_row, RESULT_ROWS),
        (rows._request_rows, rows._request_row, REQUEST_ROWS),
        (rows._reply_rows, rows._reply_row, RESULT_ROWS),
    ],
)
def test_the_fast_path_gives_what_the_full_check_gives(
    many: Any, one: Any, items: list[list[Any]]
) -> None:
    parsed = json.loads(json.dumps(items))  # as a header arrives: parsed JSON
    fast = many(parsed, DEFAULT_LIMITS)
    full = tuple(one(item, DEFAULT_LIMITS) for item in parsed)
    assert fast == full
    assert [type(row[2]) for row in fast] == [type(row[2]) for row in full]
