"""compose.yaml passes every setting of the broker and worker commands through from
the environment, as docs/deploy.md promises (checked without Docker: the compose
tests in tests/compose run the file for real)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ipuserve.face.cli import main

ROOT = Path(__file__).resolve().parent.parent
#: Options compose.yaml fixes on purpose (docs/deploy.md, "Fixed in compose.yaml"),
#: or that only make sense outside a container.
#: compose runs with keys, so --insecure (keyless only) would be a usage error there.
FIXED = {
    "broker": {"frontend", "backend", "metrics_port", "metrics_host", "insecure"},
    "worker": {"broker", "models", "worker_id", "metrics_host"},
}


@pytest.mark.parametrize("command", ["broker", "worker"])
def test_compose_passes_every_option_through_under_its_cli_name(command: str) -> None:
    text = (ROOT / "compose.yaml").read_text()
    passed = set(re.findall(r"^\s+(IPUSERVE_\w+):", text, re.MULTILINE))
    options = {
        p.name for p in main.commands[command].params if p.name and p.param_type_name == "option"
    }
    passed_through = options - FIXED[command]
    expected = {f"IPUSERVE_{command.upper()}_{name.upper()}" for name in passed_through}
    assert expected - passed == set()
    documented = (ROOT / "docs" / "deploy.md").read_text()
    assert {v for v in expected if f"`{v}`" not in documented} == set()
