"""Reduce*: axes as attribute (old versions) and input (new), keepdims, empty axes, empty sets, dtypes, grads."""

from __future__ import annotations

import jax
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import onnxtrain
from nodes import node_model, lowering
from onnxtrain.errors import NodeError

REDUCTIONS = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
              "ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp"]
AXES_INPUT_SINCE = {name: 13 if name == "ReduceSum" else 18 for name in REDUCTIONS}
X = np.random.default_rng(0).uniform(0.5, 2.0, size=(2, 3, 4))


def reduce_model(op_type: str, x: np.ndarray, axes_input: list[int] | None, opset: int | None = None, **attrs):
    """One Reduce node; `axes_input` (when given) is an initializer, as in exported models. Old versions take
    `axes` as an attribute, among `attrs`."""
    model = node_model(op_type, {"x": x}, opset=opset, **attrs)
    if axes_input is not None:
        model.graph.node[0].input.append("axes")
        model.graph.initializer.append(onnx.numpy_helper.from_array(np.array(axes_input, np.int64), "axes"))
    return model


def ours(op_type: str, x: np.ndarray, axes_input: list[int] | None = None, opset: int | None = None, **attrs):
    model = reduce_model(op_type, x, axes_input, opset, **attrs)
    return np.asarray(onnxtrain.load(model, check=False).infer({"x": x})["out0"])


def matches_reference(op_type: str, x: np.ndarray, axes_input: list[int] | None = None, opset: int | None = None,
                      rtol: float = 1e-12, **attrs) -> np.ndarray:
    model = reduce_model(op_type, x, axes_input, opset, **attrs)
    mine = np.asarray(onnxtrain.load(model, check=False).infer({"x": x})["out0"])
    reference = onnx.reference.ReferenceEvaluator(model).run(None, {"x": x})[0]
    assert mine.dtype == reference.dtype and mine.shape == reference.shape, (mine, reference)
    np.testing.assert_allclose(mine, reference, rtol=rtol)
    return mine


@pytest.mark.parametrize("op_type", REDUCTIONS)
@pytest.mark.parametrize(("axes", "keepdims"), [(None, 1), ([1], 0), ([-1, 0], 1), ([0, 2], 0)])
def test_axes_as_input(op_type, axes, keepdims):
    matches_reference(op_type, X, axes, keepdims=keepdims)


@pytest.mark.parametrize("op_type", REDUCTIONS)
@pytest.mark.parametrize(("axes", "keepdims"), [(None, 1), ([-1, 0], 0)])
def test_axes_as_attribute_in_old_versions(op_type, axes, keepdims):
    opset = AXES_INPUT_SINCE[op_type] - 1
    attrs = {"keepdims": keepdims} if axes is None else {"keepdims": keepdims, "axes": axes}
    matches_reference(op_type, X, opset=opset, **attrs)


@pytest.mark.parametrize("opset", [1, 11])
def test_oldest_versions(opset):
    np.testing.assert_allclose(ours("ReduceSum", X, opset=opset, axes=[2], keepdims=0), X.sum(axis=2))
    np.testing.assert_allclose(ours("ReduceMax", X, opset=opset), X.max(keepdims=True))


@pytest.mark.parametrize("op_type", REDUCTIONS)
def test_empty_axes_input_without_noop_reduces_everything(op_type):
    got = ours(op_type, X, [], keepdims=0)
    assert got.shape == ()
    np.testing.assert_allclose(got, ours(op_type, X, keepdims=0), rtol=1e-12)


@pytest.mark.parametrize("op_type", REDUCTIONS)
@pytest.mark.parametrize("absent", [True, False])
def test_noop_with_empty_axes_applies_only_the_elementwise_part(op_type, absent):
    """As the schemas' function bodies: ReduceSumSquare gives x*x, ReduceL1 |x|, ReduceLogSum log(x)..."""
    x = X - 1.0 if op_type not in ("ReduceLogSum",) else X
    elementwise = {"ReduceSumSquare": np.square, "ReduceL1": np.abs, "ReduceL2": np.abs, "ReduceLogSum": np.log}
    expected = elementwise.get(op_type, lambda v: v)(x)
    got = ours(op_type, x, None if absent else [], noop_with_empty_axes=1)
    np.testing.assert_allclose(got, expected, rtol=1e-12)


IDENTITIES = {"ReduceSum": 0.0, "ReduceMean": np.nan, "ReduceMax": -np.inf, "ReduceMin": np.inf, "ReduceProd": 1.0,
              "ReduceL1": 0.0, "ReduceL2": 0.0, "ReduceSumSquare": 0.0, "ReduceLogSum": -np.inf,
              "ReduceLogSumExp": -np.inf}


@pytest.mark.parametrize("op_type", REDUCTIONS)
def test_reduction_over_an_empty_set_gives_the_identity(op_type):
    x = np.zeros((2, 0, 4), np.float32)
    got = ours(op_type, x, [1], keepdims=1)
    assert got.shape == (2, 1, 4) and got.dtype == np.float32
    np.testing.assert_array_equal(got, np.full((2, 1, 4), IDENTITIES[op_type], np.float32))


@pytest.mark.parametrize(("op_type", "dtype", "identity"), [
    ("ReduceMax", np.int32, np.iinfo(np.int32).min), ("ReduceMin", np.int64, np.iinfo(np.int64).max),
    ("ReduceMax", np.uint8, 0), ("ReduceMin", np.uint8, 255), ("ReduceSum", np.int32, 0), ("ReduceProd", np.int64, 1),
])
def test_integer_reduction_over_an_empty_set(op_type, dtype, identity):
    got = ours(op_type, np.zeros((0, 3), dtype), [0], keepdims=0)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, np.full(3, identity, dtype))


@pytest.mark.parametrize("op_type", ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
                                     "ReduceSumSquare"])
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint32])
def test_integer_dtypes_stay_integer(op_type, dtype):
    x = np.array([[3, 1, 4], [1, 5, 9]], dtype)
    expected = {"ReduceSum": [8, 15], "ReduceMean": [2, 5], "ReduceMax": [4, 9], "ReduceMin": [1, 1],
                "ReduceProd": [12, 45], "ReduceL1": [8, 15], "ReduceSumSquare": [26, 107]}[op_type]
    got = ours(op_type, x, [1], keepdims=0)
    assert got.dtype == dtype  # (onnx's reference widens ReduceSumSquare of int32 to int64)
    np.testing.assert_array_equal(got, expected)


def test_int64_sums_and_products_are_exact():
    x = np.array([[2**52 + 1, 2**52 + 3], [3**20, 3**19]], np.int64)
    np.testing.assert_array_equal(ours("ReduceSum", x, [1], keepdims=0), [2**53 + 4, 4 * 3**19])
    np.testing.assert_array_equal(ours("ReduceProd", x[1:], [1], keepdims=0), [3**39])


def test_integer_mean_truncates_toward_zero():
    x = np.array([[-3, -4], [3, 4], [-1, 0]], np.int32)
    np.testing.assert_array_equal(ours("ReduceMean", x, [1], keepdims=0), [-3, 3, 0])


@pytest.mark.parametrize("op_type", ["ReduceMax", "ReduceMin"])
def test_bool_max_min(op_type):
    x = np.array([[True, False], [True, True], [False, False]])
    matches_reference(op_type, x, [1], keepdims=0)


def test_log_sum_exp_is_stable():
    x = np.array([[1000.0, 1000.0], [-np.inf, -np.inf], [-1000.0, -1000.0]])
    got = ours("ReduceLogSumExp", x, [1], keepdims=0)
    np.testing.assert_allclose(got, [1000 + np.log(2), -np.inf, -1000 + np.log(2)])


def test_rank_zero_input():
    x = np.array(2.5)
    assert ours("ReduceSum", x, keepdims=1).shape == ()
    np.testing.assert_allclose(ours("ReduceSumSquare", x, keepdims=0), 6.25)


def test_float16_keeps_its_type():
    got = ours("ReduceMean", X.astype(np.float16), [2], keepdims=0)
    assert got.dtype == np.float16
    np.testing.assert_allclose(got, X.mean(axis=2), rtol=2e-3)


def test_axes_fed_at_run_time_compile_per_value():
    """`axes` fed as a graph input is compiled in as a constant; a new value is a new compilation."""
    node = helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)
    graph = helper.make_graph(
        [node], "sum", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [2, 3, 4]),
                        helper.make_tensor_value_info("axes", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, None)],
    )
    engine = onnxtrain.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), check=False)
    with pytest.warns(UserWarning, match="axes"):
        first = engine.infer({"x": X, "axes": np.array([0], np.int64)})["y"]
    second = engine.infer({"x": X, "axes": np.array([2], np.int64)})["y"]
    np.testing.assert_allclose(first, X.sum(axis=0))
    np.testing.assert_allclose(second, X.sum(axis=2))


def test_out_of_range_axis_is_a_node_error():
    with pytest.raises(NodeError, match="ReduceSum.*axes \\[3\\] out of range"):
        ours("ReduceSum", X, [3])


@pytest.mark.parametrize(("op_type", "gradient"), [
    ("ReduceSum", lambda x: np.ones_like(x)),
    ("ReduceMean", lambda x: np.full_like(x, 1 / x.shape[1])),
    ("ReduceL2", lambda x: x / np.sqrt((x * x).sum(axis=1, keepdims=True))),
    ("ReduceLogSumExp", lambda x: np.exp(x) / np.exp(x).sum(axis=1, keepdims=True)),
    ("ReduceSumSquare", lambda x: 2 * x),
    ("ReduceProd", lambda x: x.prod(axis=1, keepdims=True) / x),
    ("ReduceMax", lambda x: (x == x.max(axis=1, keepdims=True)).astype(x.dtype)),
])
def test_gradients(op_type, gradient):
    x = X[0]
    fn = lowering(op_type)
    with jax.enable_x64(True):  # as the engine runs
        reduced_sum = jax.grad(lambda v: fn(v, np.array([1], np.int64), keepdims=0, noop_with_empty_axes=0).sum())
        grad = jax.jit(reduced_sum)(x)
    np.testing.assert_allclose(grad, gradient(x), rtol=1e-12)
