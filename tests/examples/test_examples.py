"""Every program in examples/ runs as a user would run it: a subprocess on a model
file written by ``ipuserve model example``.

The examples check their own results against numpy and exit non-zero on a
mismatch; these tests assert the exit status and the lines that say what was
checked. The subprocesses inherit the simulated-IPU environment of the autouse
``isolated_ipu_host`` fixture (private lock directory, no simulated time).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"

#: Generous: each example takes about a second; a hang must fail, not block.
RUN_TIMEOUT_S = 120


@dataclass(frozen=True)
class Case:
    example: str
    model: str
    args: tuple[str, ...] = ()
    #: line pattern -> how many lines of stdout must match it (re.fullmatch)
    lines: dict[str, int] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.example}-{self.model}{''.join(self.args)}"


CASES = [
    Case("execution_modes", "simple", lines={r"Verified against the numpy reference: output": 8}),
    Case(
        "execution_modes", "mlp", lines={r"Verified against the numpy reference: logits, probs": 8}
    ),
    Case("execution_modes", "noop", lines={r"Verified against the numpy reference: output": 8}),
    Case(
        "replication",
        "simple",
        lines={
            r"Verified against the numpy reference - replica 0": 1,
            r"Verified against the numpy reference - replica 1": 1,
        },
    ),
    Case(
        "multithreading", "simple", lines={r"Verified 20 results against the numpy reference\.": 1}
    ),
    Case(
        "frozen_inputs",
        "simple-weights-file",
        lines={
            r"\tname: tensor_A shape: \(1, 4\) dtype: float32": 1,
            r"Verified against the numpy reference \(A \* weights \+ frozen B\)\.": 2,
        },
    ),
    Case(
        "conditional_execution",
        "branches",
        lines={
            r"Request \d \(model 0\) returned: a_output": 3,
            r"Request \d \(model 1\) returned: b_output": 3,
            r"\tVerified (a|b)_output against the numpy reference\.": 7,
        },
    ),
    Case(
        "dynamic_batch_size",
        "simple-batch8",
        lines={
            r"\tReceived output output of shape \((1|2|3|4|5|7), 4\)": 7,
            r"\tVerified against the numpy reference\.": 7,
            r"7 requests with 23 samples and \d+ padded samples made \d+ batches of 8; "
            r"[1-9]\d* of them padded after the batch size timeout\.": 1,
        },
    ),
    Case(
        "dynamic_batch_size",
        "simple-batch8-dim1",
        ("--batching-dim", "1"),
        lines={
            r"\tReceived output output of shape \(4, (1|2|3|4|5|7)\)": 7,
            r"\tVerified against the numpy reference\.": 7,
        },
    ),
    Case(
        "flush_callback",
        "branches-batch4",
        lines={
            r"\tflush_callback: timed out waiting for tensor 'branch' while assembling "
            r"a batch for model 1; padding offered: branch \(3,\), b_input \(3, 8\)$": 1,
            r"\tflush_callback: timed out waiting for tensor 'branch' while assembling "
            r"a batch for model 0; padding offered: branch \(2,\), a_input \(2, 4\)$": 1,
            r"\tflush_callback: flushing only branch, b_input, b_output": 1,
            r"\tflush_callback: flushing only branch, a_input, a_output": 1,
            r"\tVerified (a|b)_output of shape \(\d, \d\) against the numpy reference\.": 4,
            r"flush_callback was called 2 times; 5 padded samples ran\.": 1,
        },
    ),
    Case(
        "monitoring",
        "simple",
        lines={
            r"Replica (0|1):": 2,
            r"\t\trequest_monitoring_statistics_percentile_us: \d+\.\d": 2,
            r"\t\tcomputation_monitoring_statistics_mean_us: \d+\.\d": 2,
            r"\t\trequest_duration_us: \d+\.\d": 2,
            r"\t\trequest_monitoring_statistics_count: 50\.0": 2,
            r"\tVerified: 50 requests counted in every phase\.": 2,
        },
    ),
]


def run_example(example: str, popef: list[Path], *args: str) -> subprocess.CompletedProcess[str]:
    script = EXAMPLES_DIR / f"model_runner_{example}.py"
    return subprocess.run(
        [sys.executable, str(script), "--popef", *map(str, popef), *args],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env=dict(os.environ),  # the isolated simulated-IPU host of tests/conftest.py
        cwd=EXAMPLES_DIR.parent,
        check=False,
    )


def describe(result: subprocess.CompletedProcess[str]) -> str:
    return (
        f"exit status {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    )


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_example_runs_and_verifies_its_results(
    case: Case, model_files: dict[str, list[Path]]
) -> None:
    result = run_example(case.example, model_files[case.model], *case.args)

    assert result.returncode == 0, describe(result)
    stdout_lines = result.stdout.splitlines()
    assert stdout_lines[-1] == "Success: exiting", describe(result)
    for pattern, count in case.lines.items():
        matching = [line for line in stdout_lines if re.fullmatch(pattern, line)]
        assert len(matching) == count, f"{pattern!r}: {len(matching)} lines\n{describe(result)}"
    assert "FAILED" not in result.stdout + result.stderr


def test_every_example_is_run() -> None:
    on_disk = {path.stem.removeprefix("model_runner_") for path in EXAMPLES_DIR.glob("*.py")}
    assert on_disk == {case.example for case in CASES}


def test_every_example_is_in_the_readme() -> None:
    readme = (EXAMPLES_DIR / "README.md").read_text()
    for path in EXAMPLES_DIR.glob("*.py"):
        assert f"`{path.name}`" in readme


def test_examples_use_the_private_simulated_host(
    model_files: dict[str, list[Path]], isolated_ipu_host: Path
) -> None:
    result = run_example("replication", model_files["simple"])

    assert result.returncode == 0, describe(result)
    assert sorted(p.name for p in isolated_ipu_host.iterdir()) == ["ipu0.lock", "ipu1.lock"]


def test_a_model_without_the_expected_anchor_fails(model_files: dict[str, list[Path]]) -> None:
    result = run_example("frozen_inputs", model_files["mlp"])

    assert result.returncode == 1, describe(result)
    assert "Anchor tensor_B not found" in result.stderr


def test_a_wrong_model_makes_the_example_exit_non_zero(
    model_files: dict[str, list[Path]],
) -> None:
    result = run_example("flush_callback", model_files["branches"])

    assert result.returncode == 1, describe(result)
    assert "FAILED: the model must be compiled for batches of 2 or more" in result.stderr


def test_the_popef_option_is_required() -> None:
    script = EXAMPLES_DIR / "model_runner_execution_modes.py"
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )

    assert result.returncode == 2
    assert "-p/--popef" in result.stderr


# -- the spec's listings, verbatim ---------------------------------------------------

LISTINGS_DIR = Path(__file__).resolve().parent / "spec_listings"

#: The only edit a listing gets: the spec's modules are ipuserve.runtime and its popef.
IMPORTS = {
    "import model_runtime\n": "import ipuserve.runtime as model_runtime\n",
    "import popef\n": "from ipuserve.runtime import popef\n",
}

#: listing (chapter 3's Python listings 3.2, 3.4, 3.6, 3.8) -> example model it runs on.
LISTINGS = {
    "model_runner_execution_modes": "mlp",
    "model_runner_replication": "simple",
    "model_runner_multithreading": "simple",
    # Its load_model() returns after the first file, so the weights must be in it.
    "model_runner_frozen_inputs": "simple",
}


def test_every_spec_listing_is_stored() -> None:
    stored = {path.name.removesuffix(".py.txt") for path in LISTINGS_DIR.glob("*.py.txt")}
    assert stored == set(LISTINGS)


@pytest.mark.parametrize("listing", sorted(LISTINGS))
def test_spec_listing_runs_with_only_its_imports_changed(
    listing: str, model_files: dict[str, list[Path]], tmp_path: Path
) -> None:
    """The spec's own text (tests/examples/spec_listings/, copied from chapter 3 without
    its line numbers) runs on ipuserve once its two imports name ipuserve's modules."""
    source = (LISTINGS_DIR / f"{listing}.py.txt").read_text()
    for spec_import, ours in IMPORTS.items():
        assert source.count(spec_import) == 1, spec_import
        source = source.replace(spec_import, ours)
    script = tmp_path / f"{listing}.py"
    script.write_text(source)

    result = subprocess.run(
        [sys.executable, str(script), "--popef", *map(str, model_files[LISTINGS[listing]])],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env=dict(os.environ),
        check=False,
    )

    assert result.returncode == 0, describe(result)
    assert result.stdout.splitlines()[-1] == "Success: exiting", describe(result)
