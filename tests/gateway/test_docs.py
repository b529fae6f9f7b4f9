"""docs/gateway.md shows the tables the code has: the error table of
ipuserve.gateway.status and the datatypes of ipuserve.gateway.tensors."""

from __future__ import annotations

import re
from pathlib import Path

from ipuserve.gateway.status import table_rows
from ipuserve.gateway.tensors import DATATYPES

DOC = Path(__file__).resolve().parents[2] / "docs" / "gateway.md"


def _table(marker: str) -> list[list[str]]:
    text = DOC.read_text(encoding="utf-8")
    found = re.search(rf"<!-- {marker}:.*?-->\n(.*?)<!-- end {marker} -->", text, re.S)
    assert found, f"docs/gateway.md has no {marker} block"
    lines = found[1].strip().splitlines()[2:]  # past the header and the rule
    return [[cell.strip().strip("`") for cell in line.strip("|").split("|")] for line in lines]


def test_the_error_table_is_the_codes() -> None:
    want = [[name, code, str(http), grpc] for name, code, http, grpc in table_rows()]
    assert _table("status-table") == want


def test_the_datatype_table_is_the_codes() -> None:
    want = [[datatype, dtype.name] for datatype, dtype in DATATYPES.items()]
    assert _table("datatype-table") == want
