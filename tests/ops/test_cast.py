"""Cast, CastLike and BitCast: every numeric pair in one model, float8 saturation, FLOAT8E8M0 rounding, sub-byte
and 6-bit types, strings on the host, old opsets, gradients and errors. References are onnx's
ReferenceEvaluator, or ml_dtypes / NumPy written here."""

import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import onnxtrain
from nodes import node_model, run_both
from onnxtrain.dtypes import np_dtype, onnx_type
from onnxtrain.errors import NodeError
from onnxtrain.lower.ops import cast as cast_ops

BIG = 2**53 + 1  # an int64 that cannot pass through a float64 unchanged

# Everything that can pass into and out of a jitted function; the values below are in range for every target
# (float -> integer is undefined by the spec when out of range), so each pair is a well-defined cast.
NUMERIC = [
    np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.int8, np.uint8, np.int16, np.uint16, np.int32,
    np.uint32, np.int64, np.uint64, np.bool_,
]
VALUES = np.array([0.0, 1.0, 2.75, 7.5, 100.25, 0.0, 1.0, 3.0])
FLOAT8 = [TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E4M3FNUZ, TensorProto.FLOAT8E5M2, TensorProto.FLOAT8E5M2FNUZ]
SPECIAL = np.array([0.478, -0.4803, 1e6, -1e6, 1e-7, -1e-7, 300.0, 60000.0, np.inf, -np.inf, np.nan, 0.0, -0.0])


def graph_model(nodes, inputs, outputs, opset=None, initializers=()):
    graph = helper.make_graph(
        nodes,
        "casts",
        [helper.make_tensor_value_info(n, onnx_type(v.dtype), v.shape) for n, v in inputs.items()],
        [helper.make_empty_tensor_value_info(o) for o in outputs],
        initializer=list(initializers),
    )
    opsets = [helper.make_opsetid("", opset)] if opset else None
    return helper.make_model(graph, opset_imports=opsets) if opsets else helper.make_model(graph)


def infer(model, feeds):
    engine = onnxtrain.load(model, check=False)
    got = engine.infer(feeds)
    return [np.asarray(got[name]) for name in engine.output_names]


def assert_same(mine, ref):
    """Equal dtype, shape and bits; NaNs must sit at the same places but may differ in payload."""
    assert mine.dtype == ref.dtype, (mine.dtype, ref.dtype)
    assert mine.shape == ref.shape
    if mine.dtype.kind in "biuO":
        np.testing.assert_array_equal(mine, ref)
        return
    wide_mine, wide_ref = mine.astype(np.float64), ref.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(wide_mine), np.isnan(wide_ref))
    exact = ~np.isnan(wide_ref)
    if np.dtype(mine.dtype).itemsize * 8 == cast_ops.bit_width(np.dtype(mine.dtype)):
        view = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[mine.dtype.itemsize]
        np.testing.assert_array_equal(mine.view(view)[exact], ref.view(view)[exact])  # tells -0.0 from 0.0
    else:  # sub-byte types have no NumPy view: compare values
        np.testing.assert_array_equal(wide_mine[exact], wide_ref[exact])


# ---- numeric casts -------------------------------------------------------------------------------------------


def test_every_numeric_pair_in_one_model():
    feeds = {f"in_{np.dtype(d).name}": VALUES.astype(d) for d in NUMERIC}
    nodes, outputs = [], []
    for source in NUMERIC:
        for target in NUMERIC:
            out = f"{np.dtype(source).name}_to_{np.dtype(target).name}"
            nodes.append(helper.make_node("Cast", [f"in_{np.dtype(source).name}"], [out], to=onnx_type(target)))
            outputs.append(out)
    model = graph_model(nodes, feeds, outputs)
    ours = infer(model, feeds)
    theirs = ReferenceEvaluator(model).run(None, feeds)
    for name, mine, ref in zip(outputs, ours, theirs):
        assert mine.dtype == ref.dtype, name
        np.testing.assert_array_equal(mine, ref, err_msg=name)


def test_integer_casts_wrap_and_stay_exact():
    x = np.array([BIG, -BIG, 300, -200, 70000, 2**40 + 7], np.int64)
    for target in (np.int8, np.uint8, np.int16, np.uint32, np.uint64, np.float64):
        (mine,), (ref,) = run_both(node_model("Cast", {"x": x}, to=onnx_type(target)), {"x": x})
        assert_same(mine, ref)
    big_unsigned = np.array([2**64 - 1, 2**63 + 3], np.uint64)
    (mine,), (ref,) = run_both(node_model("Cast", {"x": big_unsigned}, to=TensorProto.INT64), {"x": big_unsigned})
    assert_same(mine, ref)


def test_float_to_bool_treats_nan_as_true():
    x = np.array([0.0, -0.0, np.nan, 0.25, -np.inf])
    (mine,), (ref,) = run_both(node_model("Cast", {"x": x}, to=TensorProto.BOOL), {"x": x})
    assert_same(mine, ref)


@pytest.mark.parametrize("opset", [6, 9, 13])
def test_old_opsets(opset):
    x = np.array([1.5, -2.25, 1e30], np.float64)
    (mine,), (ref,) = run_both(node_model("Cast", {"x": x}, opset=opset, to=TensorProto.FLOAT), {"x": x})
    assert_same(mine, ref)


def test_opset1_names_the_target_type():
    x = np.array([1.7, -2.2], np.float64)
    (out,) = infer(node_model("Cast", {"x": x}, opset=1, to="INT32"), {"x": x})
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, [1, -2])


def test_gradient_flows_through_float_casts():
    def f(v):
        wide = cast_ops.cast(v, TensorProto.DOUBLE)
        return jnp.sum(cast_ops.cast(wide * wide, TensorProto.FLOAT))

    with jax.enable_x64(True):
        g = jax.jit(jax.grad(f))(jnp.array([1.0, -2.0, 3.5], jnp.float32))
    assert g.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(g), [2.0, -4.0, 7.0])


# ---- float8 and friends --------------------------------------------------------------------------------------


@pytest.mark.parametrize("saturate", [0, 1])
@pytest.mark.parametrize("source", [np.float32, np.float16, np.float64, ml_dtypes.bfloat16])
def test_float8_saturation(source, saturate):
    with np.errstate(over="ignore"):  # 1e6 is infinite in float16, which this test wants
        x = SPECIAL.astype(source)
    nodes = [helper.make_node("Cast", ["x"], [f"y{t}"], to=t, saturate=saturate) for t in FLOAT8]
    model = graph_model(nodes, {"x": x}, [f"y{t}" for t in FLOAT8])
    for mine, ref in zip(infer(model, {"x": x}), ReferenceEvaluator(model).run(None, {"x": x})):
        assert_same(mine, ref)


def test_float8_to_float8_and_back():
    x = SPECIAL.astype(ml_dtypes.float8_e5m2)
    for to in (TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E4M3FNUZ, TensorProto.FLOAT, TensorProto.BFLOAT16):
        (mine,), (ref,) = run_both(node_model("Cast", {"x": x}, to=to), {"x": x})
        assert_same(mine, ref)


E8M0_VALUES = np.array([0.0, 1e-40, 0.124, 0.25, 0.375, 0.5, 0.75, 1.1, 1.5, 3.0, 2.0**127, 3.0 * 2.0**126, np.nan])


@pytest.mark.parametrize("round_mode", ["up", "down", "nearest"])
@pytest.mark.parametrize("saturate", [0, 1])
def test_float8e8m0_round_modes(round_mode, saturate):
    x = E8M0_VALUES.astype(np.float32)
    attrs = {"to": TensorProto.FLOAT8E8M0, "saturate": saturate, "round_mode": round_mode}
    (mine,), (ref,) = run_both(node_model("Cast", {"x": x}, **attrs), {"x": x})
    assert_same(mine, ref)


def test_float8e8m0_infinity_follows_the_spec_table():
    """Inf saturates to E8M0_MAX (2^127) and becomes NaN without saturation."""
    x = np.array([np.inf], np.float32)
    for saturate, expected in ((1, 2.0**127), (0, np.nan)):
        (out,) = infer(node_model("Cast", {"x": x}, to=TensorProto.FLOAT8E8M0, saturate=saturate), {"x": x})
        np.testing.assert_array_equal(out.astype(np.float32), [expected])


def test_float8e8m0_rejects_unknown_round_mode():
    x = np.ones(2, np.float32)
    model = node_model("Cast", {"x": x}, to=TensorProto.FLOAT8E8M0, round_mode="sideways")
    with pytest.raises(NodeError, match="round_mode"):
        infer(model, {"x": x})


@pytest.mark.parametrize("to", [TensorProto.INT4, TensorProto.UINT4, TensorProto.INT2, TensorProto.UINT2,
                                TensorProto.FLOAT4E2M1])
def test_sub_byte_targets_wrap_like_ml_dtypes(to):
    x = np.arange(-9.0, 16.0, dtype=np.float32)
    for source in (x, x.astype(np.int64), x.astype(np.float16)):
        (out,) = infer(node_model("Cast", {"x": source}, to=to), {"x": source})
        assert_same(out, source.astype(np_dtype(to)))


@pytest.mark.parametrize("source", [ml_dtypes.int4, ml_dtypes.uint2, ml_dtypes.float4_e2m1fn])
def test_sub_byte_sources(source):
    x = np.arange(-3, 4).astype(source)
    nodes = [helper.make_node("Cast", ["x"], [f"y{t}"], to=t) for t in (TensorProto.INT8, TensorProto.FLOAT)]
    model = graph_model(nodes, {"x": x}, ["y3", "y1"])
    for mine, ref in zip(infer(model, {"x": x}), ReferenceEvaluator(model).run(None, {"x": x})):
        assert_same(mine, ref)


def test_float6_is_cast_on_the_host():
    """XLA has no 6-bit floats: a static value goes through float6 on the host and comes back as float32."""
    x = np.array([0.3, -1.7, 5.0, 100.0, 0.0], np.float32)
    nodes = [
        helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(x)),
        helper.make_node("Cast", ["c"], ["f6"], to=TensorProto.FLOAT6E2M3),
        helper.make_node("Cast", ["f6"], ["back"], to=TensorProto.FLOAT),
    ]
    (out,) = infer(graph_model(nodes, {}, ["back"]), {})
    np.testing.assert_array_equal(out, x.astype(ml_dtypes.float6_e2m3fn).astype(np.float32))


def test_float6_of_a_traced_value_asks_for_a_static_input():
    x = np.array([0.5], np.float32)
    model = graph_model(
        [helper.make_node("Cast", ["x"], ["f6"], to=TensorProto.FLOAT6E3M2),
         helper.make_node("Cast", ["f6"], ["y"], to=TensorProto.FLOAT)],
        {"x": x},
        ["y"],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the engine compiles the feed in as a constant
        (out,) = infer(model, {"x": x})
    np.testing.assert_array_equal(out, [0.5])


# ---- strings -------------------------------------------------------------------------------------------------


def test_strings_to_numbers():
    text = np.array(["3.25", "1e-5", "+INF", "-inf", "NaN", "-0.5", "1E8"], dtype=object)
    (mine,), (ref,) = run_both(node_model("Cast", {"s": text}, to=TensorProto.FLOAT), {"s": text})
    assert_same(mine, ref)


def test_strings_to_64_bit_integers_are_exact():
    text = np.array([str(BIG), str(-BIG), "7"], dtype=object)
    (out,) = infer(node_model("Cast", {"s": text}, to=TensorProto.INT64), {"s": text})
    assert out.dtype == np.int64 and out.tolist() == [BIG, -BIG, 7]
    text = np.array([str(2**64 - 1)], dtype=object)
    (out,) = infer(node_model("Cast", {"s": text}, to=TensorProto.UINT64), {"s": text})
    assert out.dtype == np.uint64 and out.tolist() == [2**64 - 1]


@pytest.mark.parametrize(
    "x",
    [np.array([0.1, -2.5, 1e-7, np.inf], np.float32), np.array([0.1, np.nan], np.float64),
     np.array([0, -1, BIG], np.int64), np.array([0, 255], np.uint8)],
)
def test_numbers_to_strings_from_a_traced_feed(x):
    model = node_model("Cast", {"x": x}, to=TensorProto.STRING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the engine announces that it compiles the feed in as a constant
        (mine,), (ref,) = run_both(model, {"x": x})
    assert mine.dtype == object
    assert mine.tolist() == ref.tolist()


def test_number_string_round_trip_in_one_graph():
    x = np.array([0.1, 3.5e-8, -7.0], np.float32)
    nodes = [
        helper.make_node("Cast", ["x"], ["s"], to=TensorProto.STRING),
        helper.make_node("Cast", ["s"], ["y"], to=TensorProto.FLOAT),
    ]
    model = graph_model([helper.make_node("Constant", [], ["x"], value=numpy_helper.from_array(x))] + nodes, {}, ["y"])
    (out,) = infer(model, {})
    assert_same(out, x)


# ---- CastLike ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", [np.float16, np.int64, np.uint8, ml_dtypes.float8_e4m3fn, np.bool_])
@pytest.mark.parametrize("opset", [15, 19, None])
def test_cast_like(target, opset):
    x = np.array([0.0, 1.5, 2.0, 200.0, 250.0], np.float32)
    like = np.zeros(2, target)
    (mine,), (ref,) = run_both(node_model("CastLike", {"x": x, "like": like}, opset=opset), {"x": x, "like": like})
    assert_same(mine, ref)


def test_cast_like_no_saturate():
    x = np.array([1e5, -1e5, np.inf], np.float32)
    like = np.zeros(1, ml_dtypes.float8_e5m2)
    (mine,), (ref,) = run_both(node_model("CastLike", {"x": x, "like": like}, saturate=0), {"x": x, "like": like})
    assert_same(mine, ref)


def test_cast_like_strings():
    text = np.array(["1.5", "-2"], dtype=object)
    like = np.zeros(1, np.float64)
    (mine,), (ref,) = run_both(node_model("CastLike", {"s": text, "like": like}), {"s": text, "like": like})
    assert_same(mine, ref)


# ---- BitCast -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("x", "to"),
    [
        (np.array([1.0, -0.0, np.nan], np.float32), TensorProto.INT32),
        (np.array([BIG, -1], np.int64), TensorProto.DOUBLE),
        (np.array([1.0, -2.5], np.float16), TensorProto.BFLOAT16),
        (np.array([True, False]), TensorProto.UINT8),
        (np.array([1 + 2j, -3.5j], np.complex64), TensorProto.UINT64),
        (np.array([0x3C, 0xFF], np.uint8), TensorProto.FLOAT8E4M3FN),
        (np.array([-1, 7], np.int8).astype(ml_dtypes.int4), TensorProto.UINT4),
        (np.array([2**64 - 1], np.uint64), TensorProto.INT64),
    ],
)
def test_bitcast(x, to):
    (mine,), (ref,) = run_both(node_model("BitCast", {"x": x}, to=to), {"x": x})
    assert_same(mine, ref)


def test_bitcast_width_mismatch_error():
    x = np.zeros(2, np.float32)
    with pytest.raises(NodeError, match="32 bits.*64 bits"):
        infer(node_model("BitCast", {"x": x}, to=TensorProto.DOUBLE), {"x": x})
