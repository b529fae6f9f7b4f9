"""Model files: round trips, and every way a file can be broken."""

from __future__ import annotations

import json
import os
import re
import stat
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ipuserve.errors import ModelFileError
from ipuserve.runtime.popef import Model, examples, load_model, read_container, write_model
from tests.runtime.popef.helpers import Host, edit_json, npy_bytes, rewrite_zip

SMALL = {
    "simple": {"batch_size": 2},
    "noop": {"elements": 8},
    "branches": {"batch_size": 2},
    "mlp": {"batch_size": 2, "input_size": 8, "hidden_size": 16, "outputs": 4},
}


def assert_same_model(read: Model, built: Model) -> None:
    assert read.executable.hash() == built.executable.hash()
    assert read.executable.programs() == built.executable.programs()
    assert read.executable.stateTensors() == built.executable.stateTensors()
    assert read.executable.memoryBytes() == built.executable.memoryBytes()
    assert read.executable.zeroTime() == built.executable.zeroTime()
    assert read.metadata.executableHash() == built.metadata.executableHash()
    assert read.metadata.batchSize() == built.metadata.batchSize()
    assert [repr(a) for a in read.metadata.anchors()] == [repr(a) for a in built.metadata.anchors()]
    assert sorted(read.tensorData) == sorted(built.tensorData)
    for name, data in built.tensorData.items():
        np.testing.assert_array_equal(read.tensorData[name].array(), data.array())
        assert read.tensorData[name].array().dtype == data.array().dtype
        assert not read.tensorData[name].array().flags.writeable


@pytest.mark.parametrize("name", sorted(SMALL))
@pytest.mark.parametrize("split", [False, True], ids=["one-file", "split"])
def test_round_trip(tmp_path: Path, name: str, split: bool) -> None:
    built = examples.build(name, **SMALL[name])
    weights = tmp_path / "weights.popef" if split else None
    paths = write_model(built, tmp_path / "model.popef", weights)
    assert len(paths) == (2 if split else 1)
    read = load_model(paths)
    assert_same_model(read, built)
    assert read.paths == [str(p) for p in paths]
    # and the model read back computes what the reference says
    host = Host(read)
    host.run("load")
    inputs = examples.sample_inputs(read, seed=5)
    outputs = host.run("main", inputs)
    for key, value in examples.reference(name, inputs, examples.tensor_arrays(read)).items():
        np.testing.assert_allclose(outputs[key], value, rtol=1e-5, atol=1e-6)


def test_default_mlp_round_trips(tmp_path: Path) -> None:
    built = examples.build("mlp")
    assert_same_model(load_model(write_model(built, tmp_path / "mlp.popef")), built)


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_a_written_model_has_the_mode_the_umask_gives(tmp_path: Path, umask: int) -> None:
    """Like any file the user creates (mkstemp alone would make every model 0600)."""
    previous = os.umask(umask)
    try:
        (path,) = write_model(examples.build("simple"), tmp_path / "simple.popef")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask


def test_split_files_hold_what_they_should(tmp_path: Path) -> None:
    model_path, weights_path = write_model(
        examples.build("simple"), tmp_path / "m.popef", tmp_path / "w.popef"
    )
    model_file, weights_file = read_container(model_path), read_container(weights_path)
    assert (len(model_file.metadata), len(model_file.executables), len(model_file.tensor_data)) == (
        1,
        1,
        0,
    )
    assert (
        len(weights_file.metadata),
        len(weights_file.executables),
        [t.name() for t in weights_file.tensor_data],
    ) == (0, 0, ["weights"])


# -- broken files ---------------------------------------------------------------------


@pytest.fixture
def simple_file(tmp_path: Path) -> Path:
    return write_model(examples.build("simple"), tmp_path / "simple.popef")[0]


def read_error(path: Path) -> str:
    with pytest.raises(ModelFileError) as caught:
        read_container(path)
    message = str(caught.value)
    assert message.startswith(str(path)), message
    return message


def test_not_a_zip(tmp_path: Path) -> None:
    path = tmp_path / "text.popef"
    path.write_text("hello")
    assert "not a readable model file" in read_error(path)


def test_truncated_file(simple_file: Path) -> None:
    raw = simple_file.read_bytes()
    simple_file.write_bytes(raw[: len(raw) // 2])
    assert "truncated" in read_error(simple_file)


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.popef"
    path.write_bytes(b"")
    read_error(path)


def test_missing_file(tmp_path: Path) -> None:
    assert "no such model file" in read_error(tmp_path / "absent.popef")


def flip_memory_bytes(members: dict[str, bytes]) -> None:
    """Change the executable's memory_bytes without changing the member's size."""
    raw = members["executable.json"]
    digits = re.search(rb'"memory_bytes":(\d+)', raw)
    assert digits is not None
    tampered = str(int(digits[1]) + 1).encode()
    assert len(tampered) == len(digits[1])
    members["executable.json"] = raw.replace(digits[0], b'"memory_bytes":' + tampered)


def test_tampered_member_fails_its_checksum(simple_file: Path) -> None:
    rewrite_zip(simple_file, flip_memory_bytes)
    message = read_error(simple_file)
    assert "executable blob 'simple' (executable.json): sha256 mismatch: expected " in message
    assert "(from the index), found " in message


def test_member_of_the_wrong_size(simple_file: Path) -> None:
    rewrite_zip(simple_file, lambda m: m.update({"metadata.json": m["metadata.json"] + b" "}))
    assert re.search(
        r"metadata blob 'simple' \(metadata.json\): expected (\d+) bytes "
        r"\(from the index\), found (\d+)",
        read_error(simple_file),
    )


def test_tampered_member_with_fixed_index_fails_the_content_hash(simple_file: Path) -> None:
    rewrite_zip(simple_file, flip_memory_bytes, fix_index=True)
    assert "executable blob 'simple' (executable.json): content hash mismatch" in read_error(
        simple_file
    )


def test_missing_member(simple_file: Path) -> None:
    rewrite_zip(simple_file, lambda m: m.pop("tensor_data/0000.npy"))
    assert (
        "tensor data blob 'weights': member 'tensor_data/0000.npy' is listed in the index "
        "but missing"
    ) in read_error(simple_file)


def test_missing_index(simple_file: Path) -> None:
    rewrite_zip(simple_file, lambda m: m.pop("index.json"))
    assert "the index: member 'index.json' is missing" in read_error(simple_file)


def test_unlisted_member(simple_file: Path) -> None:
    rewrite_zip(simple_file, lambda m: m.update({"extra.bin": b"x"}))
    assert "members not listed in the index: ['extra.bin']" in read_error(simple_file)


def test_unknown_format_version(simple_file: Path) -> None:
    rewrite_zip(
        simple_file, lambda m: edit_json(m, "index.json", lambda doc: doc.update(format_version=99))
    )
    assert "format version 99 is not supported (this reader reads version 1)" in read_error(
        simple_file
    )


def test_wrong_format_name(simple_file: Path) -> None:
    rewrite_zip(
        simple_file, lambda m: edit_json(m, "index.json", lambda doc: doc.update(format="onnx"))
    )
    assert "format is 'onnx', expected 'ipuserve-popef'" in read_error(simple_file)


def test_malformed_json(simple_file: Path) -> None:
    rewrite_zip(simple_file, lambda m: m.update({"metadata.json": b"{not json"}), fix_index=True)
    with pytest.raises(
        ModelFileError,
        match=r"metadata blob 'simple' \(metadata.json\): "
        r"malformed JSON",
    ) as caught:
        read_container(simple_file)
    assert isinstance(caught.value.__cause__, ValueError)  # chained, not swallowed


def test_field_of_the_wrong_type(simple_file: Path) -> None:
    def break_anchor(doc: Any) -> None:
        doc["anchors"][0]["dtype"] = "complex64"

    rewrite_zip(simple_file, lambda m: edit_json(m, "metadata.json", break_anchor), fix_index=True)
    assert "anchor 'tensor_A': field 'dtype' is 'complex64', expected one of" in read_error(
        simple_file
    )


def test_unknown_op_in_a_step(simple_file: Path) -> None:
    def break_step(doc: Any) -> None:
        doc["programs"][1]["steps"][2]["op"] = "conv2d"

    rewrite_zip(simple_file, lambda m: edit_json(m, "executable.json", break_step), fix_index=True)
    assert "program 'main' step 2: unknown op 'conv2d'" in read_error(simple_file)


def test_npy_disagreeing_with_the_index(simple_file: Path) -> None:
    rewrite_zip(
        simple_file,
        lambda m: m.update({"tensor_data/0000.npy": npy_bytes(np.zeros(5, np.float32))}),
        fix_index=True,
    )
    assert (
        "tensor data blob 'weights' (tensor_data/0000.npy): expected float32[4] "
        "(from the index), found float32[5]"
    ) in read_error(simple_file)


def test_pickled_npy_is_refused(simple_file: Path) -> None:
    pickled = npy_bytes(np.array([{"evil": 1}], dtype=object), allow_pickle=True)
    rewrite_zip(simple_file, lambda m: m.update({"tensor_data/0000.npy": pickled}), fix_index=True)
    assert "not a readable .npy array" in read_error(simple_file)


def test_writing_is_atomic_and_leaves_no_temporaries(tmp_path: Path) -> None:
    write_model(examples.build("noop"), tmp_path / "noop.popef")
    assert [p.name for p in tmp_path.iterdir()] == ["noop.popef"]
    with zipfile.ZipFile(tmp_path / "noop.popef") as archive:
        index = json.loads(archive.read("index.json"))
    assert index["format"] == "ipuserve-popef" and index["format_version"] == 1
    assert [(b["kind"], b["member"]) for b in index["blobs"]] == [
        ("metadata", "metadata.json"),
        ("executable", "executable.json"),
    ]
