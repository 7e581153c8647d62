"""Elementwise math: dtypes kept exact, integer semantics, legacy versions, strings, gradients, errors."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from nodes import assert_matches_reference, node_model, lowering
from onnxtrain.errors import NodeError


def ours(op_type: str, inputs: dict[str, np.ndarray], opset: int | None = None, **attrs) -> np.ndarray:
    model = node_model(op_type, inputs, opset=opset, **attrs)
    return np.asarray(onnxtrain.load(model, check=False).infer(inputs)["out0"])


@pytest.mark.parametrize("op_type", ["Add", "Sub", "Mul"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.int32])
def test_binary_arithmetic_keeps_dtype_and_broadcasts(op_type, dtype):
    a = (np.arange(12).reshape(3, 4) - 5).astype(dtype)
    b = np.array([1, 2, 3, 4], dtype=dtype)
    assert_matches_reference(op_type, {"a": a, "b": b})


UNARY_FLOAT = ["Abs", "Neg", "Exp", "Log", "Sqrt", "Reciprocal", "Floor", "Ceil", "Round", "Sign", "Sin", "Cos",
               "Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh", "Asinh", "Atanh", "Tanh", "Sigmoid", "Relu", "Erf",
               "Softsign", "IsNaN"]


@pytest.mark.parametrize("op_type", UNARY_FLOAT)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_unary_float(op_type, dtype):
    x = np.array([0.1, 0.5, 0.75, 2.5, -0.5, -0.3], dtype)
    if op_type in ("Log", "Sqrt"):
        x = np.abs(x)
    if op_type in ("Asin", "Acos", "Atanh"):
        x = np.clip(x, -0.9, 0.9)
    assert_matches_reference(op_type, {"x": x}, rtol=1e-6 if dtype == np.float32 else 1e-12)


def test_acosh_float16():
    x = np.array([1.0, 1.5, 3.0], np.float16)
    assert_matches_reference("Acosh", {"x": x}, rtol=1e-3)


@pytest.mark.parametrize(("op_type", "dtype"), [("Abs", np.int64), ("Neg", np.int64), ("Sign", np.int64),
                                                  ("Abs", np.uint8), ("Relu", np.int8), ("Relu", np.int64),
                                                  ("BitwiseNot", np.int32), ("BitwiseNot", np.uint16)])
def test_unary_integer_stays_exact(op_type, dtype):
    x = np.array([0, 1, 7, 100], dtype)
    if np.issubdtype(dtype, np.signedinteger):
        x = np.concatenate([x, np.array([np.iinfo(dtype).max, -3, np.iinfo(dtype).min + 1], dtype)])
    mine = assert_matches_reference(op_type, {"x": x}, rtol=0, atol=0)[0]
    assert mine.dtype == dtype


def test_erf_of_integers_keeps_the_type():
    x = np.array([-2, 0, 3], np.int32)
    got = ours("Erf", {"x": x}, opset=9)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.array([0, 0, 0], np.int32))  # |erf| < 1 truncates to 0


def test_integer_division_truncates_toward_zero():
    a = np.array([7, -7, 7, -7, 2**62 + 1, -(2**40) - 1], np.int64)
    b = np.array([2, 2, -2, -2, 1, 3], np.int64)
    expected = np.sign(a) * np.sign(b) * (np.abs(a) // np.abs(b))  # C division, in exact integers
    got = ours("Div", {"a": a, "b": b})
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("dtype", [np.int8, np.uint16, np.int32, np.float16, np.float64])
def test_div_types(dtype):
    a = np.array([[9, 8, 7], [6, 5, 4]], dtype)
    b = np.array([2, 3, 4], dtype)
    assert_matches_reference("Div", {"a": a, "b": b}, rtol=1e-3 if dtype == np.float16 else 1e-7)


@pytest.mark.parametrize("fmod", [0, 1])
@pytest.mark.parametrize("dtype", [np.int64, np.int8, np.float32, np.float64])
def test_mod_sign_rules(fmod, dtype):
    a = np.array([7, -7, 7, -7, 0, 5], dtype)
    b = np.array([3, 3, -3, -3, 4, 5], dtype)
    got = ours("Mod", {"a": a, "b": b}, fmod=fmod)
    expected = (np.fmod if fmod else np.mod)(a, b)  # fmod: sign of a; mod: sign of b
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, expected)


def test_float_mod_special_values():
    a = np.array([-0.0, 0.0, 5.0, -5.0, 5.0, np.inf, 1.0], np.float32)
    b = np.array([3.0, -3.0, np.inf, np.inf, -np.inf, 2.0, 0.0], np.float32)
    got = ours("Mod", {"a": a, "b": b})
    np.testing.assert_array_equal(got, np.array([0.0, -0.0, 5.0, np.inf, -np.inf, np.nan, np.nan], np.float32))
    np.testing.assert_array_equal(np.signbit(got[:2]), [False, True])  # a zero result takes b's sign


@pytest.mark.parametrize(("base", "exponent"), [(np.float32, np.int64), (np.int32, np.float32), (np.int64, np.int64),
                                                (np.float64, np.float32), (np.float32, np.float64)])
def test_pow_mixed_types_take_the_base_type(base, exponent):
    x = np.array([[1, 2, 3], [4, 5, 6]], base)
    y = np.array([2, 3, 1], exponent)
    assert_matches_reference("Pow", {"x": x, "y": y})


def test_pow_int64_is_exact():
    x = np.array([3, -2, 2, 10], np.int64)
    y = np.array([39, 3, 62, 18], np.int64)
    np.testing.assert_array_equal(ours("Pow", {"x": x, "y": y}), np.array([3**39, -8, 2**62, 10**18], np.int64))


@pytest.mark.parametrize("op_type", ["Max", "Min", "Sum", "Mean"])
def test_variadic_broadcasts_over_three_inputs(op_type):
    rng = np.random.default_rng(0)
    a, b, c = (rng.normal(size=shape).astype(np.float32) for shape in [(2, 1, 4), (3, 1), (4,)])
    expected = {"Max": np.maximum(np.maximum(a, b), c), "Min": np.minimum(np.minimum(a, b), c),
                "Sum": a + b + c, "Mean": (a + b + c) / 3}[op_type]  # onnx's reference Mean cannot broadcast
    got = ours(op_type, {"a": a, "b": b, "c": c})
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-6)


@pytest.mark.parametrize("op_type", ["Max", "Min", "Sum", "Mean"])
def test_variadic_single_input_and_nan(op_type):
    a = np.array([1.0, np.nan, 3.0], np.float64)
    assert_matches_reference(op_type, {"a": a})
    got = ours(op_type, {"a": a, "b": np.array([np.nan, 2.0, 1.0])})
    assert np.isnan(got[:2]).all() and not np.isnan(got[2])


@pytest.mark.parametrize("op_type", ["Max", "Min"])
def test_variadic_integers_exact(op_type):
    a = np.array([2**62, -(2**62), 5], np.int64)
    b = np.array([2**62 + 1, -(2**62) - 1, 5], np.int64)
    mine = assert_matches_reference(op_type, {"a": a, "b": b}, rtol=0, atol=0)[0]
    np.testing.assert_array_equal(mine, (np.maximum if op_type == "Max" else np.minimum)(a, b))


@pytest.mark.parametrize("dtype", [np.uint8, np.uint64])
@pytest.mark.parametrize("direction", ["LEFT", "RIGHT"])
def test_bitshift_unsigned(dtype, direction):
    x = np.array([16, 4, 1, 255], dtype)
    y = np.array([1, 2, 3, 4], dtype)
    assert_matches_reference("BitShift", {"x": x, "y": y}, direction=direction, rtol=0, atol=0)


def test_bitshift_signed_out_of_range_shifts_keep_only_the_sign_fill():
    x = np.array([-8, -8, 8, -8, 5, 1], np.int32)
    y = np.array([1, 40, 40, -1, -1, 31], np.int32)
    np.testing.assert_array_equal(ours("BitShift", {"x": x, "y": y}, direction="RIGHT"), [-4, -1, 0, -1, 0, 0])
    np.testing.assert_array_equal(
        ours("BitShift", {"x": x, "y": y}, direction="LEFT"), [-16, 0, 0, 0, 0, np.iinfo(np.int32).min]
    )


def test_bitshift_bad_direction_is_a_node_error():
    x = np.array([1], np.uint8)
    with pytest.raises(NodeError, match="BitShift.*direction"):
        ours("BitShift", {"x": x, "y": x}, direction="UP")


def test_mod_bad_fmod_is_a_node_error():
    x = np.array([1], np.int32)
    with pytest.raises(NodeError, match="Mod.*fmod"):
        ours("Mod", {"a": x, "b": x}, fmod=2)


def clip_model(inputs: list[str], opset: int, dtype: int = TensorProto.FLOAT, **attrs) -> onnx.ModelProto:
    node = helper.make_node("Clip", inputs, ["y"], **attrs)
    graph_inputs = [helper.make_tensor_value_info(n, dtype, None) for n in inputs if n]
    graph = helper.make_graph([node], "clip", graph_inputs, [helper.make_tensor_value_info("y", dtype, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize(("inputs", "low", "high"), [(["x", "lo", "hi"], -1, 2), (["x", "", "hi"], None, 2),
                                                     (["x", "lo"], -1, None), (["x"], None, None),
                                                     (["x", "lo", "hi"], 3, 1)])
@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.uint8])
def test_clip_bounds_as_inputs(inputs, low, high, dtype):
    if dtype == np.uint8 and low is not None and low < 0:
        low = 1
    x = np.array([-5, 0, 1, 2, 7, 100], dtype) if dtype != np.uint8 else np.array([0, 1, 2, 7, 100], dtype)
    bounds = {"lo": low, "hi": high}
    feeds = {"x": x, **{n: np.array(bounds[n], dtype) for n in inputs[1:] if n}}
    model = clip_model(inputs, 13, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))
    got = np.asarray(onnxtrain.load(model, check=False).infer(feeds)["y"])
    expected = x
    if low is not None:
        expected = np.maximum(expected, low)
    if high is not None:
        expected = np.minimum(expected, high)  # min > max: everything becomes max
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, expected.astype(dtype))


@pytest.mark.parametrize(("opset", "attrs", "expected"), [(6, {"min": -1.0, "max": 2.0}, [-1, 0, 2]),
                                                          (6, {}, [-5, 0, 7]), (1, {"max": 2.0}, [-5, 0, 2])])
def test_clip_bounds_as_attributes(opset, attrs, expected):
    x = np.array([-5, 0, 7], np.float32)
    model = clip_model(["x"], opset, **attrs)
    got = np.asarray(onnxtrain.load(model, check=False).infer({"x": x})["y"])
    np.testing.assert_array_equal(got, np.array(expected, np.float32))


@pytest.mark.parametrize(("positive", "negative"), [(1, 1), (1, 0), (0, 1), (0, 0)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_isinf_detect_flags(positive, negative, dtype):
    x = np.array([-np.inf, -1.0, 0.0, np.nan, 2.0, np.inf], dtype)
    assert_matches_reference("IsInf", {"x": x}, detect_positive=positive, detect_negative=negative)


@pytest.mark.parametrize("op_type", ["Equal", "Greater", "Less", "GreaterOrEqual", "LessOrEqual"])
@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.uint32])
def test_comparisons(op_type, dtype):
    a = np.array([[1, 5, 3], [2, 2, 9]], dtype)
    b = np.array([2, 5, 1], dtype)
    assert_matches_reference(op_type, {"a": a, "b": b})


def test_equal_on_strings_runs_on_the_host():
    a = np.array([["cat", "dog"], ["", "émile"]], dtype=object)
    b = np.array(["cat", "émile"], dtype=object)
    got = assert_matches_reference("Equal", {"a": a, "b": b})[0]
    np.testing.assert_array_equal(got, [[True, False], [False, True]])


def test_equal_on_string_initializers():
    strings = helper.make_tensor("s", TensorProto.STRING, [2], [b"x", b"y"])
    node = helper.make_node("Equal", ["s", "t"], ["eq"])
    graph = helper.make_graph(
        [node], "eq", [helper.make_tensor_value_info("t", TensorProto.STRING, [2])],
        [helper.make_tensor_value_info("eq", TensorProto.BOOL, [2])], initializer=[strings],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    got = onnxtrain.load(model).infer({"t": np.array(["x", "z"], dtype=object)})["eq"]
    np.testing.assert_array_equal(got, [True, False])


@pytest.mark.parametrize("op_type", ["And", "Or", "Xor"])
def test_logical(op_type):
    a = np.array([[True, False], [True, True]])
    b = np.array([True, False])
    assert_matches_reference(op_type, {"a": a, "b": b})


def test_not():
    assert_matches_reference("Not", {"x": np.array([True, False])})


@pytest.mark.parametrize("op_type", ["BitwiseAnd", "BitwiseOr", "BitwiseXor"])
def test_bitwise(op_type):
    a = np.array([[12, -1], [0, 7]], np.int64)
    b = np.array([10, 2**40], np.int64)
    assert_matches_reference(op_type, {"a": a, "b": b}, rtol=0, atol=0)


@pytest.mark.parametrize("op_type", ["Add", "Sub", "Mul", "Div", "Pow", "Equal", "Greater", "Less"])
def test_legacy_broadcast_aligns_b_at_axis(op_type):
    a = np.arange(1, 25, dtype=np.float32).reshape(2, 3, 4)
    b = np.array([1, 2, 3], np.float32)
    got = ours(op_type, {"a": a, "b": b}, opset=6, broadcast=1, axis=1)
    numpy_op = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide, "Pow": np.power,
                "Equal": np.equal, "Greater": np.greater, "Less": np.less}[op_type]
    np.testing.assert_allclose(got, numpy_op(a, b[:, None]), rtol=1e-6)


def test_legacy_broadcast_without_axis_matches_the_suffix():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array([10, 20, 30], np.float32)
    np.testing.assert_array_equal(ours("Add", {"a": a, "b": b}, opset=1, broadcast=1), a + b)


def test_version_1_ignores_consumed_inputs():
    x = np.array([-1.5, 2.0], np.float32)
    np.testing.assert_array_equal(ours("Abs", {"x": x}, opset=1, consumed_inputs=[0]), np.abs(x))
    np.testing.assert_array_equal(ours("Max", {"a": x, "b": -x}, opset=1, consumed_inputs=[0, 0]), np.abs(x))
    np.testing.assert_array_equal(
        ours("Add", {"a": x, "b": x}, opset=1, consumed_inputs=[0, 0]), x + x
    )


def test_static_inputs_fold_and_keep_integer_dtype():
    """All-constant inputs run at trace time in NumPy-returning mode; int64 stays exact there too."""
    a = helper.make_tensor("a", TensorProto.INT64, [2], [2**62 + 1, -7])
    b = helper.make_tensor("b", TensorProto.INT64, [2], [1, 2])
    graph = helper.make_graph(
        [helper.make_node("Div", ["a", "b"], ["q"]), helper.make_node("Add", ["q", "x"], ["y"])], "fold",
        [helper.make_tensor_value_info("x", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, [2])], initializer=[a, b],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    got = onnxtrain.load(model).infer({"x": np.array([0, 0], np.int64)})["y"]
    np.testing.assert_array_equal(got, [2**62 + 1, -3])


def test_gradients_of_div_pow_max():
    a = np.array([1.5, -2.0, 3.0])
    b = np.array([2.0, 4.0, 0.5])
    with jax.enable_x64(True):  # as the engine runs
        grad_a, grad_b = jax.jit(jax.grad(lambda x, y: lowering("Div")(x, y).sum(), argnums=(0, 1)))(a, b)
        grad_x = jax.jit(jax.grad(lambda x: lowering("Pow")(x, np.array([3.0, 2.0, 1.0])).sum()))(b)
        grad_max = jax.jit(jax.grad(lambda x: lowering("Max")(x, np.zeros(3)).sum()))(a)
    np.testing.assert_allclose(grad_a, 1 / b)
    np.testing.assert_allclose(grad_b, -a / b**2)
    np.testing.assert_allclose(grad_x, [3 * 2.0**2, 2 * 4.0, 1.0])
    np.testing.assert_allclose(grad_max, [1.0, 0.0, 1.0])


def test_gradient_of_clip_is_zero_outside_the_bounds():
    with jax.enable_x64(True):
        clipped_sum = jax.grad(lambda x: lowering("Clip")(x, np.float64(-1), np.float64(1)).sum())
        grad = jax.jit(clipped_sum)(np.array([-2.0, 0.5, 3.0]))
    np.testing.assert_allclose(grad, [0.0, 1.0, 0.0])


def test_gradient_of_clip_at_its_bounds_is_torch_clamps():
    """An element exactly at a bound passes all its gradient, as torch.clamp's (exported as Clip) does; the
    bounds, traced, take the gradients of the elements they replace. jnp.maximum / jnp.minimum had split each tie
    half and half (0.5 to the element, 0.5 to the bound)."""
    import torch

    x, low, high = np.array([-2.0, -1.0, 0.5, 1.0, 3.0]), np.array(-1.0), np.array(1.0)
    with jax.enable_x64(True):
        weights = np.arange(1.0, 6.0)  # a distinct gradient per element: which bound took which one shows
        grads = jax.jit(jax.grad(lambda *v: (lowering("Clip")(*v) * weights).sum(), argnums=(0, 1, 2)))(x, low, high)
    tensors = [torch.tensor(v, requires_grad=True) for v in (x, low, high)]
    (torch.clamp(*tensors) * torch.tensor(weights)).sum().backward()
    for got, tensor in zip(grads, tensors):
        np.testing.assert_array_equal(got, tensor.grad.numpy())
    np.testing.assert_array_equal(grads[0], [0.0, 2.0, 3.0, 4.0, 0.0])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_broadcast_half_precision_operands_gradient_sums_in_float32(dtype):
    """The gradient of a bias that Gemm's C or an Add broadcasts over rows is the sum of the rows' gradients; in
    bfloat16/float16 it is accumulated in float32 and rounded once, as torch sums a Linear's bias gradient (JAX
    transposes a broadcast into a sum of the gradient's type, which XLA-CPU accumulated in bfloat16: over these 8
    rows 3.4x the error). The loss is sum(Z * C), so the rows' gradients are C exactly; one SGD step of rate 1
    from zero biases leaves -(their sum)."""
    elem = {"bfloat16": TensorProto.BFLOAT16, "float16": TensorProto.FLOAT16}[dtype]
    half = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    rng = np.random.default_rng(0)
    x, c = rng.normal(size=(8, 5)).astype(half), (rng.normal(size=(8, 6)) + 0.3).astype(half)
    weights = [numpy_helper.from_array(rng.normal(size=(5, 6)).astype(half), "W"),
               numpy_helper.from_array(np.zeros(6, half), "B"), numpy_helper.from_array(np.zeros(6, half), "B2")]
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["X", "W", "B"], ["Y"]), helper.make_node("Add", ["Y", "B2"], ["Z"]),
         helper.make_node("Mul", ["Z", "C"], ["P"]), helper.make_node("ReduceSum", ["P"], ["total"], keepdims=0)],
        "biases", [helper.make_tensor_value_info("X", elem, [8, 5]), helper.make_tensor_value_info("C", elem, [8, 6])],
        [helper.make_tensor_value_info("total", elem, [])], weights)
    model = onnxtrain.make_trainable(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                                     loss="output:total", optimizer="sgd", learning_rate=1.0, trainable=["B", "B2"])
    engine = onnxtrain.load(model)
    engine.train_step({"X": x, "C": c})
    expected = (-c.astype(np.float64).sum(0)).astype(half)  # the exact sum, rounded once
    for bias in ("B", "B2"):
        np.testing.assert_array_equal(np.asarray(engine.state[bias]), expected, err_msg=bias)
