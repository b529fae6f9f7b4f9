"""Shared by the tools tests: the root command, and example model files on disk."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from ipuserve.face.cli import main
from ipuserve.runtime import DeviceManager
from ipuserve.runtime.popef import examples


def invoke(*args: str, env: dict[str, str] | None = None) -> Result:
    """``ipuserve tools ARGS...`` in-process; stderr kept apart from stdout."""
    return CliRunner().invoke(main, ["tools", *args], env=env)


def invoke_json(*args: str) -> dict[str, Any]:
    result = invoke(*args, "--json")
    assert result.exit_code == 0, result.output + result.stderr
    report: dict[str, Any] = json.loads(result.stdout)
    return report


def one_line_error(result: Result) -> str:
    """The error a failed command printed: exit 1, one ``Error:`` line, no traceback."""
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)  # a ClickException, not a crash
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


def all_ipus_free() -> bool:
    """True if one device spanning every IPU of the test host can be attached right now."""
    device = DeviceManager().tryGetDevice(4)
    if device is None:
        return False
    device.detach()
    return True


@pytest.fixture(scope="module")
def simple_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "simple.popef"
    examples.simple(batch_size=4, seed=3).write(path)
    return path


MLP_OPTS: dict[str, Any] = {"batch_size": 4, "input_size": 12, "hidden_size": 16, "outputs": 5}


@pytest.fixture(scope="module")
def mlp_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A small MLP, with its weights in a second file (a model made of two files)."""
    folder = tmp_path_factory.mktemp("models")
    model, weights = folder / "mlp.popef", folder / "mlp-weights.popef"
    examples.mlp(**MLP_OPTS, seed=5).write(model, weights)
    return model, weights
