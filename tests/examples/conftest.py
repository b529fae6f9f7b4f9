"""Model files for the example programs, written once per session by the real CLI.

``ipuserve model example NAME OUT [options]`` runs through click's CliRunner, so
the files are exactly what a user following examples/README.md would have.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from ipuserve.face.cli import main as ipuserve_cli

#: model key -> ``ipuserve model example`` arguments (after the output file).
MODELS: dict[str, list[str]] = {
    "simple": ["simple"],
    "mlp": ["mlp"],
    "noop": ["noop"],
    "branches": ["branches"],
    "branches-batch4": ["branches", "--batch-size", "4"],
    "simple-batch8": ["simple", "--batch-size", "8"],
    "simple-batch8-dim1": ["simple", "--batch-size", "8", "--batch-dim", "1"],
}

#: model key -> the same, with the weights written to a second file.
TWO_FILE_MODELS: dict[str, list[str]] = {
    "simple-weights-file": ["simple"],
}


@pytest.fixture(scope="session")
def model_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Path]]:
    """Model key -> the files holding that model (pass them all to ``--popef``)."""
    folder = tmp_path_factory.mktemp("example-models")
    files = {key: [folder / f"{key}.popef"] for key in MODELS}
    files |= {
        key: [folder / f"{key}.popef", folder / f"{key}-weights.popef"] for key in TWO_FILE_MODELS
    }
    for key, paths in files.items():
        name, *options = MODELS.get(key) or TWO_FILE_MODELS[key]
        if len(paths) == 2:
            options += ["--weights-file", str(paths[1])]
        write_example_model(name, paths[0], options)
    return files


def write_example_model(name: str, out: Path, options: list[str]) -> None:
    result = CliRunner().invoke(
        ipuserve_cli, ["model", "example", name, str(out), *options], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    assert out.is_file(), result.output
