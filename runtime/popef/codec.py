"""Metadata and executables to JSON and back, validating every field on the way in.

The executable's content hash is defined here: sha256 of its *canonical* JSON
(sorted keys, no whitespace, no NaN), without the ``content_hash`` field itself.
Decoding raises :class:`Malformed` (a ``ValueError``) describing the first field it
could not accept; :mod:`~ipuserve.runtime.popef.container` adds the file and blob.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, TypeVar

from ipuserve.runtime.popef import graph
from ipuserve.runtime.popef.types import (
    Anchor,
    DataType,
    Executable,
    Metadata,
    Program,
    ProgramFlow,
    Step,
    TensorInfo,
    TensorType,
)

_Enum = TypeVar("_Enum", DataType, TensorType)


class Malformed(ValueError):
    """A JSON document that does not have the shape the format requires."""


def canonical_json(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def executable_hash(executable: Executable) -> str:
    """What ``executable.hash()`` must be: sha256 of its canonical JSON body."""
    return hashlib.sha256(canonical_json(_executable_body(executable))).hexdigest()


def with_hash(executable: Executable) -> Executable:
    """A copy of ``executable`` carrying its content hash (builders make them without)."""
    return Executable(
        name=executable.name(),
        programs=executable.programs(),
        state_tensors=executable.stateTensors(),
        memory_bytes=executable.memoryBytes(),
        zero_time=executable.zeroTime(),
        content_hash=executable_hash(executable),
    )


# -- encoding -------------------------------------------------------------------------


def encode_metadata(metadata: Metadata) -> dict[str, Any]:
    flow = metadata.programFlow()
    return {
        "model_name": metadata.modelName(),
        "executable": metadata.executable(),
        "executable_hash": metadata.executableHash(),
        "num_ipus": metadata.numIpus(),
        "ipu_version": metadata.ipuVersion(),
        "replication_factor": metadata.replicationFactor(),
        "batch_size": metadata.batchSize(),
        "is_inference": metadata.isInference(),
        "program_flow": {"load": flow.load(), "main": flow.main(), "save": flow.save()},
        "anchors": [_encode_anchor(anchor) for anchor in metadata.anchors()],
    }


def _encode_anchor(anchor: Anchor) -> dict[str, Any]:
    info = anchor.tensorInfo()
    return {
        "name": anchor.name(),
        "handle": anchor.handle(),
        "dtype": info.dataType().value,
        "shape": info.shape(),
        "programs": anchor.programs(),
        "type": anchor.type().value,
        "is_per_replica": anchor.isPerReplica(),
        "use_remote_buffers": anchor.useRemoteBuffers(),
    }


def encode_executable(executable: Executable) -> dict[str, Any]:
    return {**_executable_body(executable), "content_hash": executable.hash()}


def _executable_body(executable: Executable) -> dict[str, Any]:
    return {
        "name": executable.name(),
        "programs": [
            {"index": p.index, "name": p.name, "steps": _encode_steps(p.steps)}
            for p in executable.programs()
        ],
        "state_tensors": sorted(executable.stateTensors()),
        "memory_bytes": executable.memoryBytes(),
        "zero_time": executable.zeroTime(),
    }


def _encode_steps(steps: tuple[Step, ...]) -> list[dict[str, Any]]:
    return [
        {
            "op": s.op,
            "inputs": list(s.inputs),
            "output": s.output,
            "anchor": s.anchor,
            "attrs": dict(s.attrs),
            "flops": s.flops,
            "host_bytes": s.host_bytes,
            "branches": [_encode_steps(branch) for branch in s.branches],
        }
        for s in steps
    ]


# -- decoding -------------------------------------------------------------------------


class Fields:
    """Typed access to a JSON object; every failure names where it happened."""

    def __init__(self, doc: Any, where: str) -> None:
        if not isinstance(doc, dict):
            raise Malformed(f"{where}: expected a JSON object, found {_short(doc)}")
        self.doc: dict[str, Any] = doc
        self.where = where

    def _get(self, key: str, types: type | tuple[type, ...], expected: str) -> Any:
        if key not in self.doc:
            raise Malformed(f"{self.where}: missing field {key!r}")
        value = self.doc[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in _tuple(types)):
            raise Malformed(
                f"{self.where}: field {key!r} should be {expected}, found {_short(value)}"
            )
        return value

    def text(self, key: str) -> str:
        value: str = self._get(key, str, "a string")
        return value

    def optional_text(self, key: str) -> str | None:
        value: str | None = self._get(key, (str, type(None)), "a string or null")
        return value

    def integer(self, key: str) -> int:
        value: int = self._get(key, int, "an integer")
        return value

    def natural(self, key: str) -> int:
        value = self.integer(key)
        if value < 0:
            raise Malformed(f"{self.where}: field {key!r} should be >= 0, found {value}")
        return value

    def flag(self, key: str) -> bool:
        value: bool = self._get(key, bool, "true or false")
        return value

    def items(self, key: str) -> list[Any]:
        value: list[Any] = self._get(key, list, "a list")
        return value

    def integers(self, key: str) -> list[int]:
        values = self.items(key)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise Malformed(
                f"{self.where}: field {key!r} should list integers, found {_short(values)}"
            )
        return values

    def texts(self, key: str) -> list[str]:
        values = self.items(key)
        if not all(isinstance(v, str) for v in values):
            raise Malformed(
                f"{self.where}: field {key!r} should list strings, found {_short(values)}"
            )
        return values

    def child(self, key: str) -> Fields:
        return Fields(self._get(key, dict, "an object"), f"{self.where}.{key}")


def decode_metadata(doc: Any) -> Metadata:
    fields = Fields(doc, "metadata")
    flow = fields.child("program_flow")
    return Metadata(
        model_name=fields.text("model_name"),
        executable=fields.text("executable"),
        anchors=[
            _decode_anchor(Fields(a, f"anchor {i}")) for i, a in enumerate(fields.items("anchors"))
        ],
        program_flow=ProgramFlow(
            flow.integers("load"), flow.integers("main"), flow.integers("save")
        ),
        num_ipus=fields.natural("num_ipus"),
        ipu_version=fields.natural("ipu_version"),
        replication_factor=fields.natural("replication_factor"),
        batch_size=fields.natural("batch_size"),
        executable_hash=fields.text("executable_hash"),
        is_inference=fields.flag("is_inference"),
    )


def _decode_anchor(fields: Fields) -> Anchor:
    fields.where = f"anchor {fields.doc.get('name', fields.where)!r}"
    shape = fields.integers("shape")
    if any(d < 0 for d in shape):
        raise Malformed(f"{fields.where}: negative dimension in shape {shape}")
    return Anchor(
        fields.text("name"),
        fields.text("handle"),
        TensorInfo(_member(DataType, fields, "dtype"), shape),
        fields.integers("programs"),
        _member(TensorType, fields, "type"),
        fields.flag("is_per_replica"),
        fields.flag("use_remote_buffers"),
    )


def _member(enum_type: type[_Enum], fields: Fields, key: str) -> _Enum:
    value = fields.text(key)
    try:
        return enum_type(value)
    except ValueError:
        allowed = [m.value for m in enum_type]
        raise Malformed(
            f"{fields.where}: field {key!r} is {value!r}, expected one of {allowed}"
        ) from None


def decode_executable(doc: Any) -> Executable:
    fields = Fields(doc, "executable")
    programs = [
        _decode_program(Fields(p, f"program {i}")) for i, p in enumerate(fields.items("programs"))
    ]
    executable = Executable(
        name=fields.text("name"),
        programs=programs,
        state_tensors=fields.texts("state_tensors"),
        memory_bytes=fields.natural("memory_bytes"),
        zero_time=fields.flag("zero_time"),
        content_hash=fields.text("content_hash"),
    )
    actual = executable_hash(executable)
    if actual != executable.hash():
        raise Malformed(
            f"content hash mismatch: the executable says {executable.hash()}, "
            f"its content hashes to {actual}"
        )
    return executable


def _decode_program(fields: Fields) -> Program:
    name = fields.text("name")
    fields.where = f"program {name!r}"
    return Program(
        fields.integer("index"), name, _decode_steps(fields.items("steps"), fields.where)
    )


def _decode_steps(docs: list[Any], where: str) -> tuple[Step, ...]:
    return tuple(_decode_step(Fields(doc, f"{where} step {i}")) for i, doc in enumerate(docs))


def _decode_step(fields: Fields) -> Step:
    step = Step(
        op=fields.text("op"),
        inputs=tuple(fields.texts("inputs")),
        output=fields.optional_text("output"),
        anchor=fields.optional_text("anchor"),
        attrs=fields.child("attrs").doc,
        flops=fields.natural("flops"),
        host_bytes=fields.natural("host_bytes"),
        branches=tuple(
            _decode_steps(_list(b, fields.where), f"{fields.where} branch {i}")
            for i, b in enumerate(fields.items("branches"))
        ),
    )
    _check_step(step, fields.where)
    return step


def _check_step(step: Step, where: str) -> None:
    """The structural rules the interpreter relies on (shapes are the builder's job)."""
    if step.op == "stream_in":
        ok, rule = step.anchor is not None and step.output is not None, "an anchor and an output"
    elif step.op == "stream_out":
        ok, rule = step.anchor is not None and len(step.inputs) == 1, "an anchor and one input"
    elif step.op == "switch":
        ok, rule = len(step.inputs) == 1 and bool(step.branches), "one input and branches"
    else:
        try:
            definition = graph.op_def(step.op)
        except ValueError as e:
            raise Malformed(f"{where}: {e}") from None
        ok = step.output is not None and len(step.inputs) == definition.num_inputs
        rule = f"an output and {definition.num_inputs} inputs"
    if not ok:
        raise Malformed(f"{where}: a {step.op!r} step needs {rule}")


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise Malformed(f"{where}: each branch should be a list of steps, found {_short(value)}")
    return value


def _tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def _short(value: Any) -> str:
    text = json.dumps(value) if _jsonable(value) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True
