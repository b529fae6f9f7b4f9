"""What a simulated executable's graph means: its ops, how to run it, what memory it needs.

* The op set (shape inference, FLOP counts, numpy kernels) is defined in
  :mod:`ipuserve.runtime.popef.ops` and re-exported here: ``OPS``, ``op_def``,
  ``infer``, ``TensorSpec``.
* :func:`run_program` interprets a :class:`~ipuserve.runtime.popef.types.Program`.
  It sits on the hot path of every inference, so each program is compiled once into
  a flat tuple of instructions (kernel looked up, state-or-local decided per operand)
  and cached per executable.
* :func:`memory_bytes` sizes the device memory an executable needs.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ipuserve.errors import RuntimeUsageError
from ipuserve.runtime.popef.ops import (
    OPS,
    STREAM_OPS,
    Array,
    Attrs,
    Kernel,
    OpDef,
    TensorSpec,
    infer,
    op_def,
)
from ipuserve.runtime.popef.types import Executable, Program, Step

__all__ = [
    "OPS",
    "STREAM_OPS",
    "Array",
    "Attrs",
    "Kernel",
    "OpDef",
    "TensorSpec",
    "infer",
    "memory_bytes",
    "op_def",
    "run_program",
]

# -- interpreter ----------------------------------------------------------------------

ReadAnchor = Callable[[Step], Array]
WriteAnchor = Callable[[Step, Array], None]
OnStep = Callable[[Step], None]

_KERNEL, _STREAM_IN, _STREAM_OUT, _SWITCH = range(4)
_KINDS = {"stream_in": _STREAM_IN, "stream_out": _STREAM_OUT, "switch": _SWITCH}


@dataclass(frozen=True, slots=True)
class _Instruction:
    """A step with everything the hot loop needs decided in advance."""

    step: Step
    kind: int
    kernel: Kernel  # _no_kernel for stream and switch steps
    sources: tuple[tuple[bool, str], ...]  # (is_state, tensor name) per input
    output: str  # "" when the step has no output
    output_is_state: bool
    branches: tuple[tuple[_Instruction, ...], ...]


_Cache = dict[int, tuple[Program, tuple["_Instruction", ...]]]
_compiled: weakref.WeakKeyDictionary[Executable, _Cache]
_compiled = weakref.WeakKeyDictionary()


def run_program(
    executable: Executable,
    program: Program,
    memory: dict[str, Array],
    read_anchor: ReadAnchor,
    write_anchor: WriteAnchor,
    on_step: OnStep | None = None,
) -> None:
    """Run ``program`` (one of ``executable``'s) once.

    ``memory`` holds the device's state tensors (``executable.stateTensors()``:
    weights, counters); they persist across runs and are updated in place in the
    dict. Every other tensor lives only for this run. ``read_anchor(step)`` must
    return an array of the anchor's shape and dtype for a ``stream_in`` step;
    ``write_anchor(step, array)`` receives a ``stream_out`` step's tensor, which
    the caller must treat as read-only (it may be the very array an input callback
    supplied: identity does not copy). ``on_step(step)`` is called after every step
    except ``switch`` (the chosen branch's steps are reported instead). Exceptions
    raised by the callbacks propagate unchanged; a bad switch selector raises
    ``ValueError``, reading a state tensor the load program has not written raises
    :class:`~ipuserve.errors.RuntimeUsageError`.
    """
    instructions = _instructions_for(executable, program)
    _execute(instructions, memory, {}, read_anchor, write_anchor, on_step, program)


def _execute(
    instructions: tuple[_Instruction, ...],
    memory: dict[str, Array],
    local: dict[str, Array],
    read_anchor: ReadAnchor,
    write_anchor: WriteAnchor,
    on_step: OnStep | None,
    program: Program,
) -> None:
    for ins in instructions:
        kind = ins.kind
        if kind == _KERNEL:
            result = ins.kernel(_gather(ins, memory, local, program), ins.step.attrs)
        elif kind == _STREAM_IN:
            result = read_anchor(ins.step)
        elif kind == _STREAM_OUT:
            write_anchor(ins.step, _gather(ins, memory, local, program)[0])
        else:
            branch = _select_branch(ins, _gather(ins, memory, local, program)[0])
            _execute(branch, memory, local, read_anchor, write_anchor, on_step, program)
            continue
        if ins.output:
            (memory if ins.output_is_state else local)[ins.output] = result
        if on_step is not None:
            on_step(ins.step)


def _gather(
    ins: _Instruction, memory: dict[str, Array], local: dict[str, Array], program: Program
) -> list[Array]:
    try:
        return [memory[name] if is_state else local[name] for is_state, name in ins.sources]
    except KeyError as e:
        raise RuntimeUsageError(
            f"program {program.name!r}: step {ins.step.op!r} reads tensor {e.args[0]!r}, "
            "which has no value yet (state tensors are written by the load program: "
            "run it first)"
        ) from None


def _select_branch(ins: _Instruction, selector: Array) -> tuple[_Instruction, ...]:
    name = ins.step.inputs[0]
    flat = np.asarray(selector).reshape(-1)
    if flat.size == 0:
        raise ValueError(f"switch selector tensor {name!r} is empty")
    value = int(flat[0])
    if not 0 <= value < len(ins.branches):
        raise ValueError(
            f"switch selector tensor {name!r} has value {value}, but the "
            f"switch has {len(ins.branches)} branches (0..{len(ins.branches) - 1})"
        )
    return ins.branches[value]


def _instructions_for(executable: Executable, program: Program) -> tuple[_Instruction, ...]:
    per_program = _compiled.get(executable)
    if per_program is None:
        per_program = {}
        _compiled[executable] = per_program  # a race only compiles twice: harmless
    cached = per_program.get(program.index)
    if cached is not None and cached[0] is program:
        return cached[1]
    compiled = _compile(program.steps, executable.stateTensors())
    per_program[program.index] = (program, compiled)
    return compiled


def _compile(steps: tuple[Step, ...], state: frozenset[str]) -> tuple[_Instruction, ...]:
    return tuple(
        _Instruction(
            step=step,
            kind=_KINDS.get(step.op, _KERNEL),
            kernel=_no_kernel if step.op in STREAM_OPS else op_def(step.op).run,
            sources=tuple((name in state, name) for name in step.inputs),
            output="" if step.op == "stream_out" else (step.output or ""),
            output_is_state=step.output in state,
            branches=tuple(_compile(branch, state) for branch in step.branches),
        )
        for step in steps
    )


def _no_kernel(_inputs: Sequence[Array], _attrs: Attrs) -> Array:
    raise AssertionError("stream and switch steps have no kernel")


# -- device memory --------------------------------------------------------------------


def memory_bytes(
    programs: Sequence[Program], state: Mapping[str, TensorSpec], local: Mapping[str, TensorSpec]
) -> int:
    """Device memory a loaded executable needs: its state tensors, plus the highest peak
    of per-run tensors over its programs.

    A per-run tensor is live from the step that makes it to the last step that reads
    it (or a view of it: identity and reshape results alias their input and cost
    nothing). Branches of a switch are laid end to end, so tensors of different
    branches never count together.
    """
    peaks = (_peak_bytes(list(_flatten(p.steps)), local) for p in programs)
    return sum(spec.nbytes for spec in state.values()) + max(peaks, default=0)


def _peak_bytes(steps: list[Step], local: Mapping[str, TensorSpec]) -> int:
    root: dict[str, str] = {}  # alias -> the tensor that owns the memory
    born: dict[str, int] = {}
    last: dict[str, int] = {}
    for position, step in enumerate(steps):
        for name in step.inputs:
            if name in local:
                last[root.get(name, name)] = position
        output = step.output
        if output is None or output not in local or output in born or output in root:
            continue
        if step.op in OPS and OPS[step.op].aliases and step.inputs[0] in local:
            root[output] = root.get(step.inputs[0], step.inputs[0])
        else:
            born[output] = last[output] = position
    return max(
        (
            sum(local[n].nbytes for n, b in born.items() if b <= p <= last[n])
            for p in range(len(steps))
        ),
        default=0,
    )


def _flatten(steps: tuple[Step, ...]) -> Iterator[Step]:
    for step in steps:
        yield step
        for branch in step.branches:
            yield from _flatten(branch)
