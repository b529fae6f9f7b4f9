"""Every kernel against a numpy expression written here, and shape/dtype inference."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from ipuserve.runtime.popef import OPS, TensorSpec
from ipuserve.runtime.popef.graph import infer

rng = np.random.default_rng(1234)


def normal(*shape: int, dtype: str = "float32") -> np.ndarray[Any, Any]:
    return rng.standard_normal(shape).astype(dtype)


def spec(array: np.ndarray[Any, Any]) -> TensorSpec:
    return TensorSpec(array.shape, array.dtype)


def run(op: str, *inputs: np.ndarray[Any, Any], **attrs: Any) -> np.ndarray[Any, Any]:
    """Run the kernel, checking first that inference predicts its result exactly."""
    predicted = infer(op, [spec(x) for x in inputs], attrs)
    result = OPS[op].run(list(inputs), attrs)
    assert result.shape == predicted.shape, (op, result.shape, predicted.shape)
    assert result.dtype == predicted.dtype, (op, result.dtype, predicted.dtype)
    return result


def gelu64(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The exact (erf) gelu, to check the tanh approximation is the right one."""
    erf = np.vectorize(math.erf)
    result: np.ndarray[Any, Any] = 0.5 * x * (1 + erf(x / math.sqrt(2)))
    return result


# -- kernels versus numpy -------------------------------------------------------------


def test_identity_returns_the_same_object() -> None:
    x = normal(2, 3)
    assert run("identity", x) is x


@pytest.mark.parametrize(
    ("op", "expected"),
    [("add", lambda a, b: a + b), ("sub", lambda a, b: a - b), ("mul", lambda a, b: a * b)],
)
def test_binary_ops_broadcast_like_numpy(op: str, expected: Any) -> None:
    a, b = normal(3, 4), normal(4)
    np.testing.assert_array_equal(run(op, a, b), expected(a, b))
    np.testing.assert_array_equal(run(op, b, a), expected(b, a))


@pytest.mark.parametrize(
    ("a_shape", "b_shape"),
    [
        ((3, 5), (5, 2)),  # plain
        ((4, 3, 5), (5, 2)),  # batched left operand
        ((4, 3, 5), (4, 5, 2)),  # batched both
        ((1, 3, 5), (6, 5, 2)),  # broadcast batch
    ],
)
def test_matmul_matches_float64_product(a_shape: tuple[int, ...], b_shape: tuple[int, ...]) -> None:
    a, b = normal(*a_shape), normal(*b_shape)
    expected = np.einsum("...ik,...kj->...ij", a.astype(np.float64), b.astype(np.float64))
    np.testing.assert_allclose(run("matmul", a, b), expected, rtol=1e-5, atol=1e-5)


def test_matmul_float16_accumulates_in_float32() -> None:
    a, b = normal(8, 512, dtype="float16"), normal(512, 4, dtype="float16")
    result = run("matmul", a, b)
    expected = a.astype(np.float64) @ b.astype(np.float64)
    # one float16 rounding of the result, not 512 accumulated ones
    np.testing.assert_allclose(result, expected, rtol=2e-3, atol=2e-2)


def test_matmul_of_integers_is_exact() -> None:
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    b = np.arange(12, dtype=np.int32).reshape(3, 4)
    np.testing.assert_array_equal(run("matmul", a, b), [[20, 23, 26, 29], [56, 68, 80, 92]])


def test_relu_zeroes_negatives_of_any_numeric_dtype() -> None:
    np.testing.assert_array_equal(
        run("relu", np.array([-2.5, 0.0, 3.0], np.float32)), [0.0, 0.0, 3.0]
    )
    np.testing.assert_array_equal(run("relu", np.array([-2, 7], np.int8)), [0, 7])


def test_gelu_is_the_tanh_approximation() -> None:
    x = np.linspace(-6, 6, 101).astype(np.float32)
    x64 = x.astype(np.float64)
    tanh_form = 0.5 * x64 * (1 + np.tanh(math.sqrt(2 / math.pi) * (x64 + 0.044715 * x64**3)))
    np.testing.assert_allclose(run("gelu", x), tanh_form, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(run("gelu", x), gelu64(x64), atol=1e-3)


def test_gelu_float16_stays_float16_without_overflow() -> None:
    x = np.array([-300.0, -1.0, 0.5, 300.0], np.float16)
    np.testing.assert_allclose(
        run("gelu", x).astype(np.float64), gelu64(x.astype(np.float64)), rtol=2e-3, atol=1e-3
    )


def test_tanh_and_sigmoid() -> None:
    x = normal(5, 7) * 4
    np.testing.assert_allclose(run("tanh", x), np.tanh(x.astype(np.float64)), rtol=1e-6)
    sig = 1 / (1 + np.exp(-x.astype(np.float64)))
    np.testing.assert_allclose(run("sigmoid", x), sig, rtol=1e-5, atol=1e-7)


def test_sigmoid_saturates_without_overflow_warnings() -> None:
    # pytest turns warnings into errors: an exp(1000) overflow would fail this test
    np.testing.assert_array_equal(
        run("sigmoid", np.array([-1000.0, 1000.0], np.float32)), [0.0, 1.0]
    )


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_softmax_along_an_axis(axis: int) -> None:
    x = normal(3, 4) * 3
    e = np.exp(x.astype(np.float64))
    expected = e / e.sum(axis=axis, keepdims=True)
    np.testing.assert_allclose(run("softmax", x, axis=axis), expected, rtol=1e-5)


def test_softmax_of_huge_logits_is_stable() -> None:
    result = run("softmax", np.array([[1000.0, 1000.0, -1000.0]], np.float32), axis=-1)
    np.testing.assert_allclose(result, [[0.5, 0.5, 0.0]])


def test_layer_norm_normalises_the_last_axis() -> None:
    x, gamma, beta = normal(4, 6) * 3 + 1, normal(6), normal(6)
    x64 = x.astype(np.float64)
    mean = x64.mean(axis=-1, keepdims=True)
    std = np.sqrt(((x64 - mean) ** 2).mean(axis=-1, keepdims=True) + 1e-5)
    expected = (x64 - mean) / std * gamma + beta
    np.testing.assert_allclose(
        run("layer_norm", x, gamma, beta, eps=1e-5), expected, rtol=1e-4, atol=1e-5
    )


def test_reshape_resolves_minus_one() -> None:
    x = normal(2, 3, 4)
    result = run("reshape", x, shape=[4, -1])
    assert result.shape == (4, 6)
    np.testing.assert_array_equal(result, x.reshape(4, 6))


def test_transpose_permutes_axes_into_a_contiguous_array() -> None:
    x = normal(2, 3, 4)
    result = run("transpose", x, perm=[2, 0, 1])
    np.testing.assert_array_equal(result, np.moveaxis(x, 2, 0))
    assert result.flags.c_contiguous


def test_cast_converts_dtype() -> None:
    result = run("cast", np.array([1.7, -2.2], np.float32), dtype="int32")
    np.testing.assert_array_equal(result, [1, -2])


def test_fill_needs_no_inputs() -> None:
    np.testing.assert_array_equal(
        run("fill", value=7, dtype="int64", shape=[2, 2]), np.full((2, 2), 7, np.int64)
    )


def test_increment_keeps_the_counter_dtype() -> None:
    np.testing.assert_array_equal(run("increment", np.array([41], np.int64), amount=1), [42])
    np.testing.assert_allclose(run("increment", np.array([1.0], np.float16), amount=0.5), [1.5])


def test_kernels_never_write_into_their_inputs() -> None:
    x = normal(3, 4)
    x.flags.writeable = False  # a kernel writing in place would raise here
    for op, attrs in [
        ("relu", {}),
        ("gelu", {}),
        ("softmax", {"axis": -1}),
        ("sigmoid", {}),
        ("tanh", {}),
    ]:
        run(op, x, **attrs)
    run("increment", np.array([1], np.int64), amount=1)


# -- FLOP counts ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("op", "shapes", "attrs", "flops"),
    [
        ("matmul", [(5, 2, 3), (3, 4)], {}, 2 * 2 * 3 * 4 * 5),
        ("add", [(3, 4), (4,)], {}, 12),
        ("relu", [(3, 4)], {}, 12),
        ("gelu", [(3, 4)], {}, 8 * 12),
        ("softmax", [(3, 4)], {"axis": -1}, 5 * 12),
        ("layer_norm", [(3, 4), (4,), (4,)], {"eps": 1e-5}, 8 * 12),
        ("reshape", [(3, 4)], {"shape": [12]}, 0),
        ("transpose", [(3, 4)], {"perm": [1, 0]}, 0),
        ("identity", [(3, 4)], {}, 0),
    ],
)
def test_flop_counts(
    op: str, shapes: list[tuple[int, ...]], attrs: dict[str, Any], flops: int
) -> None:
    inputs = [TensorSpec(s, np.dtype(np.float32)) for s in shapes]
    assert OPS[op].flops(inputs, infer(op, inputs, attrs)) == flops


# -- inference rejects what the kernels cannot do -------------------------------------

F32, F16, I32 = np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.int32)


@pytest.mark.parametrize(
    ("op", "inputs", "attrs", "message"),
    [
        ("add", [((2, 3), F32), ((2, 3), F16)], {}, r"share one dtype.*float32\[2, 3\].*float16"),
        ("mul", [((2, 3), F32), ((4,), F32)], {}, r"shapes \[2, 3\] and \[4\] do not broadcast"),
        ("matmul", [((2, 3), F32), ((4, 5), F32)], {}, r"inner dimensions differ.*3 != 4"),
        ("matmul", [((3,), F32), ((3, 5), F32)], {}, r"rank >= 2"),
        ("softmax", [((2, 3), F32)], {"axis": 2}, r"axis 2 is out of range"),
        ("softmax", [((2, 3), I32)], {"axis": 1}, r"floating-point"),
        ("gelu", [((2, 3), I32)], {}, r"floating-point"),
        (
            "layer_norm",
            [((2, 3), F32), ((2,), F32), ((3,), F32)],
            {"eps": 1e-5},
            r"gamma and beta must have shape \[3\]",
        ),
        ("reshape", [((2, 3), F32)], {"shape": [4, -1]}, r"cannot reshape"),
        ("reshape", [((2, 3), F32)], {"shape": [-1, -1]}, r"at most one -1"),
        ("transpose", [((2, 3), F32)], {"perm": [0, 0]}, r"not a permutation"),
        ("cast", [((2,), F32)], {"dtype": "complex64"}, r"unsupported dtype 'complex64'"),
        ("fill", [], {"value": 1, "dtype": "int32", "shape": [-1]}, r"negative dimension"),
        ("increment", [((1,), np.dtype(np.int64))], {"amount": 0.5}, r"not an integer"),
        ("softmax", [((2, 3), F32)], {}, r"missing attribute 'axis'"),
        ("add", [((2, 3), F32)], {}, r"takes 2 inputs, got 1"),
    ],
)
def test_inference_errors_name_the_op_and_shapes(
    op: str, inputs: list[Any], attrs: dict[str, Any], message: str
) -> None:
    specs = [TensorSpec(shape, dtype) for shape, dtype in inputs]
    with pytest.raises(ValueError, match=rf"^{op}: .*{message}"):
        infer(op, specs, attrs)


def test_unknown_op_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown op 'conv2d'; known ops: .*matmul"):
        infer("conv2d", [], {})
