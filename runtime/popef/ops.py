"""The compute ops of the simulated executable: shape inference, FLOP counts, kernels.

Every op has three parts, kept side by side so they cannot drift apart:

* ``infer(inputs, attrs) -> TensorSpec``: shape and dtype of the result. The builder
  calls it as ops are added (to validate the graph and size device memory); it
  raises ``ValueError`` describing the shapes it could not accept.
* ``flops(inputs, output) -> int``: the work the cost model charges for the step.
* ``run(inputs, attrs) -> ndarray``: the numpy kernel. Kernels never write into
  their inputs. ``float16`` work is done in ``float32`` and rounded once at the end,
  as the IPU accumulates half-precision matmuls and reductions in single precision
  (it is also much faster in numpy).

Use these through :mod:`ipuserve.runtime.popef.graph`, which re-exports them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ipuserve.runtime.popef.types import DataType

Array = npt.NDArray[Any]
Attrs = Mapping[str, Any]
Kernel = Callable[[Sequence[Array], Attrs], Array]

STREAM_OPS = frozenset({"stream_in", "stream_out", "switch"})
_GELU_C = math.sqrt(2.0 / math.pi)


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of a tensor, as far as shape inference is concerned."""

    shape: tuple[int, ...]
    dtype: np.dtype[Any]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def __str__(self) -> str:
        return f"{self.dtype.name}{list(self.shape)}"


@dataclass(frozen=True)
class OpDef:
    """One compute op. ``aliases`` ops (identity, reshape) allocate no new memory."""

    name: str
    num_inputs: int
    infer: Callable[[Sequence[TensorSpec], Attrs], TensorSpec]
    flops: Callable[[Sequence[TensorSpec], TensorSpec], int]
    run: Kernel
    aliases: bool = False


# -- shape inference ------------------------------------------------------------------


def _same(inputs: Sequence[TensorSpec], _attrs: Attrs) -> TensorSpec:
    return inputs[0]


def _floating(inputs: Sequence[TensorSpec], attrs: Attrs) -> TensorSpec:
    for spec in inputs:
        if spec.dtype.kind != "f":
            raise ValueError(f"needs floating-point inputs, got {spec}")
    return inputs[0]


def _same_dtypes(inputs: Sequence[TensorSpec]) -> np.dtype[Any]:
    dtypes = {spec.dtype for spec in inputs}
    if len(dtypes) > 1:
        found = ", ".join(str(s) for s in inputs)
        raise ValueError(f"inputs must share one dtype (insert a cast), got {found}")
    return inputs[0].dtype


def _broadcast(inputs: Sequence[TensorSpec], _attrs: Attrs) -> TensorSpec:
    dtype = _same_dtypes(inputs)
    try:
        shape = np.broadcast_shapes(*(spec.shape for spec in inputs))
    except ValueError:
        found = " and ".join(str(list(s.shape)) for s in inputs)
        raise ValueError(f"shapes {found} do not broadcast") from None
    return TensorSpec(tuple(shape), dtype)


def _matmul(inputs: Sequence[TensorSpec], _attrs: Attrs) -> TensorSpec:
    a, b = inputs
    dtype = _same_dtypes(inputs)
    if len(a.shape) < 2 or len(b.shape) < 2:
        raise ValueError(f"needs operands of rank >= 2, got {a} and {b}")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"inner dimensions differ: {a} @ {b} ({a.shape[-1]} != {b.shape[-2]})")
    try:
        batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except ValueError:
        raise ValueError(f"batch dimensions of {a} and {b} do not broadcast") from None
    return TensorSpec((*batch, a.shape[-2], b.shape[-1]), dtype)


def _axis(spec: TensorSpec, axis: Any) -> int:
    rank = len(spec.shape)
    if not isinstance(axis, int) or not -rank <= axis < rank:
        raise ValueError(f"axis {axis!r} is out of range for {spec}")
    return axis


def _softmax(inputs: Sequence[TensorSpec], attrs: Attrs) -> TensorSpec:
    _axis(inputs[0], _attr(attrs, "axis"))
    return _floating(inputs, attrs)


def _layer_norm(inputs: Sequence[TensorSpec], attrs: Attrs) -> TensorSpec:
    x, gamma, beta = inputs
    _floating(inputs, attrs)
    _same_dtypes(inputs)
    if not x.shape or gamma.shape != (x.shape[-1],) or beta.shape != (x.shape[-1],):
        raise ValueError(
            f"gamma and beta must have shape [{x.shape[-1] if x.shape else '?'}] "
            f"(the last dimension of {x}), got {gamma} and {beta}"
        )
    if float(_attr(attrs, "eps")) <= 0:
        raise ValueError(f"eps must be > 0, got {attrs['eps']!r}")
    return x


def _reshape(inputs: Sequence[TensorSpec], attrs: Attrs) -> TensorSpec:
    source = inputs[0]
    shape = [int(d) for d in _attr(attrs, "shape")]
    if shape.count(-1) > 1 or any(d < -1 for d in shape):
        raise ValueError(f"shape {shape} may hold at most one -1 and no other negatives")
    known = math.prod(d for d in shape if d != -1)
    if -1 in shape:
        if known == 0 or source.numel % known:
            raise ValueError(f"cannot reshape {source} to {shape}")
        shape[shape.index(-1)] = source.numel // known
    if math.prod(shape) != source.numel:
        raise ValueError(f"cannot reshape {source} ({source.numel} elements) to {shape}")
    return TensorSpec(tuple(shape), source.dtype)


def _transpose(inputs: Sequence[TensorSpec], attrs: Attrs) -> TensorSpec:
    source = inputs[0]
    perm = [int(p) for p in _attr(attrs, "perm")]
    if sorted(perm) != list(range(len(source.shape))):
        raise ValueError(f"perm {perm} is not a permutation of the axes of {source}")
    return TensorSpec(tuple(source.shape[p] for p in perm), source.dtype)


def _cast(inputs: Sequence[TensorSpec], attrs: Attrs) -> TensorSpec:
    return TensorSpec(inputs[0].shape, _dtype_attr(attrs))


def _fill(_inputs: Sequence[TensorSpec], attrs: Attrs) -> TensorSpec:
    shape = tuple(int(d) for d in _attr(attrs, "shape"))
    if any(d < 0 for d in shape):
        raise ValueError(f"negative dimension in shape {list(shape)}")
    dtype = _dtype_attr(attrs)
    _check_scalar(_attr(attrs, "value"), dtype, "value")
    return TensorSpec(shape, dtype)


def _increment(inputs: Sequence[TensorSpec], attrs: Attrs) -> TensorSpec:
    if inputs[0].dtype.kind not in "iuf":
        raise ValueError(f"needs a numeric counter, got {inputs[0]}")
    _check_scalar(_attr(attrs, "amount"), inputs[0].dtype, "amount")
    return inputs[0]


def _attr(attrs: Attrs, key: str) -> Any:
    if key not in attrs:
        raise ValueError(f"missing attribute {key!r}")
    return attrs[key]


def _dtype_attr(attrs: Attrs) -> np.dtype[Any]:
    dtype: np.dtype[Any] = DataType.from_numpy(_attr(attrs, "dtype")).numpy
    return dtype


def _check_scalar(value: Any, dtype: np.dtype[Any], what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{what} must be a number, got {value!r}")
    if dtype.kind in "iub" and not float(value).is_integer():
        raise ValueError(f"{what} {value!r} is not an integer, as {dtype.name} needs")


# -- FLOP counts ----------------------------------------------------------------------


def _per_element(factor: int) -> Callable[[Sequence[TensorSpec], TensorSpec], int]:
    return lambda _inputs, output: factor * output.numel


def _matmul_flops(inputs: Sequence[TensorSpec], output: TensorSpec) -> int:
    return 2 * inputs[0].shape[-1] * output.numel  # 2*M*K*N per batch entry


# -- kernels --------------------------------------------------------------------------


def _wide(x: Array) -> Array:
    """float16 is computed in float32 (see the module docstring)."""
    return x.astype(np.float32) if x.dtype == np.float16 else x


def _identity(inputs: Sequence[Array], _attrs: Attrs) -> Array:
    return inputs[0]  # the very same object: noop serving is zero-copy


def _matmul_kernel(inputs: Sequence[Array], _attrs: Attrs) -> Array:
    a, b = inputs
    product: Array = np.matmul(_wide(a), _wide(b))
    return product.astype(a.dtype, copy=False)


def _relu_kernel(inputs: Sequence[Array], _attrs: Attrs) -> Array:
    x = inputs[0]
    result: Array = np.maximum(x, x.dtype.type(0))
    return result


def _gelu_kernel(inputs: Sequence[Array], _attrs: Attrs) -> Array:
    x = _wide(inputs[0])
    y: Array = 0.5 * x * (1.0 + np.tanh(_GELU_C * (x + 0.044715 * x * x * x)))
    return y.astype(inputs[0].dtype, copy=False)


def _sigmoid_kernel(inputs: Sequence[Array], _attrs: Attrs) -> Array:
    result: Array = 0.5 * (np.tanh(0.5 * inputs[0]) + 1.0)  # cannot overflow like exp(-x)
    return result


def _softmax_kernel(inputs: Sequence[Array], attrs: Attrs) -> Array:
    x = _wide(inputs[0])
    axis = attrs["axis"]
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    y: Array = e / e.sum(axis=axis, keepdims=True)
    return y.astype(inputs[0].dtype, copy=False)


def _layer_norm_kernel(inputs: Sequence[Array], attrs: Attrs) -> Array:
    x, gamma, beta = (_wide(t) for t in inputs)
    centred = x - x.mean(axis=-1, keepdims=True)
    variance = (centred * centred).mean(axis=-1, keepdims=True)
    y: Array = centred / np.sqrt(variance + float(attrs["eps"])) * gamma + beta
    return y.astype(inputs[0].dtype, copy=False)


def _increment_kernel(inputs: Sequence[Array], attrs: Attrs) -> Array:
    x = inputs[0]
    result: Array = x + np.asarray(attrs["amount"], dtype=x.dtype)
    return result


def _elementwise(ufunc: np.ufunc) -> Kernel:
    def kernel(inputs: Sequence[Array], _attrs: Attrs) -> Array:
        result: Array = ufunc(*inputs)
        return result

    return kernel


OPS: dict[str, OpDef] = {
    op.name: op
    for op in (
        OpDef("identity", 1, _same, _per_element(0), _identity, aliases=True),
        OpDef("add", 2, _broadcast, _per_element(1), _elementwise(np.add)),
        OpDef("sub", 2, _broadcast, _per_element(1), _elementwise(np.subtract)),
        OpDef("mul", 2, _broadcast, _per_element(1), _elementwise(np.multiply)),
        OpDef("matmul", 2, _matmul, _matmul_flops, _matmul_kernel),
        OpDef("relu", 1, _same, _per_element(1), _relu_kernel),
        OpDef("gelu", 1, _floating, _per_element(8), _gelu_kernel),
        OpDef("tanh", 1, _floating, _per_element(1), _elementwise(np.tanh)),
        OpDef("sigmoid", 1, _floating, _per_element(1), _sigmoid_kernel),
        OpDef("softmax", 1, _softmax, _per_element(5), _softmax_kernel),
        OpDef("layer_norm", 3, _layer_norm, _per_element(8), _layer_norm_kernel),
        OpDef(
            "reshape",
            1,
            _reshape,
            _per_element(0),
            lambda inputs, attrs: np.reshape(inputs[0], attrs["shape"]),
            aliases=True,
        ),
        OpDef(
            "transpose",
            1,
            _transpose,
            _per_element(0),
            lambda inputs, attrs: np.ascontiguousarray(np.transpose(inputs[0], attrs["perm"])),
        ),
        OpDef(
            "cast",
            1,
            _cast,
            _per_element(1),
            lambda inputs, attrs: inputs[0].astype(attrs["dtype"]),
        ),
        OpDef(
            "fill",
            0,
            _fill,
            _per_element(0),
            lambda _inputs, attrs: np.full(attrs["shape"], attrs["value"], dtype=attrs["dtype"]),
        ),
        OpDef("increment", 1, _increment, _per_element(1), _increment_kernel),
    )
}


def op_def(name: str) -> OpDef:
    """The compute op called ``name``; ValueError listing the known ops otherwise."""
    try:
        return OPS[name]
    except KeyError:
        raise ValueError(f"unknown op {name!r}; known ops: {', '.join(sorted(OPS))}") from None


def infer(
    op: str, inputs: Sequence[TensorSpec], attrs: Attrs, label: str | None = None
) -> TensorSpec:
    """Result spec of ``op`` applied to ``inputs``.

    ValueError if the op rejects them; the message starts with ``label`` (default:
    the op's name), so callers can say which tensors were involved.
    """
    definition = op_def(op)
    prefix = label or op
    if len(inputs) != definition.num_inputs:
        raise ValueError(f"{prefix}: takes {definition.num_inputs} inputs, got {len(inputs)}")
    try:
        return definition.infer(inputs, attrs)
    except ValueError as e:
        raise ValueError(f"{prefix}: {e}") from None
