"""``ipuserve model example`` and ``ipuserve model inspect``, through the root command."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner, Result

from ipuserve.face.cli import main
from ipuserve.runtime.popef import examples, load_model, write_container
from ipuserve.runtime.simulator.cost import LAUNCH_SECONDS, CostModel, ipu_spec


def invoke(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(main, ["model", *args], env=env)


def test_example_writes_a_loadable_model(tmp_path: Path) -> None:
    out = tmp_path / "simple.popef"
    result = invoke("example", "simple", str(out), "--batch-size", "3", "--seed", "4")
    assert result.exit_code == 0, result.output
    assert f"{out}: metadata, executable, tensor data (1 tensor)" in result.output
    model = load_model(out)
    assert model.metadata.batchSize() == 3
    np.testing.assert_array_equal(
        model.tensorData["weights"].array(),
        examples.build("simple", seed=4).tensorData["weights"].array(),
    )


def test_example_with_a_weights_file(tmp_path: Path) -> None:
    out, weights = tmp_path / "mlp.popef", tmp_path / "mlp-weights.popef"
    result = invoke(
        "example",
        "mlp",
        str(out),
        "--weights-file",
        str(weights),
        "--input-size",
        "8",
        "--hidden-size",
        "16",
        "--layers",
        "1",
        "--outputs",
        "3",
        "--dtype",
        "float16",
    )
    assert result.exit_code == 0, result.output
    assert f"{out}: metadata, executable\n" in result.output
    assert f"{weights}: tensor data (4 tensors)" in result.output
    model = load_model([out, weights])
    assert model.metadata.anchor("input").tensorInfo().shape() == [16, 8]
    assert model.metadata.anchor("logits").tensorInfo().numpyDType() == np.float16


def test_batch_size_from_the_environment(tmp_path: Path) -> None:
    out = tmp_path / "noop.popef"
    result = invoke("example", "noop", str(out), env={"IPUSERVE_MODEL_EXAMPLE_BATCH_SIZE": "5"})
    assert result.exit_code == 0, result.output
    assert load_model(out).metadata.batchSize() == 5


def test_options_of_other_examples_are_refused(tmp_path: Path) -> None:
    result = invoke("example", "noop", str(tmp_path / "n.popef"), "--hidden-size", "3")
    assert result.exit_code == 2
    assert "--hidden-size does not apply to the 'noop' example" in result.output
    assert not (tmp_path / "n.popef").exists()
    from_env = invoke(
        "example", "simple", str(tmp_path / "s.popef"), env={"IPUSERVE_MODEL_EXAMPLE_LAYERS": "3"}
    )
    assert from_env.exit_code == 2
    assert "--layers does not apply to the 'simple' example" in from_env.output


def test_invalid_example_option_is_a_clean_error(tmp_path: Path) -> None:
    result = invoke("example", "mlp", str(tmp_path / "m.popef"), "--dtype", "int32")
    assert result.exit_code == 1
    assert "Error: mlp dtype must be float16 or float32, got 'int32'" in result.output


def test_help_shows_env_vars_and_defaults() -> None:
    text = " ".join(invoke("example", "--help").output.split())
    assert (
        "--elements INTEGER RANGE noop: elements per sample (1048576 float32 = 4 MiB). "
        "[env var: IPUSERVE_MODEL_EXAMPLE_ELEMENTS; default: 1024; x>=1]" in text
    )
    assert (
        "IPUSERVE_MODEL_EXAMPLE_BATCH_SIZE; default: (simple, noop, branches: 1; mlp: 16)" in text
    )


def section(text: str, title: str) -> list[str]:
    """The lines under ``title`` up to the next blank line."""
    lines = text.splitlines()
    start = lines.index(title) + 1
    end = lines.index("", start) if "" in lines[start:] else len(lines)
    return lines[start:end]


@pytest.fixture
def branches_file(tmp_path: Path) -> Path:
    path = tmp_path / "branches.popef"
    assert invoke("example", "branches", str(path), "--batch-size", "2").exit_code == 0
    return path


def test_inspect_prints_the_model(branches_file: Path) -> None:
    result = invoke("inspect", str(branches_file))
    assert result.exit_code == 0, result.output
    out = result.output
    model = load_model(branches_file)
    assert f"Model branches  ({branches_file})" in out
    assert f"sha256 {model.executable.hash()} (matches the metadata)" in out
    assert "1 x Mk2 (GC200) (version 2)" in out
    assert "batch size    2 (compiled)" in out
    assert "program flow  load [0]  main [1]  save [2]" in out
    anchor_rows = {line.split()[0]: line.split() for line in section(out, "Anchors")}
    assert len(anchor_rows) == 1 + 7  # header + anchors
    assert anchor_rows["a_weight"][1:] == [
        "a_weight",
        "input",
        "float32",
        "[4,",
        "4]",
        "64",
        "B",
        "0",
        "yes",
    ]
    assert anchor_rows["b_output"][2:4] == ["output", "float32"]
    assert anchor_rows["b_output"][-1] == "no"
    assert "-- fits" in out


def test_inspect_json(branches_file: Path) -> None:
    result = invoke("inspect", str(branches_file), "--json")
    assert result.exit_code == 0, result.output
    described = json.loads(result.output)
    model = load_model(branches_file)
    main_program = model.executable.program(1)
    switch = main_program.steps[1]
    branch_flops = [sum(s.flops for s in b) for b in switch.branches]
    branch_bytes = [sum(s.host_bytes for s in b) for b in switch.branches]
    main = described["programs"][1]
    assert main["name"] == "main" and main["phase"] == "main"
    assert main["flops"] == max(branch_flops)
    assert main["host_bytes"] == main_program.steps[0].host_bytes + max(branch_bytes)
    expected_seconds = CostModel(ipu_spec(2), 1, 1.0).program_seconds(main_program)
    assert main["estimated_seconds"] == pytest.approx(expected_seconds)
    assert main["launch_seconds"] == LAUNCH_SECONDS  # the part no time scale changes
    assert described["batch_size"] == 2 and described["ipus"] == 1
    assert described["executable"]["hash_matches"] is True
    assert {a["name"]: a["tensor_data"] for a in described["anchors"]}["b_weight"] is True
    assert [t["name"] for t in described["tensor_data"]] == ["a_weight", "b_weight"]
    assert described["memory"]["needed_bytes"] == model.executable.memoryBytes()
    assert described["memory"]["ipu_bytes"] == ipu_spec(2).memory_bytes


def test_inspect_zero_time_model(tmp_path: Path) -> None:
    path = tmp_path / "noop.popef"
    invoke("example", "noop", str(path))
    described = json.loads(invoke("inspect", str(path), "--json").output)
    assert described["executable"]["zero_time"] is True
    assert {p["estimated_seconds"] for p in described["programs"]} == {0.0}
    assert {p["launch_seconds"] for p in described["programs"]} == {0.0}


def test_inspect_flags_a_hash_mismatch_without_failing(tmp_path: Path) -> None:
    one, two = examples.build("noop"), examples.build("noop", batch_size=2)
    meta = write_container(tmp_path / "meta.popef", metadata=one.metadata)
    exe = write_container(tmp_path / "exe.popef", executable=two.executable)
    result = invoke("inspect", str(meta), str(exe))
    assert result.exit_code == 0, result.output
    assert f"MISMATCH: the metadata expects {one.executable.hash()}" in result.output


def test_inspect_bad_file_is_one_line_and_exit_1(tmp_path: Path) -> None:
    bad = tmp_path / "bad.popef"
    bad.write_text("not a model")
    result = invoke("inspect", str(bad))
    assert result.exit_code == 1
    assert result.output.count("\n") == 1
    assert result.output.startswith(f"Error: {bad}: not a readable model file")
    assert "Traceback" not in result.output


def test_inspect_incomplete_model_explains_what_it_found(tmp_path: Path) -> None:
    weights = write_container(
        tmp_path / "w.popef", tensor_data=examples.build("simple").tensorData.values()
    )
    result = invoke("inspect", str(weights))
    assert result.exit_code == 1
    assert "a model needs exactly one metadata blob, found 0" in result.output
