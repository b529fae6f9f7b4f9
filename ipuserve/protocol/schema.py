"""A model's schema (:class:`ModelSpec`) and matching tensors against it: whether a
request's inputs fit (:func:`check_inputs`) and a worker's outputs fit
(:func:`outputs_problem`). Whether requests may share one job is
:attr:`ModelSpec.groupable`. No zmq: the worker's backends use this module alone."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from ipuserve.errors import InvalidInputError, ProtocolError
from ipuserve.protocol.envelope import Command, Limits
from ipuserve.protocol.fields import Count, Name, Positive, Version
from ipuserve.protocol.tensors import TensorSpec, checked_specs


class ModelSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a worker serves: input/output specs at the compiled batch, and how it batches:
    with ``batching_dim`` set, a request may have any size >= 1 along that dimension (the
    same for every input) and every other must match; without it, every dimension.

    ``version`` tells two builds of one name apart (a repository's ``NAME/VERSION/``; a
    worker given a model file serves version "1"); each version may have its own schema.
    ``default_version`` pins the version a request that names none goes to (the
    repository's ``config.toml``); without it, the latest version a worker serves."""

    name: Name
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    batch_size: Positive = 1
    batching_dim: Count | None = None
    version: Version = "1"
    default_version: Version | None = None

    def to_json(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)  # type: ignore[no-any-return]

    def checked(self, limits: Limits, command: Command) -> ModelSpec:
        """This spec, received in a ``command``, within a receiver's limits on tensors."""
        where = f"model {self.name!r}"
        checked_specs(self.inputs, limits, command, f"{where} inputs")
        checked_specs(self.outputs, limits, command, f"{where} outputs")
        dim = self.batching_dim
        if dim is not None and any(dim >= len(t.shape) for t in self.inputs + self.outputs):
            raise ProtocolError(f"{where}: batching_dim {dim} exceeds the rank of a tensor")
        return self

    def signature(self) -> str:
        """Everything a request must match, in a line: ``x:float32[4, 8] -> y:float32[4, 8];
        batch 4 along dimension 0`` (telling two schemas of one name apart)."""
        inputs = ", ".join(map(str, self.inputs))
        outputs = ", ".join(map(str, self.outputs))
        dim = self.batching_dim
        batching = ", no dynamic batching" if dim is None else f" along dimension {dim}"
        return f"{inputs} -> {outputs}; batch {self.batch_size}{batching}"

    @property
    def key(self) -> tuple[str, str]:
        """Which model and version this is: what the broker routes by."""
        return self.name, self.version

    def samples(self, shapes: Iterable[Sequence[int]]) -> int:
        """Samples a request whose tensors have ``shapes`` carries: the size along the
        batching dimension of the first that has it, else the compiled batch."""
        dim = self.batching_dim
        if dim is not None:
            for shape in shapes:
                if len(shape) > dim:
                    return int(shape[dim])
        return self.batch_size

    @property
    def groupable(self) -> bool:
        """Whether requests may travel as a group (one job, joined along the batching
        dimension): every input and output must have that dimension."""
        dim = self.batching_dim
        return dim is not None and all(len(t.shape) > dim for t in (*self.inputs, *self.outputs))


def outputs_problem(model: ModelSpec, given: Sequence[TensorSpec]) -> str | None:
    """Why a worker's outputs do not fit ``model``'s schema (names, dtypes, and shapes
    but for the batching dimension), else None: the broker checks before forwarding."""
    want = {spec.name: spec for spec in model.outputs}
    got = {spec.name: spec for spec in given}
    if want.keys() != got.keys() or len(given) != len(got):
        theirs = ", ".join(map(str, model.outputs))
        return f"outputs {', '.join(map(str, given)) or 'none'}; the model's are {theirs}"
    dim = model.batching_dim
    for name, spec in want.items():
        other = got[name]
        fixed = [i for i in range(len(spec.shape)) if i != dim]
        if (
            other.dtype != spec.dtype
            or len(other.shape) != len(spec.shape)
            or any(other.shape[i] != spec.shape[i] for i in fixed)
        ):
            return f"output {other}; the model's is {spec}"
    return None


def batch_problem(model: ModelSpec, given: Sequence[TensorSpec], samples: int) -> str | None:
    """Why outputs of ``samples`` samples per member (what the job's inputs carried)
    cannot be the model's answer, else None: along the batching dimension an output has
    as many samples as the inputs it answers, and a worker that says otherwise would
    hand the client another request's rows, or too few."""
    dim = model.batching_dim
    if dim is None:
        return None  # every dimension is fixed: outputs_problem checked them
    for spec in given:
        if len(spec.shape) > dim and spec.shape[dim] != samples:
            return f"output {spec} of {spec.shape[dim]} samples for a request of {samples}"
    return None


def check_inputs(model: ModelSpec, given: Sequence[TensorSpec]) -> None:
    """Raise InvalidInputError unless ``given`` matches the model's input specs."""
    expected = {spec.name: spec for spec in model.inputs}
    names = [spec.name for spec in given]
    missing = [name for name in expected if name not in names]
    if missing:
        unknown = [name for name in names if name not in expected]
        if unknown:  # most likely a misspelt name: name it first
            raise InvalidInputError(
                f"model {model.name!r} has no input {', '.join(map(repr, unknown))}; its "
                f"inputs are {', '.join(expected)} (missing: {', '.join(missing)})"
            )
        raise InvalidInputError(
            f"model {model.name!r} needs inputs {', '.join(expected)}; "
            f"missing: {', '.join(missing)}"
        )
    batches: dict[str, int] = {}
    for spec in given:
        want = expected.get(spec.name)
        if want is None:
            raise InvalidInputError(
                f"model {model.name!r} has no input {spec.name!r} (inputs: {', '.join(expected)})"
            )
        _check_input(model, want, spec)
        if model.batching_dim is not None:
            batches[spec.name] = spec.shape[model.batching_dim]
    if len(set(batches.values())) > 1:
        raise InvalidInputError(
            f"inputs of model {model.name!r} disagree on the batch size "
            f"along dimension {model.batching_dim}: {batches}"
        )


def _check_input(model: ModelSpec, want: TensorSpec, got: TensorSpec) -> None:
    where = f"input {got.name!r} of model {model.name!r}"
    if got.dtype != want.dtype:
        raise InvalidInputError(
            f"{where} must be {want.dtype}, got {got.dtype} (convert it: x.astype(np.{want.dtype}))"
        )
    dim = model.batching_dim
    free = dim is not None and len(got.shape) == len(want.shape) and got.shape[dim] >= 1
    fixed = [i for i in range(len(want.shape)) if not (free and i == dim)]
    if len(got.shape) != len(want.shape) or any(got.shape[i] != want.shape[i] for i in fixed):
        rule = "" if dim is None else f" (dimension {dim} may be any size >= 1)"
        unbatched = dim is not None and got.shape == want.shape[:dim] + want.shape[dim + 1 :]
        hint = f"; one sample still needs the batch dimension: np.expand_dims(x, {dim})"
        raise InvalidInputError(
            f"{where} must have shape {want.shape}{rule}, got {got.shape}"
            + (hint if unbatched else "")
        )
