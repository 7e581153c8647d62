"""Float constants a graph computes from constants alone enter the program as arguments (lower/constants.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import onnxtrain


def constant_filter_model(channels: int = 32, filters: int = 64) -> onnx.ModelProto:
    """Conv whose weight is a splat `Constant`, then GlobalAveragePool: what XLA-CPU in jaxlib 0.10.2 miscompiles
    when the weight is compiled into the program (0.01 instead of 0.32 here)."""
    weight = np.full((filters, channels, 1, 1), 0.01, np.float32)
    nodes = [
        helper.make_node("Constant", [], ["W"], value=numpy_helper.from_array(weight)),
        helper.make_node("Conv", ["X", "W"], ["C"]),
        helper.make_node("GlobalAveragePool", ["C"], ["Y"]),
    ]
    graph = helper.make_graph(nodes, "constant_filter",
                              [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, channels, 8, 8])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, filters, 1, 1])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


CHILD = textwrap.dedent("""
    import sys, numpy as np, onnx, onnxtrain
    from onnx.reference import ReferenceEvaluator
    model = onnx.load(sys.argv[1])
    x = np.random.default_rng(0).random((1, 32, 8, 8), np.float32)
    got = onnxtrain.load(model).infer({"X": x})["Y"]
    want = ReferenceEvaluator(model).run(None, {"X": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5)
""")


def test_constant_filter_then_pool_matches_the_reference_in_fresh_processes(tmp_path):
    """Each process compiles anew (the miscompile was decided at compile time); the persistent cache is off."""
    path = tmp_path / "model.onnx"
    onnx.save(constant_filter_model(), path)
    env = {**os.environ, "ONNXTRAIN_CACHE_DIR": ""}
    for _ in range(3):
        result = subprocess.run([sys.executable, "-c", CHILD, str(path)], env=env, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-2000:]


def test_a_float_constant_is_an_argument_not_a_literal():
    engine = onnxtrain.load(constant_filter_model())
    text = engine.lower({"X": np.zeros((1, 32, 8, 8), np.float32)}).as_text()
    assert "tensor<64x32x1x1xf32>" in text  # the filter is there...
    assert not [line for line in text.splitlines() if "constant" in line and "64x32x1x1" in line]  # ...not as a literal


def test_a_constant_an_op_reads_at_trace_time_stays_static():
    """RoiAlign with sampling_ratio=0 reads its rois with static(): a constant rois tensor of 5 boxes (20 floats,
    hoisted) still reaches it as NumPy, while the traced X makes the node a traced call."""
    rois = np.array([[0, 0, 3, 3], [1, 1, 4, 4], [0, 2, 2, 4], [2, 0, 4, 3], [1, 1, 2, 2]], np.float32)
    nodes = [
        helper.make_node("Constant", [], ["rois"], value=numpy_helper.from_array(rois)),
        helper.make_node("Constant", [], ["index"], value=numpy_helper.from_array(np.zeros(5, np.int64))),
        helper.make_node("RoiAlign", ["X", "rois", "index"], ["Y"], output_height=2, output_width=2,
                         sampling_ratio=0),
    ]
    graph = helper.make_graph(nodes, "roi", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 2, 5, 5])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [5, 2, 2, 2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])
    x = np.random.default_rng(1).random((1, 2, 5, 5), np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = onnxtrain.load(model).infer({"X": x})["Y"]
    np.testing.assert_allclose(got, ReferenceEvaluator(model).run(None, {"X": x})[0], rtol=1e-5, atol=1e-6)


def test_resize_scales_held_in_an_initializer_stay_static():
    """The dynamo exporter writes nn.Upsample's scales as a float initializer, which (a float vector) would live on
    the device as a weight does; Resize reads them when traced (engine.TRACE_TIME_FLOAT_INPUTS): the model had
    failed to run at all (StaticValueRequired)."""
    nodes = [helper.make_node("Resize", ["X", "", "scales"], ["R"], mode="linear"),
             helper.make_node("Mul", ["R", "W"], ["Y"])]
    graph = helper.make_graph(nodes, "upsample", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 2, 3, 3])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 2, 6, 6])],
                              [numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"),
                               numpy_helper.from_array(np.full((1, 2, 1, 1), 0.5, np.float32), "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    x = np.random.default_rng(2).random((1, 2, 3, 3), np.float32)
    expected = ReferenceEvaluator(model).run(None, {"X": x})[0]
    np.testing.assert_allclose(onnxtrain.load(model).infer({"X": x})["Y"], expected, rtol=1e-5, atol=1e-6)
    engine = onnxtrain.load(onnxtrain.make_trainable(model, loss="mse", optimizer="sgd", learning_rate=0.5))
    target = np.zeros((1, 2, 6, 6), np.float32)
    engine.train_step({"X": x, "target": target})  # W -= 0.5 * mean(2 * R * (R W - 0)) per channel
    r = expected / 0.5
    w = 0.5 - 0.5 * (2 * r * r * 0.5).sum(axis=(0, 2, 3), keepdims=True) / r.size
    np.testing.assert_allclose(np.asarray(engine.state["W"]), w, rtol=1e-5)
    assert sorted(engine.state) == ["W"]


def test_scalar_initializers_compile_in_and_stay_parameters_of_jax_function():
    """An exporter's scalar initializers (GELU's x ** 3.0 and its coefficient) are literals of the program, so
    the power is multiplications (no XLA pow: ~10x slower on the CPU), while jax_function still differentiates
    in them. NumPy is the reference; a fractional exponent keeps the general power."""
    import jax

    nodes = [helper.make_node("Pow", ["X", "three"], ["cube"]), helper.make_node("Mul", ["cube", "c"], ["Y"]),
             helper.make_node("Pow", ["X", "half"], ["Z"])]
    graph = helper.make_graph(
        nodes, "scalars", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [5])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [5]) for n in ("Y", "Z")],
        [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in (("three", 3.0), ("c", 0.044715),
                                                                          ("half", 0.5))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = np.array([-1.5, -0.25, 0.0, 0.7, 2.0], np.float32)
    engine = onnxtrain.load(model)
    out = engine.infer({"X": x})
    np.testing.assert_allclose(np.asarray(out["Y"]), 0.044715 * x.astype(np.float64) ** 3, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out["Z"]), np.abs(x) ** 0.5 * np.where(x < 0, np.nan, 1), rtol=1e-6)
    text = engine.lower({"X": x}).as_text()
    assert text.count("stablehlo.power") == 1  # the 0.5 one only
    fn, params = engine.jax_function()
    assert {"three", "c", "half"} <= set(params)
    grad = jax.grad(lambda p: fn(p, {"X": x})["Y"].sum())(params)
    np.testing.assert_allclose(float(grad["c"]), float(np.sum(x.astype(np.float64) ** 3)), rtol=1e-6)
