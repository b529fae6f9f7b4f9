"""The tensor handles of :class:`~ipuserve.runtime.popef.builder.GraphBuilder`, and its
named compute ops (``g.add(x, y)``, ``g.matmul(x, w)``, ...), each a shorthand for
``g.op(name, *inputs, **attrs)``. Kept apart so the builder module holds only what
records and checks a graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ipuserve.runtime.popef.graph import TensorSpec

DTypeLike = str | np.dtype[Any] | type[np.generic]


@dataclass(frozen=True)
class Tensor:
    """A handle to a tensor of the graph being built; pass it to the builder's ops.

    ``program`` is ``None`` for state tensors (usable everywhere); ``scope`` is the
    path of (switch id, branch index) pairs the tensor was made in.
    """

    name: str
    spec: TensorSpec
    program: int | None
    scope: tuple[tuple[int, int], ...] = ()

    @property
    def shape(self) -> tuple[int, ...]:
        return self.spec.shape

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.spec.dtype


class OpShorthands:
    """One method per compute op; ``name`` names the result (default: ``<op>_<n>``)."""

    def op(self, op: str, *inputs: Tensor, name: str | None = None, **attrs: Any) -> Tensor:
        raise NotImplementedError

    def identity(self, x: Tensor, name: str | None = None) -> Tensor:
        return self.op("identity", x, name=name)

    def add(self, x: Tensor, y: Tensor, name: str | None = None) -> Tensor:
        return self.op("add", x, y, name=name)

    def sub(self, x: Tensor, y: Tensor, name: str | None = None) -> Tensor:
        return self.op("sub", x, y, name=name)

    def mul(self, x: Tensor, y: Tensor, name: str | None = None) -> Tensor:
        return self.op("mul", x, y, name=name)

    def matmul(self, x: Tensor, y: Tensor, name: str | None = None) -> Tensor:
        return self.op("matmul", x, y, name=name)

    def relu(self, x: Tensor, name: str | None = None) -> Tensor:
        return self.op("relu", x, name=name)

    def gelu(self, x: Tensor, name: str | None = None) -> Tensor:
        return self.op("gelu", x, name=name)

    def tanh(self, x: Tensor, name: str | None = None) -> Tensor:
        return self.op("tanh", x, name=name)

    def sigmoid(self, x: Tensor, name: str | None = None) -> Tensor:
        return self.op("sigmoid", x, name=name)

    def softmax(self, x: Tensor, axis: int = -1, name: str | None = None) -> Tensor:
        return self.op("softmax", x, name=name, axis=axis)

    def layer_norm(
        self, x: Tensor, gamma: Tensor, beta: Tensor, eps: float = 1e-5, name: str | None = None
    ) -> Tensor:
        return self.op("layer_norm", x, gamma, beta, name=name, eps=eps)

    def reshape(self, x: Tensor, shape: Sequence[int], name: str | None = None) -> Tensor:
        return self.op("reshape", x, name=name, shape=list(shape))

    def transpose(
        self, x: Tensor, perm: Sequence[int] | None = None, name: str | None = None
    ) -> Tensor:
        axes = list(range(len(x.shape)))[::-1] if perm is None else list(perm)
        return self.op("transpose", x, name=name, perm=axes)

    def cast(self, x: Tensor, dtype: DTypeLike, name: str | None = None) -> Tensor:
        return self.op("cast", x, name=name, dtype=dtype)

    def fill(
        self, value: int | float, dtype: DTypeLike, shape: Sequence[int], name: str | None = None
    ) -> Tensor:
        return self.op("fill", name=name, value=value, dtype=dtype, shape=list(shape))

    def increment(self, x: Tensor, amount: int | float = 1, name: str | None = None) -> Tensor:
        return self.op("increment", x, name=name, amount=amount)
