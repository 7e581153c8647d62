"""Quantization ops: what conformance leaves out (traced scales under jit, every target type, saturation,
precision, old opsets, float8 QLinearMatMul, errors). References are onnx's ReferenceEvaluator, or NumPy here."""

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper

import onnxtrain
from nodes import assert_matches_reference, node_model, run_both
from onnxtrain.errors import NodeError
from nodes import run_with_engine as run

T = TensorProto


def assert_same(ours, theirs):
    for mine, ref in zip(ours, theirs):
        assert mine.dtype == ref.dtype, (mine.dtype, ref.dtype)
        assert mine.shape == ref.shape, (mine.shape, ref.shape)
        np.testing.assert_array_equal(mine.astype(np.float64), ref.astype(np.float64))


def quantize_reference(x, scale, zero, lo, hi):
    """saturate(round_half_even(x / scale) + zero), all in float64."""
    return np.clip(np.rint(x.astype(np.float64) / scale) + zero, lo, hi)


# ---- QuantizeLinear ------------------------------------------------------------------------------------------


def test_quantize_per_axis_traced_scale_compiles_once():
    x = np.linspace(-3, 3, 24, dtype=np.float32).reshape(2, 3, 4)
    feeds = {"x": x, "scale": np.ones(3, np.float32), "zero": np.zeros(3, np.int8)}
    engine = onnxtrain.load(node_model("QuantizeLinear", feeds, axis=-2), check=False)
    for scale, zero in ((np.array([0.1, 0.02, 1.0]), [0, -5, 100]), (np.array([0.5, 0.25, 0.01]), [3, 0, -128])):
        feeds = {"x": x, "scale": scale.astype(np.float32), "zero": np.array(zero, np.int8)}
        got = np.asarray(engine.infer(feeds)["out0"])
        want = quantize_reference(x, feeds["scale"][:, None], feeds["zero"][:, None].astype(np.float64), -128, 127)
        assert got.dtype == np.int8
        np.testing.assert_array_equal(got, want)
    assert engine.trace_count == 1


@pytest.mark.parametrize(("block_size", "axis"), [(2, 1), (3, 0), (4, -1)])
def test_quantize_blocked_with_remainder(block_size, axis):
    x = (np.arange(5 * 7, dtype=np.float32).reshape(5, 7) - 17) / 3
    scale_shape = list(x.shape)
    scale_shape[axis] = -(-x.shape[axis] // block_size)
    scale = (np.arange(np.prod(scale_shape), dtype=np.float32).reshape(scale_shape) + 1) / 7
    zero = (np.arange(np.prod(scale_shape)).reshape(scale_shape) % 5).astype(np.uint16)
    inputs = {"x": x, "scale": scale, "zero": zero}
    assert_matches_reference("QuantizeLinear", inputs, axis=axis, block_size=block_size, rtol=0, atol=0)


@pytest.mark.parametrize("target", [T.INT4, T.UINT4, T.INT2, T.UINT2, T.INT16, T.UINT16])
def test_quantize_output_dtype_without_zero_point(target):
    x = np.array([-300.0, -9.5, -2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 7.49, 40000.0, 1e9], np.float32)
    inputs = {"x": x, "scale": np.array(1.0, np.float32)}
    model = node_model("QuantizeLinear", inputs, output_dtype=target)
    ours, theirs = run_both(model, inputs)
    assert_same(ours, theirs)


@pytest.mark.parametrize("target", [T.FLOAT8E4M3FN, T.FLOAT8E4M3FNUZ, T.FLOAT8E5M2, T.FLOAT8E5M2FNUZ])
@pytest.mark.parametrize("saturate", [0, 1])
def test_quantize_float8_saturation(target, saturate):
    x = np.array([0.3, -1.7, 500.0, -1e5, 1e5, np.inf, -np.inf, 2.0**-12], np.float32)
    inputs = {"x": x, "scale": np.array(2.0, np.float32)}
    model = node_model("QuantizeLinear", inputs, output_dtype=target, saturate=saturate)
    ours, theirs = run_both(model, inputs)
    assert ours[0].dtype == theirs[0].dtype
    np.testing.assert_array_equal(ours[0].astype(np.float32), theirs[0].astype(np.float32))


def test_quantize_float4_adds_zero_point():
    x = np.array([0.4, 1.3, -2.6, 9.0, -100.0], np.float32)
    inputs = {"x": x, "scale": np.array(0.5, np.float32), "zero": np.array(1.0, ml_dtypes.float4_e2m1fn)}
    ours, theirs = run_both(node_model("QuantizeLinear", inputs), inputs)
    assert ours[0].dtype == ml_dtypes.float4_e2m1fn
    np.testing.assert_array_equal(ours[0].astype(np.float32), theirs[0].astype(np.float32))


def test_quantize_float16_input_float32_scale_divides_in_float32():
    x = np.array([1000.0, 1001.0, -1001.0, 3.0], np.float16)  # 1001/4 = 250.25 is not a float16 value
    inputs = {"x": x, "scale": np.array(4.0, np.float32), "zero": np.array(0, np.int16)}
    (got,), _ = run(node_model("QuantizeLinear", inputs), inputs)
    np.testing.assert_array_equal(got, [250, 250, -250, 1])


def test_quantize_precision_attribute():
    # In float16, 2049 is not representable: the division happens on 2048.
    x = np.array([2049.0, -2049.0, 1.0], np.float32)
    inputs = {"x": x, "scale": np.array(1.0, np.float32), "zero": np.array(0, np.int16)}
    (got,), _ = run(node_model("QuantizeLinear", inputs, precision=T.FLOAT16), inputs)
    np.testing.assert_array_equal(got, [2048, -2048, 1])
    (got,), _ = run(node_model("QuantizeLinear", inputs), inputs)
    np.testing.assert_array_equal(got, [2049, -2049, 1])


def test_quantize_int32_input_divides_exactly():
    x = np.array([2**30 + 1, -(2**30) - 3, 7], np.int32)  # float32 would round these
    inputs = {"x": x, "scale": np.array(2**15, np.float32), "zero": np.array(0, np.int16)}
    assert_matches_reference("QuantizeLinear", inputs, rtol=0, atol=0)


@pytest.mark.parametrize("opset", [10, 13, 19])
def test_quantize_old_opsets(opset):
    x = np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4)
    scale, zero = (np.array([0.01, 0.1, 1.0], np.float32), np.array([128, 0, 255], np.uint8))
    if opset == 10:  # per-tensor only
        scale, zero = np.array(0.02, np.float32), np.array(120, np.uint8)
    inputs = {"x": x, "scale": scale, "zero": zero}
    attrs = {} if opset == 10 else {"axis": 0}
    ours, theirs = run_both(node_model("QuantizeLinear", inputs, opset=opset, **attrs), inputs)
    assert_same(ours, theirs)


def test_quantize_defaults_to_uint8():
    inputs = {"x": np.array([-1.0, 0.6, 300.0], np.float32), "scale": np.array(1.0, np.float32)}
    (got,), _ = run(node_model("QuantizeLinear", inputs), inputs)
    assert got.dtype == np.uint8
    np.testing.assert_array_equal(got, [0, 1, 255])


def test_quantize_output_dtype_must_match_zero_point():
    inputs = {"x": np.zeros(2, np.float32), "scale": np.array(1.0, np.float32), "zero": np.array(0, np.int8)}
    with pytest.raises(NodeError, match="output_dtype UINT8 differs from y_zero_point's type INT8"):
        run(node_model("QuantizeLinear", inputs, output_dtype=T.UINT8), inputs)


def test_quantize_blocked_scale_shape_error():
    inputs = {"x": np.zeros((4, 6), np.float32), "scale": np.ones((4, 2), np.float32)}
    with pytest.raises(NodeError, match=r"blocked y_scale must have shape \(4, 3\)"):
        run(node_model("QuantizeLinear", inputs, axis=1, block_size=2), inputs)


def test_quantize_per_axis_scale_length_error():
    inputs = {"x": np.zeros((4, 6), np.float32), "scale": np.ones(4, np.float32)}
    with pytest.raises(NodeError, match="per-axis y_scale must be a vector of length 6"):
        run(node_model("QuantizeLinear", inputs, axis=1), inputs)


# ---- DequantizeLinear ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [ml_dtypes.int4, ml_dtypes.uint4, ml_dtypes.int2, np.int16, np.uint16])
def test_dequantize_per_axis_traced(dtype):
    info = ml_dtypes.iinfo(dtype)
    x = np.array([[info.min, 0, info.max], [1, info.max, info.min]], dtype)
    zero = np.array([info.max, info.min], dtype)
    scale = np.array([0.5, 3.0], np.float32)
    feeds = {"x": x, "scale": scale, "zero": zero}
    engine = onnxtrain.load(node_model("DequantizeLinear", feeds, axis=0), check=False)
    got = np.asarray(engine.infer(feeds)["out0"])
    want = (x.astype(np.float64) - zero.astype(np.float64)[:, None]) * scale[:, None]
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    assert engine.trace_count == 1


def test_dequantize_blocked_float16_scale_with_output_dtype():
    x = (np.arange(2 * 5) * 37 % 256).astype(np.uint8).reshape(2, 5)
    scale = np.array([[0.5, 0.25, 2.0], [1.5, 0.125, 0.75]], np.float16)
    zero = np.array([[3, 200, 0], [128, 1, 255]], np.uint8)
    inputs = {"x": x, "scale": scale, "zero": zero}
    for attrs in ({}, {"output_dtype": T.FLOAT}, {"output_dtype": T.BFLOAT16}):
        assert_matches_reference("DequantizeLinear", inputs, axis=1, block_size=2, rtol=0, atol=0, **attrs)


def test_dequantize_float8e8m0_scale():
    x = np.array([[1.5, -448.0], [0.0, 2.0]], ml_dtypes.float8_e4m3fn)
    scale = np.array([2.0**-20, 2.0**10], ml_dtypes.float8_e8m0fnu)
    inputs = {"x": x, "scale": scale}
    (got,), _ = run(node_model("DequantizeLinear", inputs, axis=1, output_dtype=T.FLOAT), inputs)
    np.testing.assert_array_equal(got, [[1.5 * 2.0**-20, -448.0 * 2.0**10], [0.0, 2.0**11]])
    with pytest.raises(NodeError, match="needs the output_dtype attribute"):
        run(node_model("DequantizeLinear", inputs, axis=1), inputs)


def test_dequantize_int32_without_zero_point():
    x = np.array([2**24 + 1, -(2**31), 2**31 - 1], np.int32)
    inputs = {"x": x, "scale": np.array(0.5, np.float32)}
    for opset in (10, 13, 19, 21, 25):
        (got,), _ = run(node_model("DequantizeLinear", inputs, opset=opset), inputs)
        np.testing.assert_array_equal(got, (x.astype(np.float64) * 0.5).astype(np.float32))


def test_dequantize_zero_point_type_mismatch():
    inputs = {"x": np.zeros(2, np.uint8), "scale": np.array(1.0, np.float32), "zero": np.array(0, np.int8)}
    with pytest.raises(NodeError, match=r"input 2 \('zero'\) is tensor\(int8\) but input 0 \('x'\) is tensor\(uint8\)"):
        run(node_model("DequantizeLinear", inputs), inputs)


def test_quantize_dequantize_round_trip_float6():
    """XLA has no 6-bit floats: both conversions run on the host, so x is compiled in as a constant."""
    x = np.array([0.25, -1.5, 3.0, 100.0], np.float32)
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "scale"], ["q"], output_dtype=T.FLOAT6E2M3),
        helper.make_node("DequantizeLinear", ["q", "scale"], ["y"]),
    ]
    inputs = {"x": x, "scale": np.array(0.5, np.float32)}
    graph = helper.make_graph(
        nodes,
        "round_trip",
        [helper.make_tensor_value_info(n, T.FLOAT, v.shape) for n, v in inputs.items()],
        [helper.make_empty_tensor_value_info("y")],
    )
    with pytest.warns(UserWarning, match="compiled in as constants"):
        (got,), _ = run(helper.make_model(graph), inputs)
    np.testing.assert_array_equal(got, (x / 0.5).astype(ml_dtypes.float6_e2m3fn).astype(np.float32) * 0.5)


# ---- DynamicQuantizeLinear -----------------------------------------------------------------------------------


def test_dynamic_quantize_traced_inputs_of_each_sign():
    x = np.zeros(6, np.float32)
    engine = onnxtrain.load(node_model("DynamicQuantizeLinear", {"x": x}, n_outputs=3), check=False)
    for x in ([1.0, 2.5, 0.1, 3.3, 0.0, 7.0], [-4.0, -0.5, -2.0, -1.0, -3.0, -0.25], [-1.3, 0.0, 2.7, 0.5, 1.1, -0.2]):
        x = np.array(x, np.float32)
        got = engine.infer({"x": x})
        ours = [np.asarray(got[f"out{i}"]) for i in range(3)]
        _, theirs = run_both(node_model("DynamicQuantizeLinear", {"x": x}, n_outputs=3), {"x": x})
        assert [o.dtype for o in ours] == [np.uint8, np.float32, np.uint8]
        np.testing.assert_array_equal(ours[0], theirs[0])
        np.testing.assert_allclose(ours[1], theirs[1], rtol=1e-7)
        np.testing.assert_array_equal(ours[2], theirs[2])
    assert engine.trace_count == 1


def test_dynamic_quantize_all_zero_input():
    x = np.zeros((2, 2), np.float32)
    (y, scale, zero), _ = run(node_model("DynamicQuantizeLinear", {"x": x}, n_outputs=3), {"x": x})
    np.testing.assert_array_equal(y, np.zeros((2, 2)))
    assert scale == np.float32(1 / 255) and zero == 0 and scale.shape == () and zero.shape == ()


# ---- QLinearMatMul -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("opset", [10, 21])
def test_qlinear_matmul_per_row_and_per_column(opset):
    rng = np.random.default_rng(0)
    a = rng.integers(-128, 128, (3, 4)).astype(np.int8)
    b = rng.integers(0, 256, (4, 5)).astype(np.uint8)
    inputs = {
        "a": a, "a_scale": np.array([0.02, 0.05, 0.1], np.float32), "a_zero": np.array([1, -3, 0], np.int8),
        "b": b, "b_scale": np.linspace(0.01, 0.03, 5, dtype=np.float32), "b_zero": np.arange(120, 125, dtype=np.uint8),
        "y_scale": np.array(0.07, np.float32), "y_zero": np.array(100, np.uint8),
    }  # fmt: skip
    (got,), _ = run(node_model("QLinearMatMul", inputs, opset=opset), inputs)
    product = (a.astype(np.int64) - inputs["a_zero"][:, None]) @ (b.astype(np.int64) - inputs["b_zero"])
    factor = inputs["a_scale"][:, None] * inputs["b_scale"] / inputs["y_scale"]
    want = np.clip(np.rint(product * factor.astype(np.float64)) + 100, 0, 255)
    assert got.dtype == np.uint8
    np.testing.assert_array_equal(got, want)


def test_qlinear_matmul_batched_traced():
    rng = np.random.default_rng(1)
    a = rng.integers(0, 256, (2, 3, 4)).astype(np.uint8)
    b = rng.integers(-128, 128, (2, 4, 2)).astype(np.int8)
    inputs = {
        "a": a, "a_scale": np.array(0.1, np.float32), "a_zero": np.array(128, np.uint8),
        "b": b, "b_scale": np.array(0.05, np.float32), "b_zero": np.array(-1, np.int8),
        "y_scale": np.array(0.3, np.float32), "y_zero": np.array(-20, np.int8),
    }  # fmt: skip
    ours, theirs = run_both(node_model("QLinearMatMul", inputs), inputs)
    assert_same(ours, theirs)


def test_qlinear_matmul_float8():
    a = np.array([[1.0, -2.0], [0.5, 4.0]], ml_dtypes.float8_e4m3fn)
    b = np.array([[3.0, 0.25], [-1.0, 2.0]], ml_dtypes.float8_e5m2)
    zero_a, zero_b = np.array(0, ml_dtypes.float8_e4m3fn), np.array(0, ml_dtypes.float8_e5m2)
    inputs = {
        "a": a, "a_scale": np.array(2.0, np.float32), "a_zero": zero_a,
        "b": b, "b_scale": np.array(0.5, np.float32), "b_zero": zero_b,
        "y_scale": np.array(0.001, np.float32), "y_zero": np.array(0, ml_dtypes.float8_e4m3fn),
    }  # fmt: skip
    (got,), _ = run(node_model("QLinearMatMul", inputs), inputs)
    exact = (a.astype(np.float32) @ b.astype(np.float32)) * (2.0 * 0.5 / np.float32(0.001))
    want = np.clip(exact, -448, 448).astype(ml_dtypes.float8_e4m3fn)  # saturated, not NaN
    assert got.dtype == ml_dtypes.float8_e4m3fn
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))
