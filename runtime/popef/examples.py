"""The example models, and plain-numpy references to check what the runtime computes.

==========  =====================================================================
``simple``  the spec's ``output = tensor_A * weights + tensor_B`` (F32, [B, 4]);
            ``weights`` [4] is tensor data; the save program streams back
            ``run_count`` (int64 [1]), a device-side count of main-program runs.
``mlp``     a real-sized MLP: ``input`` [B, 784] -> 2 x (dense 1024 + gelu) ->
            dense 10 = ``logits``, and ``probs`` = softmax(logits); batch 16.
``noop``    ``output`` = identity(``input``), [B, elements]; takes no simulated
            time (``zero_time``), to measure the serving fabric on its own.
``branches`` conditional execution on ``branch`` (int32 [B]; the first sample's
            value picks the branch): 0 -> ``a_output`` = relu(a_input @ Wa) [B, 4],
            1 -> ``b_output`` = softmax(b_input @ Wb) [B, 3].
==========  =====================================================================

Each builder function returns a :class:`GraphBuilder` (``.build()`` / ``.write()``).
Weights come from ``numpy.random.default_rng(seed)``, so a seed names a model.
:func:`reference` recomputes a main-program run with numpy alone, in float64, never
touching :mod:`~ipuserve.runtime.popef.ops`: tests compare the interpreter with it.
"""

from __future__ import annotations

import inspect
import itertools
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from ipuserve.runtime.popef.builder import MAIN, GraphBuilder
from ipuserve.runtime.popef.types import Model, TensorType

Array = npt.NDArray[Any]


# -- builders -------------------------------------------------------------------------


def simple(*, batch_size: int = 1, seed: int = 0, batch_dim: int = 0) -> GraphBuilder:
    """``output = tensor_A * weights + tensor_B``; ``batch_dim=1`` makes the I/O [4, B]."""
    g = GraphBuilder("simple", batch_size=batch_size, batch_dim=batch_dim)
    shape = (batch_size, 4) if batch_dim == 0 else (4, batch_size)
    a = g.input("tensor_A", shape, "float32")
    b = g.input("tensor_B", shape, "float32")
    weights = g.weight("weights", np.random.default_rng(seed).standard_normal(4, np.float32))
    if batch_dim == 1:
        weights = g.reshape(weights, (4, 1), name="weights_column")
    g.output("output", g.add(g.mul(a, weights), b))
    g.save_output("run_count", g.counter("run_count", dtype="int64"))
    return g


def mlp(
    *,
    batch_size: int = 16,
    input_size: int = 784,
    hidden_size: int = 1024,
    layers: int = 2,
    outputs: int = 10,
    dtype: str = "float32",
    seed: int = 0,
) -> GraphBuilder:
    """Dense layers with gelu, then ``logits`` and ``probs``; weights ~ N(0, 1/fan_in)."""
    if dtype not in ("float16", "float32"):
        raise ValueError(f"mlp dtype must be float16 or float32, got {dtype!r}")
    g = GraphBuilder("mlp", batch_size=batch_size)
    rng = np.random.default_rng(seed)
    h = g.input("input", (batch_size, input_size), dtype)
    sizes = [input_size] + [hidden_size] * layers + [outputs]
    for layer, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
        prefix = f"hidden{layer}" if layer < layers else "output"
        w = g.weight(
            f"{prefix}.weight",
            (rng.standard_normal((fan_in, fan_out)) / math.sqrt(fan_in)).astype(dtype),
        )
        b = g.weight(f"{prefix}.bias", (0.1 * rng.standard_normal(fan_out)).astype(dtype))
        h = g.add(g.matmul(h, w), b)
        if layer < layers:
            h = g.gelu(h)
    g.output("logits", h)
    g.output("probs", g.softmax(h, axis=-1))
    return g


def noop(
    *, batch_size: int = 1, elements: int = 1024, dtype: str = "float32", batch_dim: int = 0
) -> GraphBuilder:
    """``output = input`` without a copy; e.g. ``elements=1 << 20`` gives 4 MiB samples."""
    g = GraphBuilder("noop", batch_size=batch_size, batch_dim=batch_dim, zero_time=True)
    shape = (batch_size, elements) if batch_dim == 0 else (elements, batch_size)
    g.output("output", g.identity(g.input("input", shape, dtype)))
    return g


def branches(*, batch_size: int = 1, seed: int = 0) -> GraphBuilder:
    """Two models in one executable, chosen per run by ``branch`` (see the module docs)."""
    g = GraphBuilder("branches", batch_size=batch_size)
    rng = np.random.default_rng(seed)
    wa = g.weight("a_weight", rng.standard_normal((4, 4), np.float32))
    wb = g.weight("b_weight", rng.standard_normal((8, 3), np.float32))
    selector = g.input("branch", (batch_size,), "int32")
    with g.switch(selector) as sw:
        with sw.branch():
            g.output("a_output", g.relu(g.matmul(g.input("a_input", (batch_size, 4)), wa)))
        with sw.branch():
            g.output("b_output", g.softmax(g.matmul(g.input("b_input", (batch_size, 8)), wb)))
    return g


EXAMPLES: dict[str, Callable[..., GraphBuilder]] = {
    "simple": simple,
    "mlp": mlp,
    "noop": noop,
    "branches": branches,
}


def options(name: str) -> list[str]:
    """The keyword options example ``name`` accepts."""
    return list(inspect.signature(_builder(name)).parameters)


def build(name: str, **opts: Any) -> Model:
    """Example ``name`` as an in-memory Model."""
    return _builder(name)(**opts).build()


def _builder(name: str) -> Callable[..., GraphBuilder]:
    try:
        return EXAMPLES[name]
    except KeyError:
        raise ValueError(f"unknown example {name!r}; examples: {', '.join(EXAMPLES)}") from None


# -- references -----------------------------------------------------------------------


def reference(
    name: str, inputs: Mapping[str, Array], tensor_data: Mapping[str, Array], **opts: Any
) -> dict[str, Array]:
    """What one main-program run of example ``name`` must output, computed in float64
    and rounded to each output's dtype. ``opts`` repeats build options that change
    the maths (only ``batch_dim`` for ``simple``)."""
    _builder(name)  # an unknown name raises the same ValueError as build()
    return _REFERENCES[name](inputs, tensor_data, **opts)


def tensor_arrays(model: Model) -> dict[str, Array]:
    """``{name: array}`` of a model's tensor data, as :func:`reference` takes it."""
    return {name: data.array() for name, data in model.tensorData.items()}


def sample_inputs(model: Model, seed: int = 0) -> dict[str, Array]:
    """Random main-program inputs for ``model``: floats ~ N(0, 1), integers 0."""
    rng = np.random.default_rng(seed)
    samples = {}
    for anchor in model.metadata.anchors():
        if anchor.type() is not TensorType.INPUT or MAIN not in anchor.programs():
            continue
        info = anchor.tensorInfo()
        dtype = info.numpyDType()
        samples[anchor.name()] = (
            rng.standard_normal(info.shape()).astype(dtype)
            if dtype.kind == "f"
            else np.zeros(info.shape(), dtype)
        )
    return samples


def _f64(array: Array) -> Array:
    return np.asarray(array, dtype=np.float64)


def _simple_reference(
    inputs: Mapping[str, Array], data: Mapping[str, Array], batch_dim: int = 0
) -> dict[str, Array]:
    weights = _f64(data["weights"])
    if batch_dim == 1:
        weights = weights[:, np.newaxis]
    output = _f64(inputs["tensor_A"]) * weights + _f64(inputs["tensor_B"])
    return {"output": output.astype(np.float32)}


def _mlp_reference(inputs: Mapping[str, Array], data: Mapping[str, Array]) -> dict[str, Array]:
    dtype = inputs["input"].dtype
    h = _f64(inputs["input"])
    layer = 0
    while f"hidden{layer}.weight" in data:
        pre = h @ _f64(data[f"hidden{layer}.weight"]) + _f64(data[f"hidden{layer}.bias"])
        h = 0.5 * pre * (1 + np.tanh(np.sqrt(2 / np.pi) * (pre + 0.044715 * pre**3)))
        layer += 1
    logits = h @ _f64(data["output.weight"]) + _f64(data["output.bias"])
    return {"logits": logits.astype(dtype), "probs": _softmax64(logits).astype(dtype)}


def _noop_reference(inputs: Mapping[str, Array], _data: Mapping[str, Array]) -> dict[str, Array]:
    return {"output": np.array(inputs["input"], copy=True)}


def _branches_reference(inputs: Mapping[str, Array], data: Mapping[str, Array]) -> dict[str, Array]:
    chosen = int(np.asarray(inputs["branch"]).flat[0])
    if chosen == 0:
        a = _f64(inputs["a_input"]) @ _f64(data["a_weight"])
        return {"a_output": np.where(a > 0, a, 0.0).astype(np.float32)}
    if chosen == 1:
        b = _f64(inputs["b_input"]) @ _f64(data["b_weight"])
        return {"b_output": _softmax64(b).astype(np.float32)}
    raise ValueError(f"branches has branches 0 and 1, got selector {chosen}")


def _softmax64(x: Array) -> Array:
    shifted = np.exp(x - np.max(x, axis=-1, keepdims=True))
    result: Array = shifted / np.sum(shifted, axis=-1, keepdims=True)
    return result


_REFERENCES: dict[str, Callable[..., dict[str, Array]]] = {
    "simple": _simple_reference,
    "mlp": _mlp_reference,
    "noop": _noop_reference,
    "branches": _branches_reference,
}
