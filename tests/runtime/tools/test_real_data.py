"""``ipuserve tools real-data``: outputs match the numpy references; errors name file and tensor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ipuserve.npy_io import NpyInput, output_paths
from ipuserve.progress import Progress
from ipuserve.runtime import DeviceManager, ModelRunner
from ipuserve.runtime.popef import examples, load_model
from ipuserve.runtime.tools.real_data import RealDataConfig, run_real_data

from .conftest import MLP_OPTS, all_ipus_free, invoke, invoke_json, one_line_error

Array = np.ndarray[Any, Any]


def save(folder: Path, **arrays: Array) -> list[str]:
    """Save each array as FOLDER/NAME.npy; returns the ``--input NAME=FILE`` arguments."""
    folder.mkdir(parents=True, exist_ok=True)
    args = []
    for name, array in arrays.items():
        path = folder / f"{name}.npy"
        np.save(path, array)
        args += ["--input", f"{name}={path}"]
    return args


def expected(name: str, files: list[Path], inputs: dict[str, Array]) -> dict[str, Array]:
    model = load_model(files)
    return examples.reference(name, inputs, examples.tensor_arrays(model))


def simple_inputs(samples: int, seed: int = 0) -> dict[str, Array]:
    rng = np.random.default_rng(seed)
    return {
        name: rng.standard_normal((samples, 4)).astype(np.float32)
        for name in ("tensor_A", "tensor_B")
    }


def test_simple_outputs_match_the_reference(simple_file: Path, tmp_path: Path) -> None:
    inputs = simple_inputs(8)  # two compiled batches of 4
    out = tmp_path / "out"
    result = invoke(
        "real-data", "--popef", str(simple_file), *save(tmp_path, **inputs),
        "--output-dir", str(out),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    written = np.load(out / "output.npy")
    want = expected("simple", [simple_file], inputs)["output"]
    assert written.dtype == np.float32 and written.shape == (8, 4)
    np.testing.assert_allclose(written, want, rtol=1e-6, atol=1e-6)
    assert sorted(p.name for p in out.iterdir()) == ["output.npy"]
    # The summary shows what was written.
    assert "output" in result.stdout and f"{out / 'output.npy'}" in result.stdout
    assert f"min {written.min():.6g}" in result.stdout
    assert f"max {written.max():.6g}" in result.stdout


def test_mlp_from_two_files_matches_the_reference(
    mlp_files: tuple[Path, Path], tmp_path: Path
) -> None:
    x = np.random.default_rng(1).standard_normal((8, MLP_OPTS["input_size"])).astype(np.float32)
    report = invoke_json(
        "real-data", "--popef", str(mlp_files[0]), "--popef", str(mlp_files[1]),
        *save(tmp_path, input=x), "--output-dir", str(tmp_path / "out"),
    )  # fmt: skip
    want = expected("mlp", list(mlp_files), {"input": x})
    for name in ("logits", "probs"):
        written = np.load(tmp_path / "out" / f"{name}.npy")
        np.testing.assert_allclose(written, want[name], rtol=1e-4, atol=1e-5)
        summary = report["outputs"][name]
        assert summary["shape"] == [8, MLP_OPTS["outputs"]] and summary["dtype"] == "float32"
        assert summary["min"] == pytest.approx(float(written.min()))
        assert summary["max"] == pytest.approx(float(written.max()))
        assert summary["mean"] == pytest.approx(float(written.astype(np.float64).mean()))
    assert report["inputs"]["input"]["file"].endswith("input.npy")
    assert report["runs"] == 1 and report["run_us"]["count"] == 1


def test_any_batch_size_with_batching_dim(simple_file: Path, tmp_path: Path) -> None:
    inputs = simple_inputs(3, seed=2)  # not a multiple of the compiled batch of 4
    args = ["real-data", "--popef", str(simple_file), *save(tmp_path, **inputs)]
    refused = one_line_error(invoke(*args, "--output-dir", str(tmp_path)))
    assert "tensor_A.npy" in refused and "'tensor_A'" in refused
    assert "--batching-dim" in refused
    result = invoke(*args, "--batching-dim", "0", "--output-dir", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    written = np.load(tmp_path / "out" / "output.npy")
    assert written.shape == (3, 4)
    want = expected("simple", [simple_file], inputs)["output"]
    np.testing.assert_allclose(written, want, rtol=1e-6, atol=1e-6)


def test_replicas_and_runs_give_identical_outputs(simple_file: Path, tmp_path: Path) -> None:
    inputs = simple_inputs(4)
    report = invoke_json(
        "real-data", "--popef", str(simple_file), *save(tmp_path, **inputs),
        "--replicas", "2", "--runs", "5", "--output-dir", str(tmp_path / "out"),
    )  # fmt: skip
    assert report["runs"] == 5 and report["replicas"] == 2
    assert report["run_us"]["count"] == 5
    assert report["identical_across_runs"] is True
    assert all_ipus_free()


def test_outputs_default_to_the_current_directory_on_ipu_models(
    simple_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    inputs = simple_inputs(4)
    holder = DeviceManager().getDevice(4)  # no IPU is free: IPU Models need none
    try:
        report = invoke_json(
            "real-data", "--popef", str(simple_file), "--ipu-model", "--replicas", "2",
            *save(Path("inputs-here"), **inputs),
        )  # fmt: skip
    finally:
        holder.detach()
    assert report["ipu_model"] is True
    assert report["outputs"]["output"]["file"] == "output.npy"
    written = np.load(tmp_path / "output.npy")
    want = expected("simple", [simple_file], inputs)["output"]
    np.testing.assert_allclose(written, want, rtol=1e-6, atol=1e-6)


def test_output_names_become_safe_file_names(tmp_path: Path) -> None:
    paths = output_paths(["logits", "layer/0:out"], tmp_path)
    assert paths["layer/0:out"] == tmp_path / "layer_0_out.npy"
    with pytest.raises(Exception, match="would both be written"):
        output_paths(["a/b", "a_b"], tmp_path)


def test_ctrl_c_after_a_run_keeps_what_completed(simple_file: Path, tmp_path: Path) -> None:
    inputs = {n: NpyInput(n, tmp_path / f"{n}.npy", a) for n, a in simple_inputs(4).items()}

    def interrupt_after_two(progress: Progress) -> None:
        if progress.done == 2:
            raise KeyboardInterrupt

    config = RealDataConfig(popef=(str(simple_file),), runs=10**6, output_dir=tmp_path / "out")
    report = run_real_data(config, inputs, interrupt_after_two)
    assert report["interrupted"] is True and report["runs"] == 2
    assert (tmp_path / "out" / "output.npy").is_file()
    assert all_ipus_free()


def test_ctrl_c_before_any_run_completes_propagates_and_frees_the_ipus(
    simple_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inputs = {n: NpyInput(n, tmp_path / f"{n}.npy", a) for n, a in simple_inputs(4).items()}

    def interrupted_submit(*_args: object, **_kwargs: object) -> None:
        raise KeyboardInterrupt  # Ctrl-C lands while the first request is submitted

    monkeypatch.setattr(ModelRunner, "executeAsync", interrupted_submit)
    config = RealDataConfig(popef=(str(simple_file),), runs=3, output_dir=tmp_path / "out")
    with pytest.raises(KeyboardInterrupt):
        run_real_data(config, inputs)
    assert not (tmp_path / "out").exists()  # nothing ran, nothing is written
    assert all_ipus_free()


# -- errors: one line, naming the file and the tensor ---------------------------------------


def test_missing_input_is_named(simple_file: Path, tmp_path: Path) -> None:
    args = save(tmp_path, tensor_A=simple_inputs(4)["tensor_A"])
    error = one_line_error(invoke("real-data", "--popef", str(simple_file), *args))
    assert "missing input" in error and "tensor_B" in error


def test_unknown_input_names_file_and_tensor(simple_file: Path, tmp_path: Path) -> None:
    args = save(tmp_path, **simple_inputs(4), tensor_C=np.zeros((4, 4), np.float32))
    error = one_line_error(invoke("real-data", "--popef", str(simple_file), *args))
    assert str(tmp_path / "tensor_C.npy") in error and "'tensor_C'" in error
    assert "tensor_A, tensor_B" in error


def test_wrong_dtype_names_file_and_tensor(simple_file: Path, tmp_path: Path) -> None:
    inputs = simple_inputs(4)
    inputs["tensor_B"] = inputs["tensor_B"].astype(np.float64)
    error = one_line_error(
        invoke("real-data", "--popef", str(simple_file), *save(tmp_path, **inputs))
    )
    assert str(tmp_path / "tensor_B.npy") in error and "'tensor_B'" in error
    assert "float32" in error and "float64" in error


@pytest.mark.parametrize(
    ("contents", "reason"),
    [
        (b"just some text\n", "not a .npy file"),
        (b"PK\x03\x04 an archive", "zip archive (an .npz?)"),
        (b"\x93NUMPY\x01\x00\x76\x00{'descr'", "EOF"),
        (None, "no such file"),
    ],
    ids=["text", "npz", "truncated", "missing"],
)
def test_unreadable_npy_names_file_and_tensor(
    simple_file: Path, tmp_path: Path, contents: bytes | None, reason: str
) -> None:
    bad = tmp_path / "bad.npy"
    if contents is not None:
        bad.write_bytes(contents)
    args = save(tmp_path, tensor_B=simple_inputs(4)["tensor_B"])
    error = one_line_error(
        invoke("real-data", "--popef", str(simple_file), "--input", f"tensor_A={bad}", *args)
    )
    assert str(bad) in error and "'tensor_A'" in error and reason in error


def test_pickled_npy_is_never_loaded(simple_file: Path, tmp_path: Path) -> None:
    bad = tmp_path / "objects.npy"
    np.save(bad, np.array([{"x": 1}, None], dtype=object), allow_pickle=True)
    error = one_line_error(
        invoke("real-data", "--popef", str(simple_file), "--input", f"tensor_A={bad}")
    )
    assert str(bad) in error and "allow_pickle=False" in error


def test_corrupt_model_file_is_one_line(simple_file: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken.popef"
    broken.write_bytes(simple_file.read_bytes()[:200])
    args = save(tmp_path, **simple_inputs(4))
    error = one_line_error(invoke("real-data", "--popef", str(broken), *args))
    assert str(broken) in error


def test_bad_input_option_is_a_usage_error(simple_file: Path) -> None:
    result = invoke("real-data", "--popef", str(simple_file), "--input", "tensor_A")
    assert result.exit_code == 2
    assert "NAME=FILE.npy" in result.stderr


def test_unwritable_output_dir_is_one_line(simple_file: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("in the way")
    args = save(tmp_path, **simple_inputs(4))
    error = one_line_error(
        invoke("real-data", "--popef", str(simple_file), *args, "--output-dir", str(blocker / "x"))
    )
    assert str(blocker) in error
