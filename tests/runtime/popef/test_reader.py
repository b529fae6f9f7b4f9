"""Reader / ModelBuilder: the spec's usage, and blobs that do not make one model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ipuserve.errors import ModelFileError, PackageHashError
from ipuserve.runtime import popef
from ipuserve.runtime.popef import (
    Metadata,
    ProgramFlow,
    TensorData,
    examples,
    load_model,
    verify_package_hash,
    write_container,
    write_model,
)


def create_model_error(*paths: Path) -> str:
    reader = popef.Reader()
    for path in paths:
        reader.parseFile(path)
    with pytest.raises(ModelFileError) as caught:
        popef.ModelBuilder(reader).createModel()
    return str(caught.value)


def test_listing_3_8_usage(tmp_path: Path) -> None:
    path = write_model(examples.build("simple", batch_size=2), tmp_path / "simple.popef")[0]
    reader = popef.Reader()
    reader.parseFile(str(path))
    assert len(reader.metadata()) == 1 and len(reader.executables()) == 1
    model = popef.ModelBuilder(reader).createModel()

    tensor_b_anchor = popef.Anchor()
    for anchor in model.metadata.anchors():
        if anchor.name() == "tensor_B":
            tensor_b_anchor = anchor
            break
    info = tensor_b_anchor.tensorInfo()
    tensor_b = np.random.default_rng(0).standard_normal(info.shape()).astype(info.numpyDType())
    assert tensor_b.shape == (2, 4) and tensor_b.dtype == np.float32
    assert info.dataType() is popef.DataType.F32
    assert info.sizeInBytes() == 32
    assert model.popefContainsTensorData("weights")
    assert not model.popefContainsTensorData("tensor_B")


def test_a_model_split_over_two_files(tmp_path: Path) -> None:
    paths = write_model(examples.build("simple"), tmp_path / "m.popef", tmp_path / "w.popef")
    reader = popef.Reader()
    for path in paths:
        reader.parseFile(path)
    assert reader.paths() == [str(p) for p in paths]
    assert [t.name() for t in reader.tensorData()] == ["weights"]
    model = popef.ModelBuilder(reader).createModel()
    verify_package_hash(model)
    assert model.paths == reader.paths()


def test_metadata_without_its_executable(tmp_path: Path) -> None:
    model = examples.build("simple")
    meta_only = write_container(tmp_path / "meta.popef", metadata=model.metadata)
    weights = write_container(tmp_path / "w.popef", tensor_data=model.tensorData.values())
    message = create_model_error(meta_only, weights)
    assert "needs exactly one executable, named 'simple'; found none" in message
    assert f"{meta_only} (metadata 'simple')" in message
    assert f"{weights} (tensor data: weights)" in message


def test_tensor_data_alone_is_not_a_model(tmp_path: Path) -> None:
    model = examples.build("simple")
    weights = write_container(tmp_path / "w.popef", tensor_data=model.tensorData.values())
    assert (
        f"a model needs exactly one metadata blob, found 0 in: {weights} (tensor data: weights)"
    ) in create_model_error(weights)


def test_the_same_blob_twice(tmp_path: Path) -> None:
    path = write_model(examples.build("simple"), tmp_path / "s.popef")[0]
    copy = tmp_path / "copy.popef"
    copy.write_bytes(path.read_bytes())
    message = create_model_error(path, copy)
    assert f"metadata blob 'simple' appears 2 times: in {path} and {copy}" in message


def test_tensor_data_with_the_wrong_shape(tmp_path: Path) -> None:
    model = examples.build("simple")
    exe = write_container(
        tmp_path / "m.popef", metadata=model.metadata, executable=model.executable
    )
    bad = write_container(
        tmp_path / "w.popef", tensor_data=[TensorData("weights", np.zeros((2, 4), np.float32))]
    )
    assert (
        f"{bad}: tensor data blob 'weights': expected float32[4] (anchor 'weights'), "
        "found float32[2, 4]"
    ) in create_model_error(exe, bad)


def test_tensor_data_with_the_wrong_dtype(tmp_path: Path) -> None:
    model = examples.build("simple")
    exe = write_container(
        tmp_path / "m.popef",
        metadata=model.metadata,
        executable=model.executable,
        tensor_data=[TensorData("weights", np.zeros(4, np.float64))],
    )
    assert "expected float32[4] (anchor 'weights'), found float64[4]" in create_model_error(exe)


def test_tensor_data_for_no_anchor(tmp_path: Path) -> None:
    model = examples.build("simple")
    exe = write_container(
        tmp_path / "m.popef",
        metadata=model.metadata,
        executable=model.executable,
        tensor_data=[TensorData("bias", np.zeros(4, np.float32))],
    )
    assert (
        "tensor data blob 'bias': expected an input anchor of that name in the metadata "
        f"(in {exe}); its inputs are ['tensor_A', 'tensor_B', 'weights']"
    ) in create_model_error(exe)


def test_program_flow_naming_a_missing_program(tmp_path: Path) -> None:
    model = examples.build("noop")
    meta = model.metadata
    broken = Metadata(
        model_name="noop",
        executable="noop",
        anchors=meta.anchors(),
        program_flow=ProgramFlow([0], [7], [2]),
        executable_hash=meta.executableHash(),
    )
    path = write_container(tmp_path / "m.popef", metadata=broken, executable=model.executable)
    assert "names program 7, but executable 'noop'" in create_model_error(path)


def test_stream_of_an_unknown_anchor(tmp_path: Path) -> None:
    model = examples.build("noop")
    meta = model.metadata
    broken = Metadata(
        model_name="noop",
        executable="noop",
        anchors=[a for a in meta.anchors() if a.name() != "output"],
        program_flow=meta.programFlow(),
        executable_hash=meta.executableHash(),
    )
    path = write_container(tmp_path / "m.popef", metadata=broken, executable=model.executable)
    assert (
        "program 'main' streams 'output' with stream_out; expected an output anchor in the metadata"
    ) in create_model_error(path)


def test_package_hash_mismatch_names_both_hashes_and_files(tmp_path: Path) -> None:
    one, two = examples.build("simple"), examples.build("simple", batch_size=2)
    meta = write_container(
        tmp_path / "meta.popef", metadata=one.metadata, tensor_data=one.tensorData.values()
    )
    exe = write_container(tmp_path / "exe.popef", executable=two.executable)
    model = load_model([meta, exe])  # createModel leaves the hash to the Session
    with pytest.raises(PackageHashError) as caught:
        verify_package_hash(model)
    message = str(caught.value)
    assert f"(in {meta}) expects executable hash {one.executable.hash()}" in message
    assert f"(in {exe}) has hash {two.executable.hash()}" in message
    assert isinstance(caught.value, ModelFileError)


def test_matching_hashes_pass(tmp_path: Path) -> None:
    verify_package_hash(load_model(write_model(examples.build("branches"), tmp_path / "b")))
    verify_package_hash(examples.build("branches"))


def test_parse_file_errors_surface_at_parse_time(tmp_path: Path) -> None:
    bad = tmp_path / "bad.popef"
    bad.write_bytes(b"PK\x03\x04 nope")
    reader = popef.Reader()
    with pytest.raises(ModelFileError, match=str(bad)):
        reader.parseFile(bad)
    assert reader.paths() == []
