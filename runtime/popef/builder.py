"""Writing models from Python: ``GraphBuilder`` records a graph and checks it as it grows.

::

    g = GraphBuilder("simple", batch_size=4)
    a = g.input("tensor_A", (4, 4))                    # main program: stream_in
    w = g.weight("weights", np.ones(4, np.float32))    # tensor data, streamed in by load
    g.output("output", g.add(g.mul(a, w), g.input("tensor_B", (4, 4))))
    g.save_output("run_count", g.counter("run_count"))  # save program streams state back
    g.write("simple.popef")                            # or g.build(): an in-memory Model

Every model has three programs: load (0), main (1) and save (2, possibly empty).
Weights and counters are *state tensors*, kept in device memory across runs and
readable by every program; other tensors live for one run of the program (and
switch branch) that made them. ``with g.switch(selector) as sw: with sw.branch():``
adds conditional execution; see docs/model-format.md. Each op validates its operands
at once: a ``ValueError`` names the op, its operand tensors and their shapes.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ipuserve.runtime.popef import codec, graph
from ipuserve.runtime.popef.builder_ops import DTypeLike, OpShorthands, Tensor
from ipuserve.runtime.popef.container import write_model
from ipuserve.runtime.popef.graph import TensorSpec, memory_bytes
from ipuserve.runtime.popef.types import (
    Anchor,
    DataType,
    Executable,
    Metadata,
    Model,
    Program,
    ProgramFlow,
    Step,
    TensorData,
    TensorInfo,
    TensorType,
)

LOAD, MAIN, SAVE = 0, 1, 2
PROGRAM_NAMES = ("load", "main", "save")


@dataclass
class _Frame:
    """Where new steps go: a program's step list, or one branch of a switch."""

    program: int
    steps: list[Step]
    scope: tuple[tuple[int, int], ...] = ()
    closed: bool = False  # a switch between branches: no steps allowed here


@dataclass
class _AnchorDraft:
    name: str
    handle: str
    info: TensorInfo
    type: TensorType


class Switch:
    """Collects the branches of one ``GraphBuilder.switch``; branch i runs for selector i."""

    def __init__(self, builder: GraphBuilder, selector: Tensor, switch_id: int) -> None:
        self._builder = builder
        self.selector = selector
        self.id = switch_id
        self.branches: list[list[Step]] = []

    @contextlib.contextmanager
    def branch(self) -> Iterator[None]:
        """Steps added inside this block form the next branch."""
        outer = self._builder._frame
        steps: list[Step] = []
        self.branches.append(steps)
        scope = (*outer.scope, (self.id, len(self.branches) - 1))
        with self._builder._pushed(_Frame(outer.program, steps, scope)):
            yield


class GraphBuilder(OpShorthands):
    """Records a model's programs; ``build()`` or ``write()`` it when done.

    ``batch_dim`` is where batched inputs and outputs carry ``batch_size``;
    ``zero_time`` makes runs take no simulated time (see ``Executable.zeroTime``).
    """

    def __init__(
        self,
        name: str,
        *,
        batch_size: int,
        num_ipus: int = 1,
        ipu_version: int = 2,
        batch_dim: int = 0,
        zero_time: bool = False,
    ) -> None:
        for what, value in (
            ("batch_size", batch_size),
            ("num_ipus", num_ipus),
            ("ipu_version", ipu_version),
        ):
            if value < 1:
                raise ValueError(f"{what} must be >= 1, got {value}")
        if batch_dim < 0:
            raise ValueError(f"batch_dim must be >= 0, got {batch_dim}")
        self.name, self.batch_size, self.batch_dim = name, batch_size, batch_dim
        self.num_ipus, self.ipu_version, self.zero_time = num_ipus, ipu_version, zero_time
        self._programs: list[list[Step]] = [[], [], []]
        self._frames = [_Frame(MAIN, self._programs[MAIN])]
        self._tensors: dict[str, Tensor] = {}
        self._anchors: dict[str, _AnchorDraft] = {}
        self._tensor_data: dict[str, npt.NDArray[Any]] = {}
        self._ids = itertools.count()

    # -- anchors ------------------------------------------------------------------------
    def input(
        self,
        name: str,
        shape: Sequence[int],
        dtype: DTypeLike = "float32",
        *,
        batched: bool = True,
        handle: str | None = None,
    ) -> Tensor:
        """A main-program input streamed from the host where this is called."""
        spec = TensorSpec(tuple(int(d) for d in shape), DataType.from_numpy(dtype).numpy)
        if batched:
            self._check_batched(f"input {name!r}", spec)
        self._add_anchor(name, handle, spec, TensorType.INPUT)
        tensor = self._new_tensor(name, spec, self._frame.program, self._frame.scope)
        self._append(Step("stream_in", output=name, anchor=name, host_bytes=spec.nbytes))
        return tensor

    def weight(self, name: str, values: npt.ArrayLike, *, handle: str | None = None) -> Tensor:
        """A state tensor whose values are stored in the file; the load program streams it in."""
        array = np.array(values)  # a private copy
        spec = TensorSpec(array.shape, DataType.from_numpy(array.dtype).numpy)
        self._add_anchor(name, handle, spec, TensorType.INPUT)
        array.flags.writeable = False
        self._tensor_data[name] = array
        tensor = self._new_tensor(name, spec, None)
        self._programs[LOAD].append(
            Step("stream_in", output=name, anchor=name, host_bytes=spec.nbytes)
        )
        return tensor

    def output(
        self, name: str, tensor: Tensor, *, batched: bool = True, handle: str | None = None
    ) -> None:
        """Stream ``tensor`` to the host as anchor ``name`` (main program, current branch)."""
        self._check_visible(tensor, f"output {name!r}")
        if batched:
            self._check_batched(f"output {name!r}", tensor.spec)
        self._add_anchor(name, handle, tensor.spec, TensorType.OUTPUT)
        self._append(
            Step("stream_out", inputs=(tensor.name,), anchor=name, host_bytes=tensor.spec.nbytes)
        )

    def counter(
        self,
        name: str,
        *,
        dtype: DTypeLike = "int64",
        shape: Sequence[int] = (1,),
        amount: int | float = 1,
    ) -> Tensor:
        """A state tensor zeroed by the load program and incremented here on every run."""
        spec = TensorSpec(tuple(shape), DataType.from_numpy(dtype).numpy)
        counter = self._new_tensor(name, spec, None)
        fill = {"value": 0, "dtype": spec.dtype.name, "shape": list(spec.shape)}
        self._programs[LOAD].append(self._compute_step("fill", (), name, spec, fill))
        attrs = {"amount": amount}
        updated = self._infer("increment", (counter,), attrs)
        self._append(self._compute_step("increment", (counter,), name, updated, attrs))
        return counter

    def save_output(self, name: str, tensor: Tensor, *, handle: str | None = None) -> None:
        """Stream a state tensor back to the host from the save program."""
        if tensor.program is not None or self._tensors.get(tensor.name) is not tensor:
            raise ValueError(
                f"save output {name!r}: tensor {tensor.name!r} is not a state "
                "tensor of this model (use weight() or counter())"
            )
        self._add_anchor(name, handle, tensor.spec, TensorType.OUTPUT)
        self._programs[SAVE].append(
            Step("stream_out", inputs=(tensor.name,), anchor=name, host_bytes=tensor.spec.nbytes)
        )

    # -- control flow -------------------------------------------------------------------
    @contextlib.contextmanager
    def switch(self, selector: Tensor) -> Iterator[Switch]:
        """Conditional execution on ``selector``'s first element (see the module docs)."""
        self._check_visible(selector, "switch")
        if selector.dtype.kind not in "iu":
            raise ValueError(
                f"switch: selector {selector.name!r} must have an integer dtype, "
                f"got {selector.spec}"
            )
        outer = self._frame
        switch = Switch(self, selector, next(self._ids))
        with self._pushed(_Frame(outer.program, outer.steps, outer.scope, closed=True)):
            yield switch
        if not switch.branches:
            raise ValueError(f"switch on {selector.name!r} has no branches")
        self._append(
            Step(
                "switch", inputs=(selector.name,), branches=tuple(tuple(b) for b in switch.branches)
            )
        )

    # -- compute ------------------------------------------------------------------------
    def op(self, op: str, *inputs: Tensor, name: str | None = None, **attrs: Any) -> Tensor:
        """Append compute op ``op`` (see :mod:`~ipuserve.runtime.popef.ops`); ``add``,
        ``matmul``, ... are shorthands for this."""
        attrs = _normalise(attrs)
        result = self._infer(op, inputs, attrs)
        output = name or self._fresh_name(op)
        tensor = self._new_tensor(output, result, self._frame.program, self._frame.scope)
        self._append(self._compute_step(op, inputs, output, result, attrs))
        return tensor

    # -- output -------------------------------------------------------------------------
    def build(self) -> Model:
        """The model as it stands, in memory (``paths`` is empty)."""
        if len(self._frames) != 1:
            raise ValueError("build() inside an open switch or branch")
        programs = [
            Program(i, PROGRAM_NAMES[i], tuple(steps)) for i, steps in enumerate(self._programs)
        ]
        state = {t.name: t.spec for t in self._tensors.values() if t.program is None}
        executable = codec.with_hash(
            Executable(
                name=self.name,
                programs=programs,
                state_tensors=state,
                memory_bytes=memory_bytes(programs, state, self._local_specs()),
                zero_time=self.zero_time,
            )
        )
        metadata = Metadata(
            model_name=self.name,
            executable=self.name,
            anchors=self._final_anchors(programs),
            program_flow=ProgramFlow([LOAD], [MAIN], [SAVE]),
            num_ipus=self.num_ipus,
            ipu_version=self.ipu_version,
            batch_size=self.batch_size,
            executable_hash=executable.hash(),
        )
        data = {name: TensorData(name, array) for name, array in self._tensor_data.items()}
        return Model(metadata, executable, data)

    def write(
        self, path: str | os.PathLike[str], tensor_data_path: str | os.PathLike[str] | None = None
    ) -> list[Path]:
        """Write the model to one file, or two with the tensor data in the second."""
        return write_model(self.build(), path, tensor_data_path)

    # -- internals ----------------------------------------------------------------------
    @property
    def _frame(self) -> _Frame:
        return self._frames[-1]

    @contextlib.contextmanager
    def _pushed(self, frame: _Frame) -> Iterator[None]:
        self._frames.append(frame)
        try:
            yield
        finally:
            self._frames.pop()

    def _append(self, step: Step) -> None:
        if self._frame.closed:
            raise ValueError(
                f"step {step.op!r} added inside a switch but outside its "
                "branches: use `with sw.branch():`"
            )
        self._frame.steps.append(step)

    def _infer(self, op: str, inputs: Sequence[Tensor], attrs: dict[str, Any]) -> TensorSpec:
        label = f"{op}({', '.join(t.name for t in inputs)})"
        for tensor in inputs:
            self._check_visible(tensor, label)
        return graph.infer(op, [t.spec for t in inputs], attrs, label=label)

    def _compute_step(
        self,
        op: str,
        inputs: Sequence[Tensor],
        output: str,
        result: TensorSpec,
        attrs: dict[str, Any],
    ) -> Step:
        flops = graph.op_def(op).flops([t.spec for t in inputs], result)
        return Step(
            op,
            tuple(t.name for t in inputs),
            output,
            attrs={**attrs, "dtype": result.dtype.name},
            flops=flops,
        )

    def _new_tensor(
        self,
        name: str,
        spec: TensorSpec,
        program: int | None,
        scope: tuple[tuple[int, int], ...] = (),
    ) -> Tensor:
        if name in self._tensors:
            raise ValueError(f"a tensor named {name!r} already exists in model {self.name!r}")
        tensor = Tensor(name, spec, program, scope)
        self._tensors[name] = tensor
        return tensor

    def _fresh_name(self, op: str) -> str:
        return next(n for i in itertools.count() if (n := f"{op}_{i}") not in self._tensors)

    def _add_anchor(
        self, name: str, handle: str | None, spec: TensorSpec, kind: TensorType
    ) -> None:
        if name in self._anchors:
            raise ValueError(f"an anchor named {name!r} already exists in model {self.name!r}")
        info = TensorInfo(DataType.from_numpy(spec.dtype), spec.shape)
        self._anchors[name] = _AnchorDraft(name, handle or name, info, kind)

    def _check_batched(self, what: str, spec: TensorSpec) -> None:
        dim = self.batch_dim
        if len(spec.shape) <= dim or spec.shape[dim] != self.batch_size:
            raise ValueError(
                f"{what} has shape {list(spec.shape)}; batched I/O needs the "
                f"batch size ({self.batch_size}) in dimension {dim} "
                "(pass batched=False for unbatched tensors)"
            )

    def _check_visible(self, tensor: Tensor, user: str) -> None:
        if self._tensors.get(tensor.name) is not tensor:
            raise ValueError(
                f"{user}: tensor {tensor.name!r} does not belong to model {self.name!r}"
            )
        if tensor.program is None:
            return
        frame = self._frame
        if tensor.program != frame.program or frame.scope[: len(tensor.scope)] != tensor.scope:
            raise ValueError(
                f"{user}: tensor {tensor.name!r} was made in another program or "
                "switch branch and does not exist here"
            )

    def _local_specs(self) -> dict[str, TensorSpec]:
        return {t.name: t.spec for t in self._tensors.values() if t.program is not None}

    def _final_anchors(self, programs: list[Program]) -> list[Anchor]:
        users: dict[str, set[int]] = {name: set() for name in self._anchors}
        for program in programs:
            for anchor in _streamed_anchors(program.steps):
                users[anchor].add(program.index)
        return [
            Anchor(d.name, d.handle, d.info, users[d.name], d.type) for d in self._anchors.values()
        ]


def _streamed_anchors(steps: tuple[Step, ...]) -> Iterator[str]:
    for step in steps:
        if step.anchor is not None:
            yield step.anchor
        for branch in step.branches:
            yield from _streamed_anchors(branch)


def _normalise(attrs: dict[str, Any]) -> dict[str, Any]:
    """Attributes as they will read back from JSON (lists, plain numbers, dtype names)."""
    if "dtype" in attrs:
        attrs = {**attrs, "dtype": DataType.from_numpy(attrs["dtype"]).value}
    try:
        normalised: dict[str, Any] = json.loads(json.dumps(attrs, allow_nan=False, default=_plain))
    except (TypeError, ValueError) as e:
        raise ValueError(f"attributes {attrs!r} cannot be stored: {e}") from None
    return normalised


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic | np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")
