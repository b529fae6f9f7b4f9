"""Reading models: ``Reader`` gathers blobs from files, ``ModelBuilder`` assembles a Model.

This mirrors the real ``popef`` bindings (listing 3.8 of the spec)::

    reader = popef.Reader()
    for path in paths:
        reader.parseFile(path)        # validates the file; raises ModelFileError
    model = popef.ModelBuilder(reader).createModel()

``createModel`` checks that the blobs make one consistent model. It does *not*
compare the metadata's executable hash with the executable: that is the Session's
``check_package_hash`` option, done with :func:`verify_package_hash`.
"""

from __future__ import annotations

import os
import weakref
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path

from ipuserve.errors import ModelFileError, PackageHashError
from ipuserve.runtime.popef.container import ContainerContents, read_container
from ipuserve.runtime.popef.types import (
    Anchor,
    Executable,
    Metadata,
    Model,
    Step,
    TensorData,
    TensorInfo,
    TensorType,
)

PathLike = str | os.PathLike[str]

#: Which file each metadata / executable came from, for error messages.
_sources: weakref.WeakKeyDictionary[Metadata | Executable, str] = weakref.WeakKeyDictionary()


class Reader:
    """Accumulates the blobs of one or more model files."""

    def __init__(self) -> None:
        self._files: list[ContainerContents] = []

    def parseFile(self, path: PathLike) -> None:
        """Read and validate ``path``; its blobs join those of earlier files."""
        contents = read_container(path)
        for metadata in contents.metadata:
            _sources[metadata] = str(contents.path)
        for executable in contents.executables:
            _sources[executable] = str(contents.path)
        self._files.append(contents)

    def metadata(self) -> list[Metadata]:
        return [m for f in self._files for m in f.metadata]

    def executables(self) -> list[Executable]:
        return [e for f in self._files for e in f.executables]

    def tensorData(self) -> list[TensorData]:
        return [t for f in self._files for t in f.tensor_data]

    def paths(self) -> list[str]:
        return [str(f.path) for f in self._files]

    def files(self) -> list[ContainerContents]:
        """What each parsed file held (ipuserve extension, used for error messages)."""
        return list(self._files)


class ModelBuilder:
    """Assembles a :class:`Model` from a Reader's blobs, checking they fit together."""

    def __init__(self, reader: Reader) -> None:
        self._reader = reader

    def createModel(self) -> Model:
        files = self._reader.files()
        _check_no_duplicates(files)
        metadata = _single_metadata(files)
        executable = _executable_for(metadata, files)
        _check_program_flow(metadata, executable)
        _check_streams(metadata, executable)
        tensor_data = {t.name(): t for f in files for t in f.tensor_data}
        for contents in files:
            for data in contents.tensor_data:
                _check_tensor_data(data, metadata, contents.path)
        return Model(metadata, executable, tensor_data, self._reader.paths())


def load_model(paths: PathLike | Iterable[PathLike]) -> Model:
    """Read one file or several that together hold one model."""
    reader = Reader()
    for path in [paths] if isinstance(paths, str | os.PathLike) else paths:
        reader.parseFile(path)
    return ModelBuilder(reader).createModel()


def verify_package_hash(model: Model) -> None:
    """PackageHashError unless the metadata was written for this very executable."""
    expected, actual = model.metadata.executableHash(), model.executable.hash()
    if expected != actual:
        raise PackageHashError(
            f"package hash mismatch: the metadata of model {model.metadata.modelName()!r} "
            f"(in {source_of(model.metadata)}) expects executable hash {expected}, but "
            f"executable {model.executable.name()!r} (in {source_of(model.executable)}) "
            f"has hash {actual}"
        )


def source_of(blob: Metadata | Executable) -> str:
    """The file a metadata or executable was read from ("memory" if it was built)."""
    return _sources.get(blob, "memory")


# -- checks ---------------------------------------------------------------------------


def _found(files: list[ContainerContents]) -> str:
    return "; ".join(f.describe() for f in files) or "no files"


def _check_no_duplicates(files: list[ContainerContents]) -> None:
    seen: defaultdict[tuple[str, str], list[str]] = defaultdict(list)
    for contents in files:
        for kind, name in _blob_names(contents):
            seen[kind, name].append(str(contents.path))
    for (kind, name), where in seen.items():
        if len(where) > 1:
            raise ModelFileError(
                f"{kind} blob {name!r} appears {len(where)} times: in "
                f"{' and '.join(where)}; a model may hold each blob once"
            )


def _blob_names(contents: ContainerContents) -> Iterator[tuple[str, str]]:
    yield from (("metadata", m.executable()) for m in contents.metadata)
    yield from (("executable", e.name()) for e in contents.executables)
    yield from (("tensor data", t.name()) for t in contents.tensor_data)


def _single_metadata(files: list[ContainerContents]) -> Metadata:
    found = [m for f in files for m in f.metadata]
    if len(found) != 1:
        raise ModelFileError(
            f"a model needs exactly one metadata blob, found {len(found)} in: {_found(files)}"
        )
    return found[0]


def _executable_for(metadata: Metadata, files: list[ContainerContents]) -> Executable:
    found = [e for f in files for e in f.executables]
    names = [e.name() for e in found]
    if names != [metadata.executable()]:
        raise ModelFileError(
            f"the metadata (in {source_of(metadata)}) needs exactly one executable, named "
            f"{metadata.executable()!r}; found {names or 'none'} in: {_found(files)}"
        )
    return found[0]


def _check_program_flow(metadata: Metadata, executable: Executable) -> None:
    flow = metadata.programFlow()
    count = len(executable.programs())
    for index in [*flow.load(), *flow.main(), *flow.save()]:
        if not 0 <= index < count:
            raise ModelFileError(
                f"the program flow (in {source_of(metadata)}) names program {index}, but "
                f"executable {executable.name()!r} (in {source_of(executable)}) has {count}"
            )


def _check_streams(metadata: Metadata, executable: Executable) -> None:
    anchors = {a.name(): a for a in metadata.anchors()}
    wanted = {"stream_in": TensorType.INPUT, "stream_out": TensorType.OUTPUT}
    for program in executable.programs():
        for step in _walk(program.steps):
            if step.op not in wanted:
                continue
            anchor = anchors.get(step.anchor or "")
            if anchor is None or anchor.type() is not wanted[step.op]:
                found = "no such anchor" if anchor is None else f"an {anchor.type().value} anchor"
                raise ModelFileError(
                    f"executable {executable.name()!r} (in {source_of(executable)}): program "
                    f"{program.name!r} streams {step.anchor!r} with {step.op}; expected an "
                    f"{wanted[step.op].value} anchor in the metadata "
                    f"(in {source_of(metadata)}), found {found}"
                )


def _walk(steps: tuple[Step, ...]) -> Iterator[Step]:
    for step in steps:
        yield step
        for branch in step.branches:
            yield from _walk(branch)


def _check_tensor_data(data: TensorData, metadata: Metadata, path: Path) -> None:
    where = f"{path}: tensor data blob {data.name()!r}"
    anchor: Anchor | None = next((a for a in metadata.anchors() if a.name() == data.name()), None)
    if anchor is None or anchor.type() is not TensorType.INPUT:
        inputs = [a.name() for a in metadata.anchors() if a.type() is TensorType.INPUT]
        raise ModelFileError(
            f"{where}: expected an input anchor of that name in the "
            f"metadata (in {source_of(metadata)}); its inputs are {inputs}"
        )
    expected, found = anchor.tensorInfo(), data.info.tensorInfo()
    if expected != found:
        raise ModelFileError(
            f"{where}: expected {_spec(expected)} (anchor {anchor.name()!r}), found {_spec(found)}"
        )


def _spec(info: TensorInfo) -> str:
    return f"{info.dataType().value}{info.shape()}"
