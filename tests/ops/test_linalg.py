"""MatMul, Gemm, MatMulInteger, Einsum, Det: shapes, exact integer dtypes, legacy Gemm, gradients."""

from __future__ import annotations

import jax
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import onnxtrain
from nodes import assert_matches_reference, node_model, lowering
from onnxtrain.errors import NodeError

RNG = np.random.default_rng(0)


def ours(op_type: str, inputs: dict[str, np.ndarray], opset: int | None = None, **attrs) -> np.ndarray:
    model = node_model(op_type, inputs, opset=opset, **attrs)
    return np.asarray(onnxtrain.load(model, check=False).infer(inputs)["out0"])


@pytest.mark.parametrize(("a_shape", "b_shape"), [((3,), (3, 2)), ((2, 3), (3,)), ((3,), (3,)),
                                                  ((2, 1, 3, 4), (5, 4, 2)), ((4, 3), (3, 2))])
def test_matmul_shapes(a_shape, b_shape):
    assert_matches_reference("MatMul", {"a": RNG.normal(size=a_shape), "b": RNG.normal(size=b_shape)}, rtol=1e-12)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint32, np.uint64])
def test_matmul_integers_are_exact(dtype):
    big = 2**30 if np.dtype(dtype).itemsize == 8 else 2**14  # products beyond float64 (and float32) precision
    a = np.array([[big, 1], [3, big]], dtype)
    b = np.array([[big, 2], [1, 5]], dtype)
    got = ours("MatMul", {"a": a, "b": b})
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, np.matmul(a.astype(object), b.astype(object)).astype(dtype))


GEMM_CASES = [
    {}, {"transA": 1}, {"transB": 1}, {"transA": 1, "transB": 1, "alpha": 0.5, "beta": 2.0}, {"beta": 0.0},
]


@pytest.mark.parametrize("attrs", GEMM_CASES)
@pytest.mark.parametrize("c_shape", [None, (), (1,), (4,), (3, 1), (3, 4)])
def test_gemm(attrs, c_shape):
    a = RNG.normal(size=(5, 3) if attrs.get("transA") else (3, 5))
    b = RNG.normal(size=(4, 5) if attrs.get("transB") else (5, 4))
    inputs = {"a": a, "b": b}
    if c_shape is not None:
        inputs["c"] = RNG.normal(size=c_shape)
    assert_matches_reference("Gemm", inputs, rtol=1e-12, **attrs)


def test_gemm_beta_zero_ignores_nan_in_c():
    a, b = np.eye(2), np.ones((2, 2))
    got = ours("Gemm", {"a": a, "b": b, "c": np.full((2, 2), np.nan)}, beta=0.0)
    np.testing.assert_array_equal(got, np.ones((2, 2)))


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint64])
def test_gemm_integers_stay_integer(dtype):
    big = 7 if dtype == np.int32 else 2**30  # products past 2**53: float math would round them
    a = np.array([[big, 1], [2, 3]], dtype)
    b = np.array([[1, 2], [3, 4]], dtype)
    c = np.array([10, 20], dtype)
    got = ours("Gemm", {"a": a, "b": b * big, "c": c})
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, (a.astype(object) @ (b * big).astype(object) + c).astype(dtype))


@pytest.mark.parametrize("opset", [1, 6, 7, 9])
def test_gemm_old_versions(opset):
    a, b = RNG.normal(size=(2, 3)), RNG.normal(size=(3, 4))
    c = RNG.normal(size=(4,))
    legacy = {"broadcast": 1} if opset < 7 else {}
    got = ours("Gemm", {"a": a, "b": b, "c": c}, opset=opset, alpha=2.0, beta=0.5, **legacy)
    np.testing.assert_allclose(got, 2.0 * a @ b + 0.5 * c, rtol=1e-12)


def test_gemm_gradient():
    a, b, c = RNG.normal(size=(3, 2)), RNG.normal(size=(3, 4)), RNG.normal(size=(2, 4))
    with jax.enable_x64(True):  # as the engine runs
        gemm_sum = lambda x, y, z: lowering("Gemm")(x, y, z, alpha=2.0, beta=3.0, transA=1).sum()  # noqa: E731
        grads = jax.jit(jax.grad(gemm_sum, argnums=(0, 1, 2)))(a, b, c)
    ones = np.ones((2, 4))
    np.testing.assert_allclose(grads[0], 2.0 * (ones @ b.T).T, rtol=1e-12)
    np.testing.assert_allclose(grads[1], 2.0 * a @ ones, rtol=1e-12)
    np.testing.assert_allclose(grads[2], 3.0 * ones)


def matmul_integer_model(a: np.ndarray, b: np.ndarray, zero_points: dict[str, np.ndarray]) -> onnx.ModelProto:
    names = ["a", "b", "a_zero_point" if "a_zero_point" in zero_points else "", "b_zero_point"]
    names = names if "b_zero_point" in zero_points else names[:3]
    values = {"a": a, "b": b, **zero_points}
    node = helper.make_node("MatMulInteger", names, ["y"])
    inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(values[n].dtype), values[n].shape)
              for n in names if n]
    graph = helper.make_graph([node], "mmi", inputs, [helper.make_tensor_value_info("y", TensorProto.INT32, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 10)])


@pytest.mark.parametrize(("a_dtype", "b_dtype"), [(np.uint8, np.uint8), (np.int8, np.int8), (np.uint8, np.int8)])
@pytest.mark.parametrize("zero_point_kind", ["none", "scalar", "per_row_and_column", "b_only"])
def test_matmul_integer(a_dtype, b_dtype, zero_point_kind):
    a = RNG.integers(np.iinfo(a_dtype).min, np.iinfo(a_dtype).max, size=(2, 3, 4), endpoint=True).astype(a_dtype)
    b = RNG.integers(np.iinfo(b_dtype).min, np.iinfo(b_dtype).max, size=(4, 5), endpoint=True).astype(b_dtype)
    a_zero = {"scalar": np.array(7, a_dtype), "per_row_and_column": np.array([1, 2, 3], a_dtype)}.get(zero_point_kind)
    b_zero = {"scalar": np.array(9, b_dtype), "per_row_and_column": np.arange(5).astype(b_dtype),
              "b_only": np.array(5, b_dtype)}.get(zero_point_kind)
    zero_points = {k: v for k, v in {"a_zero_point": a_zero, "b_zero_point": b_zero}.items() if v is not None}
    feeds = {"a": a, "b": b, **zero_points}
    got = np.asarray(onnxtrain.load(matmul_integer_model(a, b, zero_points), check=False).infer(feeds)["y"])
    shifted_a = a.astype(np.int64) - (0 if a_zero is None else a_zero.astype(np.int64).reshape(-1, 1))
    shifted_b = b.astype(np.int64) - (0 if b_zero is None else b_zero.astype(np.int64))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, shifted_a @ shifted_b)


EINSUM_CASES = [
    ("ij,jk->ik", [(2, 3), (3, 4)]), ("ij,jk", [(2, 3), (3, 4)]), ("ii", [(3, 3)]), ("ii->i", [(3, 3)]),
    ("bij, bjk -> bik", [(2, 2, 3), (2, 3, 4)]), ("...ij,...jk", [(2, 2, 3), (1, 3, 4)]), ("ij->", [(2, 3)]),
    ("i,i", [(4,)] * 2), ("i,j", [(2,), (3,)]), ("Ba,aC", [(2, 3), (3, 4)]), ("ji", [(2, 3)]),
]


@pytest.mark.parametrize(("equation", "shapes"), EINSUM_CASES)
def test_einsum(equation, shapes):
    inputs = {f"x{i}": RNG.normal(size=s) for i, s in enumerate(shapes)}
    assert_matches_reference("Einsum", inputs, equation=equation, rtol=1e-12)


def test_einsum_implicit_output_puts_upper_case_first():
    """'aB' has implicit output 'Ba' (ASCII order): the result is transposed."""
    x = RNG.normal(size=(2, 3))
    np.testing.assert_allclose(ours("Einsum", {"x": x}, equation="aB"), x.T)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_einsum_integers_are_exact(dtype):
    a = np.array([[2**14 + 1, 3], [5, 7]], dtype)
    got = ours("Einsum", {"a": a, "b": a}, equation="ij,jk->ik")
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, (a.astype(object) @ a.astype(object)).astype(dtype))


def test_einsum_term_count_mismatch_is_a_node_error():
    with pytest.raises(NodeError, match="Einsum.*2 operand terms"):
        ours("Einsum", {"x": np.ones((2, 2))}, equation="ij,jk")


@pytest.mark.parametrize("shape", [(3, 3), (2, 4, 4), (1, 1)])
def test_det(shape):
    assert_matches_reference("Det", {"x": RNG.normal(size=shape)}, rtol=1e-10)


def test_det_float16_keeps_its_type():
    x = np.array([[2.0, 1.0], [1.0, 3.0]], np.float16)
    got = ours("Det", {"x": x})
    assert got.dtype == np.float16 and got.shape == ()
    np.testing.assert_allclose(got, 5.0, rtol=1e-3)


def test_det_gradient_is_det_times_inverse_transpose():
    x = RNG.normal(size=(3, 3))
    with jax.enable_x64(True):
        grad = jax.jit(jax.grad(lowering("Det")))(x)
    np.testing.assert_allclose(grad, np.linalg.det(x) * np.linalg.inv(x).T, rtol=1e-9)
