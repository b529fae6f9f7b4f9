"""Checking an execute call's tensors against the model before anything is queued.

With ``validate_io_params`` (the default) every input must be present, of the
anchor's dtype, and shaped like the anchor except along the batch dimension:
there it must be a whole multiple of the compiled batch (dimension 0), or, with
``batching_dim``, any positive size. Each failure is a
:class:`~ipuserve.errors.TensorError` naming the tensor and saying what was
expected and what came.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ipuserve.errors import TensorError


@dataclass(frozen=True)
class TensorSlot:
    """The shape contract of one execute input or output."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    batch_dim: int
    dynamic: bool

    @property
    def batch(self) -> int:
        return self.shape[self.batch_dim] if self.shape else 1

    def expected(self) -> str:
        dims = [str(d) for d in self.shape]
        if dims:
            dims[self.batch_dim] = "B" if self.dynamic else f"N*{self.batch}"
        rule = "any B >= 1" if self.dynamic else "N >= 1"
        return f"{self.dtype} [{', '.join(dims)}] ({rule})"

    def samples_of(self, array: np.ndarray, role: str) -> int:
        """How many samples ``array`` holds; TensorError if it does not fit this slot."""
        if array.dtype != self.dtype:
            raise TensorError(
                f"{role} {self.name!r}: expected dtype {self.dtype}, got {array.dtype}"
            )
        shape = array.shape
        if len(shape) != len(self.shape) or any(
            got != want
            for axis, (got, want) in enumerate(zip(shape, self.shape, strict=True))
            if axis != self.batch_dim
        ):
            raise TensorError(
                f"{role} {self.name!r}: expected {self.expected()}, got {array.dtype} {list(shape)}"
            )
        samples = shape[self.batch_dim] if shape else 1
        if samples < 1 or (not self.dynamic and samples % self.batch):
            raise TensorError(
                f"{role} {self.name!r}: expected {self.expected()}, got "
                f"{samples} along dimension {self.batch_dim}"
                + (
                    ""
                    if self.dynamic
                    else f", not a multiple of the compiled batch {self.batch}; "
                    "set ModelRunnerConfig.batching_dim for any batch size"
                )
            )
        return samples


def as_array(value: Any, slot: TensorSlot, role: str) -> np.ndarray:
    """Inputs may be any buffer; viewed (not copied) as the slot's dtype when not arrays."""
    if isinstance(value, np.ndarray):
        return value
    try:
        flat = np.frombuffer(value, dtype=slot.dtype)
    except (TypeError, ValueError) as error:
        raise TensorError(
            f"{role} {slot.name!r}: expected a numpy array or a buffer of "
            f"{slot.dtype}, got {type(value).__name__} ({error})"
        ) from error
    per_sample = int(np.prod(slot.shape)) // max(slot.batch, 1) if slot.shape else 1
    if slot.batch_dim != 0 or flat.size % max(per_sample, 1):
        raise TensorError(
            f"{role} {slot.name!r}: a raw buffer of {flat.size} {slot.dtype} "
            f"elements cannot be shaped as {slot.expected()}; pass an array"
        )
    return flat.reshape((-1, *slot.shape[1:]))


class RequestValidator:
    def __init__(
        self, inputs: list[TensorSlot], outputs: list[TensorSlot], frozen: set[str]
    ) -> None:
        self.inputs = {s.name: s for s in inputs}
        self.outputs = {s.name: s for s in outputs}
        self._frozen = frozen

    def check_inputs(self, given: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], int]:
        self._check_names(given, self.inputs, "input")
        arrays = {
            name: as_array(value, self.inputs[name], "input") for name, value in given.items()
        }
        return arrays, self._agreed_samples(arrays, self.inputs, "input")

    def check_outputs(self, given: Mapping[str, Any], samples: int) -> dict[str, np.ndarray]:
        self._check_names(given, self.outputs, "output")
        for name, array in given.items():
            if not isinstance(array, np.ndarray) or not array.flags.writeable:
                raise TensorError(
                    f"output {name!r}: expected a writable numpy array to hold "
                    f"{self.outputs[name].expected()}, got {type(array).__name__}"
                )
        got = self._agreed_samples(dict(given), self.outputs, "output")
        if got != samples:
            name = next(iter(given))
            raise TensorError(
                f"output {name!r}: expected {self.outputs[name].expected()} with "
                f"the inputs' {samples} samples, got {given[name].dtype} "
                f"{list(given[name].shape)}"
            )
        return dict(given)

    def check_names_known(
        self, inputs: Mapping[str, Any], outputs: Mapping[str, Any] | None
    ) -> None:
        """With validate_io_params off a request may leave tensors out (conditional
        execution), but a name the model does not have has no queue to go to: refused
        before anything is queued, or the tensors queued before it would pair with the
        next request's and every later result would be another request's."""
        self._refuse_unknown(inputs, self.inputs, "input")
        if outputs is not None:
            self._refuse_unknown(outputs, self.outputs, "output")

    def _check_names(
        self, given: Mapping[str, Any], slots: dict[str, TensorSlot], role: str
    ) -> None:
        self._refuse_unknown(given, slots, role)
        missing = [name for name in slots if name not in given]
        if missing:
            described = "; ".join(f"{n} {slots[n].expected()}" for n in missing)
            raise TensorError(f"missing {role} tensor(s): {described}")

    def _refuse_unknown(
        self, given: Mapping[str, Any], slots: dict[str, TensorSlot], role: str
    ) -> None:
        for name in given:
            if name not in slots:
                if name in self._frozen:
                    raise TensorError(
                        f"{role} {name!r} is frozen (ModelRunnerConfig.frozen_inputs) "
                        "and must not be passed to execute"
                    )
                raise TensorError(
                    f"unknown {role} tensor {name!r}; the model's execute "
                    f"{role}s are: {', '.join(slots) or 'none'}"
                )

    @staticmethod
    def _agreed_samples(
        arrays: dict[str, np.ndarray], slots: dict[str, TensorSlot], role: str
    ) -> int:
        counts = {name: slots[name].samples_of(array, role) for name, array in arrays.items()}
        if len(set(counts.values())) > 1:
            listed = ", ".join(f"{n} has {c}" for n, c in counts.items())
            raise TensorError(f"{role}s disagree on the batch size: {listed}")
        return next(iter(counts.values()), 0)
