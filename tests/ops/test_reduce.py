"""Reduce*: axes as attribute (old versions) and input (new), keepdims, empty axes, empty sets, dtypes, grads."""

from __future__ import annotations

import warnings

import jax
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import onnxtrain
from nodes import assert_matches_reference, node_model
from onnxtrain.errors import NodeError
from onnxtrain.lower.registry import lookup, schema_for

REDUCTIONS = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
              "ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp"]
AXES_INPUT_SINCE = {name: 13 if name == "ReduceSum" else 18 for name in REDUCTIONS}
X = np.random.default_rng(0).uniform(0.5, 2.0, size=(2, 3, 4))


def ours(op_type: str, inputs: dict[str, np.ndarray], opset: int | None = None, **attrs) -> np.ndarray:
    model = node_model(op_type, inputs, opset=opset, **attrs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the notice that `axes` is compiled in as a constant
        return np.asarray(onnxtrain.load(model, check=False).infer(inputs)["out0"])


def lowering(op_type: str, opset: int = onnx.defs.onnx_opset_version()):
    return lookup("", op_type, schema_for("", op_type, opset).since_version).fn


@pytest.mark.parametrize("op_type", REDUCTIONS)
@pytest.mark.parametrize(("axes", "keepdims"), [(None, 1), ([1], 0), ([-1, 0], 1), ([0, 2], 0)])
def test_axes_as_input(op_type, axes, keepdims):
    inputs = {"x": X} if axes is None else {"x": X, "axes": np.array(axes, np.int64)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_matches_reference(op_type, inputs, keepdims=keepdims, rtol=1e-12)


@pytest.mark.parametrize("op_type", REDUCTIONS)
@pytest.mark.parametrize(("axes", "keepdims"), [(None, 1), ([1], 0), ([-1, 0], 1)])
def test_axes_as_attribute_in_old_versions(op_type, axes, keepdims):
    opset = AXES_INPUT_SINCE[op_type] - 1
    attrs = {"keepdims": keepdims} if axes is None else {"keepdims": keepdims, "axes": axes}
    model = node_model(op_type, {"x": X}, opset=opset, **attrs)
    got = np.asarray(onnxtrain.load(model, check=False).infer({"x": X})["out0"])
    reference = onnx.reference.ReferenceEvaluator(model).run(None, {"x": X})[0]
    assert got.shape == reference.shape
    np.testing.assert_allclose(got, reference, rtol=1e-12)


@pytest.mark.parametrize("opset", [1, 11])
def test_oldest_versions(opset):
    np.testing.assert_allclose(ours("ReduceSum", {"x": X}, opset=opset, axes=[2], keepdims=0), X.sum(axis=2))
    np.testing.assert_allclose(ours("ReduceMax", {"x": X}, opset=opset), X.max(keepdims=True))


@pytest.mark.parametrize("op_type", REDUCTIONS)
def test_empty_axes_input_without_noop_reduces_everything(op_type):
    got = ours(op_type, {"x": X, "axes": np.array([], np.int64)}, keepdims=0)
    assert got.shape == ()
    np.testing.assert_allclose(got, ours(op_type, {"x": X}, keepdims=0), rtol=1e-12)


@pytest.mark.parametrize("op_type", REDUCTIONS)
@pytest.mark.parametrize("absent", [True, False])
def test_noop_with_empty_axes_applies_only_the_elementwise_part(op_type, absent):
    """As the schemas' function bodies: ReduceSumSquare gives x*x, ReduceL1 |x|, ReduceLogSum log(x)..."""
    x = X - 1.0 if op_type not in ("ReduceLogSum",) else X
    inputs = {"x": x} if absent else {"x": x, "axes": np.array([], np.int64)}
    expected = {"ReduceSumSquare": x * x, "ReduceL1": np.abs(x), "ReduceL2": np.abs(x),
                "ReduceLogSum": np.log(x)}.get(op_type, x)
    got = ours(op_type, inputs, noop_with_empty_axes=1)
    np.testing.assert_allclose(got, expected, rtol=1e-12)


IDENTITIES = {"ReduceSum": 0.0, "ReduceMean": np.nan, "ReduceMax": -np.inf, "ReduceMin": np.inf, "ReduceProd": 1.0,
              "ReduceL1": 0.0, "ReduceL2": 0.0, "ReduceSumSquare": 0.0, "ReduceLogSum": -np.inf,
              "ReduceLogSumExp": -np.inf}


@pytest.mark.parametrize("op_type", REDUCTIONS)
def test_reduction_over_an_empty_set_gives_the_identity(op_type):
    x = np.zeros((2, 0, 4), np.float32)
    got = ours(op_type, {"x": x, "axes": np.array([1], np.int64)}, keepdims=1)
    assert got.shape == (2, 1, 4) and got.dtype == np.float32
    np.testing.assert_array_equal(got, np.full((2, 1, 4), IDENTITIES[op_type], np.float32))


@pytest.mark.parametrize(("op_type", "dtype", "identity"), [
    ("ReduceMax", np.int32, np.iinfo(np.int32).min), ("ReduceMin", np.int64, np.iinfo(np.int64).max),
    ("ReduceMax", np.uint8, 0), ("ReduceMin", np.uint8, 255), ("ReduceSum", np.int32, 0), ("ReduceProd", np.int64, 1),
])
def test_integer_reduction_over_an_empty_set(op_type, dtype, identity):
    got = ours(op_type, {"x": np.zeros((0, 3), dtype), "axes": np.array([0], np.int64)}, keepdims=0)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, np.full(3, identity, dtype))


@pytest.mark.parametrize("op_type", ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
                                     "ReduceSumSquare"])
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint32])
def test_integer_dtypes_stay_integer(op_type, dtype):
    x = np.array([[3, 1, 4], [1, 5, 9]], dtype)
    mine = assert_matches_reference(op_type, {"x": x, "axes": np.array([1], np.int64)}, keepdims=0, rtol=0, atol=0)[0]
    assert mine.dtype == dtype


def test_int64_sums_and_products_are_exact():
    x = np.array([[2**52 + 1, 2**52 + 3], [3**20, 3**19]], np.int64)
    axes = np.array([1], np.int64)
    np.testing.assert_array_equal(ours("ReduceSum", {"x": x, "axes": axes}, keepdims=0), [2**53 + 4, 4 * 3**19])
    np.testing.assert_array_equal(ours("ReduceProd", {"x": x[1:], "axes": axes}, keepdims=0), [3**39])


def test_integer_mean_truncates_toward_zero():
    x = np.array([[-3, -4], [3, 4], [-1, 0]], np.int32)
    np.testing.assert_array_equal(ours("ReduceMean", {"x": x, "axes": np.array([1], np.int64)}, keepdims=0),
                                  [-3, 3, 0])


@pytest.mark.parametrize("op_type", ["ReduceMax", "ReduceMin"])
def test_bool_max_min(op_type):
    x = np.array([[True, False], [True, True], [False, False]])
    assert_matches_reference(op_type, {"x": x, "axes": np.array([1], np.int64)}, keepdims=0)


def test_log_sum_exp_is_stable():
    x = np.array([[1000.0, 1000.0], [-np.inf, -np.inf], [-1000.0, -1000.0]])
    got = ours("ReduceLogSumExp", {"x": x, "axes": np.array([1], np.int64)}, keepdims=0)
    np.testing.assert_allclose(got, [1000 + np.log(2), -np.inf, -1000 + np.log(2)])


def test_rank_zero_input():
    x = np.array(2.5)
    assert ours("ReduceSum", {"x": x}, keepdims=1).shape == ()
    np.testing.assert_allclose(ours("ReduceSumSquare", {"x": x}, keepdims=0), 6.25)


def test_float16_keeps_its_type():
    got = ours("ReduceMean", {"x": X.astype(np.float16), "axes": np.array([2], np.int64)}, keepdims=0)
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
    engine = onnxtrain.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    with pytest.warns(UserWarning, match="axes"):
        first = engine.infer({"x": X, "axes": np.array([0], np.int64)})["y"]
    second = engine.infer({"x": X, "axes": np.array([2], np.int64)})["y"]
    np.testing.assert_allclose(first, X.sum(axis=0))
    np.testing.assert_allclose(second, X.sum(axis=2))


def test_out_of_range_axis_is_a_node_error():
    with pytest.raises(NodeError, match="ReduceSum.*axes \\[3\\] out of range"):
        ours("ReduceSum", {"x": X, "axes": np.array([3], np.int64)})


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
        grad = jax.grad(lambda v: fn(v, np.array([1], np.int64), keepdims=0, noop_with_empty_axes=0).sum())(x)
    np.testing.assert_allclose(grad, gradient(x), rtol=1e-12)
