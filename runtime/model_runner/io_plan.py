"""Which anchors a ModelRunner exchanges per request, and how they are batched.

Execute inputs are the main programs' input anchors that neither carry PopEF
tensor data nor are frozen; execute outputs are the main programs' output
anchors. Everything else is bound once per replica (tensor data, frozen inputs,
save-program outputs). Load-program inputs without any data source make the
model unrunnable, so they are refused up front.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from ipuserve.errors import ConfigError, TensorError
from ipuserve.runtime.model_runner.config import ModelRunnerConfig
from ipuserve.runtime.model_runner.memory import DataDesc
from ipuserve.runtime.model_runner.validation import RequestValidator, TensorSlot
from ipuserve.runtime.popef.types import Anchor, Model, Step, TensorType


class IoPlan:
    def __init__(self, model: Model, config: ModelRunnerConfig) -> None:
        self.model = model
        meta = model.metadata
        flow = meta.programFlow()
        self._anchors = {a.name(): a for a in meta.anchors()}
        self.frozen = self._frozen(config)
        main, load = set(flow.main()), set(flow.load())
        self.execute_inputs = [
            a
            for a in self._of(TensorType.INPUT, main)
            if a.name() not in model.tensorData and a.name() not in self.frozen
        ]
        self.execute_outputs = list(self._of(TensorType.OUTPUT, main))
        self.save_outputs = list(self._of(TensorType.OUTPUT, set(flow.save()) - main))
        self.flow_has_save = bool(flow.save())
        self.batch_dim = config.batching_dim if config.dynamic_batching else 0
        self._check_load_inputs(load)
        inputs = [self._slot(a, config) for a in self.execute_inputs]
        outputs = [self._slot(a, config) for a in self.execute_outputs]
        if config.dynamic_batching:
            self._check_batch_extents([*inputs, *outputs], meta.batchSize())
        self.validator = RequestValidator(inputs, outputs, set(self.frozen))
        #: reachable_outputs by the set of inputs given (at most one per subset of names)
        self._reachable: dict[frozenset[str], list[str]] = {}

    # -- descriptions -------------------------------------------------------------
    def descs(self, anchors: list[Anchor]) -> list[DataDesc]:
        return [DataDesc.of(a, a.name() in self.model.tensorData) for a in anchors]

    def all_of(self, direction: TensorType) -> list[Anchor]:
        return [a for a in self._anchors.values() if a.type() is direction]

    def handle(self, name: str) -> str:
        return self._anchors[name].handle()

    def dtype(self, name: str) -> np.dtype[Any]:
        return self._anchors[name].tensorInfo().numpyDType()

    def sample_shape(self, name: str, samples: int) -> tuple[int, ...]:
        shape = self._anchors[name].tensorInfo().shape()
        if not shape:
            return (samples,)
        dim = self.batch_dim if len(shape) > self.batch_dim else 0
        shape[dim] = samples
        return tuple(shape)

    def reachable_outputs(self, provided: set[str]) -> list[str]:
        """Outputs a run writes when only ``provided`` inputs come (conditional execution).

        An output counts when every input streamed in its branch, and in the
        branches around it, is provided -- what a user of the real runtime works
        out by hand from ``popef_dump`` before calling execute.
        """
        key = frozenset(provided)
        known = self._reachable.get(key)
        if known is None:  # a walk of the program per request: worth keeping (few keys)
            executable = self.model.executable
            found: list[str] = []
            for index in self.model.metadata.programFlow().main():
                found.extend(self._walk(executable.program(index).steps, provided, True))
            known = [name for name in dict.fromkeys(found) if name not in self.frozen]
            self._reachable[key] = known
        return list(known)

    # -- helpers --------------------------------------------------------------------
    def _walk(self, steps: tuple[Step, ...], provided: set[str], ok: bool) -> Iterator[str]:
        ins = [s.anchor or "" for s in steps if s.op == "stream_in"]
        ok = ok and all(
            n in provided or n in self.frozen or n in self.model.tensorData for n in ins
        )
        for step in steps:
            if step.op == "stream_out" and ok:
                yield step.anchor or ""
            for branch in step.branches:
                yield from self._walk(branch, provided, ok)

    def _of(self, direction: TensorType, programs: set[int]) -> Iterator[Anchor]:
        for anchor in self._anchors.values():
            if anchor.type() is direction and programs.intersection(anchor.programs()):
                yield anchor

    def _slot(self, anchor: Anchor, config: ModelRunnerConfig) -> TensorSlot:
        info = anchor.tensorInfo()
        shape = tuple(info.shape())
        dim = self.batch_dim
        if shape and dim >= len(shape):
            raise ConfigError(
                f"ModelRunnerConfig.batching_dim={dim} is out of range for tensor "
                f"{anchor.name()!r} of shape {list(shape)}"
            )
        return TensorSlot(
            anchor.name(), shape, info.numpyDType(), dim if shape else 0, config.dynamic_batching
        )

    def _check_batch_extents(self, slots: list[TensorSlot], batch: int) -> None:
        """Samples of one request travel through every queue: all must batch alike, and
        along the dimension that holds the compiled batch -- packing samples along any
        other one would mix rows the model computes differently (spec 3.6: batching_dim
        is "the dimension that contains the value for the batch size")."""
        shaped = [s for s in slots if s.shape]
        extents = {s.name: s.batch for s in shaped}
        if len(set(extents.values())) > 1:
            listed = ", ".join(f"{name} has {extent}" for name, extent in extents.items())
            raise ConfigError(
                f"ModelRunnerConfig.batching_dim={self.batch_dim}: the execute inputs and "
                f"outputs disagree on the compiled batch along that dimension ({listed}); "
                "set batching_dim to the dimension that holds the batch"
            )
        wrong = next((s for s in shaped if s.batch != batch), None)
        if wrong is not None:
            dims = batch_dims((s.shape for s in shaped), batch)
            where = (
                f"the batch is along dimension {' or '.join(map(str, dims))} of every "
                "execute input and output: set batching_dim to it"
                if dims
                else "no dimension holds it in every execute input and output"
            )
            raise ConfigError(
                f"ModelRunnerConfig.batching_dim={self.batch_dim}: the model was compiled for "
                f"batches of {batch}, but tensor {wrong.name!r} of shape {list(wrong.shape)} "
                f"has {wrong.batch} along dimension {self.batch_dim}; {where}"
            )

    def _frozen(self, config: ModelRunnerConfig) -> dict[str, np.ndarray]:
        frozen: dict[str, np.ndarray] = {}
        for name, value in config.frozen_inputs.items():
            anchor = self._anchors.get(name)
            if anchor is None or anchor.type() is not TensorType.INPUT:
                inputs = ", ".join(a.name() for a in self.all_of(TensorType.INPUT))
                raise TensorError(
                    f"frozen input {name!r} is not an input of the model; its inputs are: {inputs}"
                )
            info = anchor.tensorInfo()
            array = np.asarray(value)
            if array.dtype != info.numpyDType() or list(array.shape) != info.shape():
                raise TensorError(
                    f"frozen input {name!r}: expected {info.numpyDType()} "
                    f"{info.shape()}, got {array.dtype} {list(array.shape)}"
                )
            frozen[name] = np.ascontiguousarray(array)
        return frozen

    def _check_load_inputs(self, load: set[int]) -> None:
        for anchor in self._of(TensorType.INPUT, load):
            if anchor.name() not in self.model.tensorData and anchor.name() not in self.frozen:
                raise TensorError(
                    f"anchor {anchor.name()!r} is read by the load program but the model has no "
                    "tensor data for it: load the file that holds its tensor data (weights) "
                    "together with the model (`ipuserve worker --model MODEL --model WEIGHTS`), "
                    "or provide it in ModelRunnerConfig.frozen_inputs"
                )


def batch_dims(shapes: Iterable[Sequence[int]], batch: int) -> list[int]:
    """The dimensions along which every one of ``shapes`` holds ``batch`` (scalars aside):
    where ``batching_dim`` may point for a model compiled for batches of ``batch``."""
    shaped = [tuple(shape) for shape in shapes if len(shape)]
    if not shaped:
        return []
    rank = min(len(shape) for shape in shaped)
    return [dim for dim in range(rank) if all(shape[dim] == batch for shape in shaped)]
