"""The model file: a zip of JSON and ``.npy`` blobs, listed and checksummed by an index.

The layout is documented in ``docs/model-format.md``; in short::

    index.json            {"format": "ipuserve-popef", "format_version": 1, "blobs": [...]}
    metadata.json         anchors, program flow, IPUs, batch size, executable hash
    executable.json       programs (nested step lists), state tensors, memory, content hash
    tensor_data/0000.npy  one array per TensorData blob

Every index entry names its blob (``kind``, ``name``), its zip ``member``, and the
member's ``sha256`` and ``size``; ``tensor_data`` entries also declare ``dtype`` and
``shape``. :func:`read_container` checks all of it before returning anything, and
every problem becomes a :class:`~ipuserve.errors.ModelFileError` that names the file,
the blob and what was expected versus found. Turning metadata and executables into
JSON and back is :mod:`ipuserve.runtime.popef.codec`'s job; this module only packs
and unpacks blobs.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ipuserve.errors import ModelFileError
from ipuserve.runtime.popef import codec
from ipuserve.runtime.popef.types import DataType, Executable, Metadata, Model, TensorData

FORMAT_NAME = "ipuserve-popef"
FORMAT_VERSION = 1
INDEX_MEMBER = "index.json"
KINDS = ("metadata", "executable", "tensor_data")


@dataclass
class ContainerContents:
    """Everything one file held, already validated."""

    path: Path
    metadata: list[Metadata] = field(default_factory=list)
    executables: list[Executable] = field(default_factory=list)
    tensor_data: list[TensorData] = field(default_factory=list)

    def describe(self) -> str:
        """``"a.popef (metadata 'mlp', executable 'mlp', tensor data: w1, b1)"``."""
        parts = [f"metadata {m.executable()!r}" for m in self.metadata]
        parts += [f"executable {e.name()!r}" for e in self.executables]
        if self.tensor_data:
            parts.append("tensor data: " + ", ".join(t.name() for t in self.tensor_data))
        return f"{self.path} ({'; '.join(parts) or 'no blobs'})"


# -- writing --------------------------------------------------------------------------


def write_model(
    model: Model,
    path: str | os.PathLike[str],
    tensor_data_path: str | os.PathLike[str] | None = None,
) -> list[Path]:
    """Write ``model`` to one file, or two with its tensor data in ``tensor_data_path``."""
    data = list(model.tensorData.values())
    if tensor_data_path is None:
        return [
            write_container(
                path, metadata=model.metadata, executable=model.executable, tensor_data=data
            )
        ]
    return [
        write_container(path, metadata=model.metadata, executable=model.executable),
        write_container(tensor_data_path, tensor_data=data),
    ]


def write_container(
    path: str | os.PathLike[str],
    *,
    metadata: Metadata | None = None,
    executable: Executable | None = None,
    tensor_data: Iterable[TensorData] = (),
) -> Path:
    """Write the given blobs to ``path`` atomically (readers never see half a file)."""
    target = Path(path)
    blobs: list[tuple[dict[str, Any], bytes]] = []
    if metadata is not None:
        blobs.append(
            _blob(
                "metadata",
                metadata.executable(),
                "metadata.json",
                codec.canonical_json(codec.encode_metadata(metadata)),
            )
        )
    if executable is not None:
        blobs.append(
            _blob(
                "executable",
                executable.name(),
                "executable.json",
                codec.canonical_json(codec.encode_executable(executable)),
            )
        )
    for position, data in enumerate(tensor_data):
        info = data.info.tensorInfo()
        entry, raw = _blob(
            "tensor_data", data.name(), f"tensor_data/{position:04d}.npy", _npy_bytes(data.array())
        )
        entry.update(dtype=info.dataType().value, shape=info.shape())
        blobs.append((entry, raw))
    _write_zip(target, blobs)
    return target


def _blob(kind: str, name: str, member: str, raw: bytes) -> tuple[dict[str, Any], bytes]:
    entry = {
        "kind": kind,
        "name": name,
        "member": member,
        "sha256": hashlib.sha256(raw).hexdigest(),
        "size": len(raw),
    }
    return entry, raw


def _npy_bytes(array: np.ndarray[Any, Any]) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


def _write_zip(target: Path, blobs: Sequence[tuple[dict[str, Any], bytes]]) -> None:
    index = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "blobs": [entry for entry, _ in blobs],
    }
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        os.fchmod(handle, 0o666 & ~_umask())  # mkstemp's 0600 would hide the model from others
        with os.fdopen(handle, "wb") as raw_file, zipfile.ZipFile(raw_file, "w") as archive:
            archive.writestr(INDEX_MEMBER, json.dumps(index, indent=1), zipfile.ZIP_DEFLATED)
            for entry, raw in blobs:
                # .npy stays uncompressed: weights barely compress and reading stays cheap
                stored = entry["kind"] == "tensor_data"
                archive.writestr(
                    entry["member"], raw, zipfile.ZIP_STORED if stored else zipfile.ZIP_DEFLATED
                )
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _umask() -> int:
    """The process's umask (reading it means setting it: put it straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# -- reading --------------------------------------------------------------------------


def read_container(path: str | os.PathLike[str]) -> ContainerContents:
    """Read and validate every blob of one file; ModelFileError on any problem."""
    source = Path(path)
    contents = ContainerContents(source)
    try:
        with zipfile.ZipFile(source) as archive:
            entries = _read_index(source, archive)
            for entry in entries:
                _read_blob(source, archive, entry, contents)
    except FileNotFoundError as e:
        raise ModelFileError(f"{source}: no such model file") from e
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError) as e:
        raise ModelFileError(
            f"{source}: not a readable model file (truncated, or not a zip "
            f"archive in the {FORMAT_NAME} format?): {e}"
        ) from e
    return contents


def _read_index(source: Path, archive: zipfile.ZipFile) -> list[dict[str, Any]]:
    raw = _member_bytes(source, archive, INDEX_MEMBER, "the index")
    try:
        index = codec.Fields(json.loads(raw), "index")
        if index.text("format") != FORMAT_NAME:
            raise codec.Malformed(f"format is {index.text('format')!r}, expected {FORMAT_NAME!r}")
        version = index.integer("format_version")
        if version != FORMAT_VERSION:
            raise codec.Malformed(
                f"format version {version} is not supported "
                f"(this reader reads version {FORMAT_VERSION})"
            )
        entries = [
            _index_entry(codec.Fields(item, f"index blob {i}"))
            for i, item in enumerate(index.items("blobs"))
        ]
    except (ValueError, codec.Malformed) as e:
        raise ModelFileError(f"{source}: bad {INDEX_MEMBER}: {e}") from e
    _check_members(source, archive, entries)
    return entries


def _index_entry(entry: codec.Fields) -> dict[str, Any]:
    kind = entry.text("kind")
    if kind not in KINDS:
        raise codec.Malformed(f"{entry.where}: kind is {kind!r}, expected one of {list(KINDS)}")
    checked = {
        "kind": kind,
        "name": entry.text("name"),
        "member": entry.text("member"),
        "sha256": entry.text("sha256"),
        "size": entry.natural("size"),
    }
    if kind == "tensor_data":
        checked["dtype"] = entry.text("dtype")
        checked["shape"] = entry.integers("shape")
    return checked


def _check_members(source: Path, archive: zipfile.ZipFile, entries: list[dict[str, Any]]) -> None:
    listed = {entry["member"] for entry in entries} | {INDEX_MEMBER}
    present = set(archive.namelist())
    for entry in entries:
        if entry["member"] not in present:
            raise ModelFileError(
                f"{source}: {_blob_label(entry)}: member {entry['member']!r} "
                "is listed in the index but missing from the file"
            )
    unlisted = sorted(present - listed)
    if unlisted:
        raise ModelFileError(f"{source}: members not listed in the index: {unlisted}")


def _read_blob(
    source: Path, archive: zipfile.ZipFile, entry: dict[str, Any], contents: ContainerContents
) -> None:
    label = _blob_label(entry)
    raw = _verified_bytes(source, archive, entry, label)
    try:
        if entry["kind"] == "metadata":
            contents.metadata.append(codec.decode_metadata(_json(raw)))
        elif entry["kind"] == "executable":
            contents.executables.append(codec.decode_executable(_json(raw)))
        else:
            contents.tensor_data.append(TensorData(entry["name"], _npy(raw, entry)))
    except (ValueError, codec.Malformed) as e:
        raise ModelFileError(f"{source}: {label} ({entry['member']}): {e}") from e


def _blob_label(entry: dict[str, Any]) -> str:
    return f"{entry['kind'].replace('_', ' ')} blob {entry['name']!r}"


def _verified_bytes(
    source: Path, archive: zipfile.ZipFile, entry: dict[str, Any], label: str
) -> bytes:
    size = archive.getinfo(entry["member"]).file_size
    if size != entry["size"]:
        raise ModelFileError(
            f"{source}: {label} ({entry['member']}): expected {entry['size']} "
            f"bytes (from the index), found {size}"
        )
    raw = _member_bytes(source, archive, entry["member"], label)
    digest = hashlib.sha256(raw).hexdigest()
    if digest != entry["sha256"]:
        raise ModelFileError(
            f"{source}: {label} ({entry['member']}): sha256 mismatch: "
            f"expected {entry['sha256']} (from the index), found {digest}"
        )
    return raw


def _member_bytes(source: Path, archive: zipfile.ZipFile, member: str, label: str) -> bytes:
    try:
        return archive.read(member)
    except KeyError as e:
        raise ModelFileError(f"{source}: {label}: member {member!r} is missing") from e
    except (zipfile.BadZipFile, EOFError, OSError) as e:
        raise ModelFileError(
            f"{source}: {label}: member {member!r} is unreadable (truncated or corrupt file?): {e}"
        ) from e


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise codec.Malformed(f"malformed JSON: {e}") from e


def _npy(raw: bytes, entry: dict[str, Any]) -> np.ndarray[Any, Any]:
    try:
        array: Any = np.load(io.BytesIO(raw), allow_pickle=False)
    except (ValueError, EOFError, OSError) as e:
        raise codec.Malformed(f"not a readable .npy array: {e}") from e
    if not isinstance(array, np.ndarray):
        raise codec.Malformed(f"expected one .npy array, found {type(array).__name__}")
    if array.dtype.byteorder not in "=|":
        array = array.astype(array.dtype.newbyteorder("="))
    found = f"{array.dtype.name}{list(array.shape)}"
    expected = f"{entry['dtype']}{entry['shape']}"
    if found != expected:
        raise codec.Malformed(f"expected {expected} (from the index), found {found}")
    DataType.from_numpy(array.dtype)  # ValueError for dtypes a model cannot hold
    array.flags.writeable = False
    checked: np.ndarray[Any, Any] = array
    return checked
