"""Test helpers: a fake host that serves a model's anchors, and zip surgery for corrupt files."""

from __future__ import annotations

import hashlib
import json
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ipuserve.runtime.popef import Model, Step, run_program

Array = npt.NDArray[Any]


class Host:
    """Plays the host side of a model's streams, as a Session would, for the interpreter.

    Input anchors are served from the model's tensor data or from ``inputs``; every
    array handed over is checked against its anchor's shape and dtype, so a builder
    that writes wrong metadata fails here.
    """

    def __init__(self, model: Model) -> None:
        self.model = model
        self.memory: dict[str, Array] = {}
        self.inputs: dict[str, Array] = {}
        self.outputs: dict[str, Array] = {}
        self.steps: list[Step] = []

    def run(self, phase: str, inputs: Mapping[str, Array] | None = None) -> dict[str, Array]:
        """Run every program of ``phase`` (load / main / save); return what it streamed out."""
        self.inputs, self.outputs = dict(inputs or {}), {}
        flow = self.model.metadata.programFlow()
        for index in {"load": flow.load, "main": flow.main, "save": flow.save}[phase]():
            run_program(
                self.model.executable,
                self.model.executable.program(index),
                self.memory,
                self.read,
                self.write,
                self.steps.append,
            )
        return self.outputs

    def read(self, step: Step) -> Array:
        name = step.anchor or ""
        data = self.model.tensorData.get(name)
        array = data.array() if data is not None else self.inputs[name]
        self._check(name, array)
        return array

    def write(self, step: Step, array: Array) -> None:
        name = step.anchor or ""
        self._check(name, array)
        self.outputs[name] = array

    def _check(self, name: str, array: Array) -> None:
        info = self.model.metadata.anchor(name).tensorInfo()
        assert array.shape == tuple(info.shape()), (name, array.shape, info.shape())
        assert array.dtype == info.numpyDType(), (name, array.dtype, info.numpyDType())


def rewrite_zip(
    path: Path, change: Callable[[dict[str, bytes]], object], *, fix_index: bool = False
) -> None:
    """Rewrite the zip at ``path`` after ``change`` edits its ``{member: bytes}``.

    With ``fix_index`` the index's sha256 and size are updated to the new bytes, so
    only the deeper checks (JSON, npy, hashes) can catch the change.
    """
    with zipfile.ZipFile(path) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    change(members)
    if fix_index:
        index = json.loads(members["index.json"])
        for entry in index["blobs"]:
            raw = members.get(entry["member"])
            if raw is not None:
                entry["sha256"] = hashlib.sha256(raw).hexdigest()
                entry["size"] = len(raw)
        members["index.json"] = json.dumps(index).encode()
    with zipfile.ZipFile(path, "w") as archive:
        for name, raw in members.items():
            archive.writestr(name, raw)


def edit_json(members: dict[str, bytes], member: str, edit: Callable[[Any], None]) -> None:
    doc = json.loads(members[member])
    edit(doc)
    members[member] = json.dumps(doc).encode()


def npy_bytes(array: Array, allow_pickle: bool = False) -> bytes:
    import io

    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=allow_pickle)
    return buffer.getvalue()
