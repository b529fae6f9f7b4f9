"""The README's promises that can drift: the configuration reference, the two commands and
the runtime example."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ipuserve.face.cli import main
from ipuserve.face.config_reference import render
from ipuserve.runtime.popef import examples
from ipuserve.runtime.popef.container import write_model

README = Path(__file__).resolve().parent.parent / "README.md"
CI = Path(__file__).resolve().parent.parent / ".ci" / "run"


def test_configuration_reference_is_current() -> None:
    text = README.read_text()
    found = re.search(
        r"<!-- config-reference:start -->\n(.*)<!-- config-reference:end -->", text, re.S
    )
    assert found, "README.md lost its config-reference markers"
    assert found.group(1) == render(main), (
        "README.md's configuration reference is stale: regenerate it with "
        "`python -m ipuserve.face.config_reference --write README.md`"
    )


def test_ci_runs_the_readmes_test_command() -> None:
    commands = re.findall(r"^(python3 -m venv .*)$", README.read_text(), re.M)
    demo, tests = commands[:2]
    assert demo.endswith("ipuserve demo") and tests.endswith("pytest")
    assert tests in CI.read_text()


def test_the_components_import_from_the_checkouts_root_without_an_editable_install() -> None:
    """After `pip install .` (not -e), Python started in the checkout's root found this
    folder's ipuserve/ first, which holds none of the components. Editable installs
    hid it (their finder maps the components); the child here drops that finder."""
    root = README.parent
    code = (
        "import sys; sys.meta_path[:] = [f for f in sys.meta_path "
        "if 'editable' not in repr(f).lower()]\n"
        "import ipuserve.broker.loop, ipuserve.client.client, ipuserve.worker.node\n"
        "import ipuserve.bench.suite, ipuserve.face.cli\n"
        "import ipuserve.runtime.popef.container as container\n"
        "print(container.__file__)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(root / "runtime" / "popef" / "container.py")


def test_the_readmes_runtime_example_runs_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The snippet under "The runtime API", on the mlp.popef the README's tour writes:
    its outputs match the model's numpy reference and its statistics are not empty."""
    (snippet,) = [
        block
        for block in re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
        if "import ipuserve.runtime as model_runtime" in block
    ]
    model = examples.build("mlp")
    write_model(model, tmp_path / "mlp.popef")
    monkeypatch.chdir(tmp_path)
    names: dict[str, Any] = {}
    exec(compile(snippet, "README.md", "exec"), names)
    try:
        given = {"input": np.ones((5, 784), np.float32)}
        want = examples.reference("mlp", given, examples.tensor_arrays(model))
        np.testing.assert_allclose(names["future"]["probs"].numpy(), want["probs"], rtol=1e-5)
        assert names["stats"], "the statistics the snippet prints are empty"
    finally:
        names["runner"].close()
