"""Conv, ConvTranspose, ConvInteger, QLinearConv, DeformConv against onnx's reference (and NumPy where the
reference does not follow the spec); gradients against central differences of the reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx.reference import ReferenceEvaluator

import onnxtrain
from nodes import assert_matches_reference, node_model, run_both, lowering
from onnxtrain.errors import NodeError

RNG = np.random.default_rng(0)


def rand(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def assert_gradient_matches_reference(
    op_type: str, inputs: dict[str, np.ndarray], wrt: str, *, eps: float = 1e-6, rtol: float = 1e-6, **attrs
) -> None:
    """jax.grad of our lowering (float64, jitted) against central differences of onnx's reference, along a few
    random directions of input `wrt`."""
    rng = np.random.default_rng(0)  # local: the result must not depend on which tests ran before
    reference = ReferenceEvaluator(node_model(op_type, inputs, **attrs))
    out_weights = rng.standard_normal(reference.run(None, inputs)[0].shape)

    def reference_loss(value: np.ndarray) -> float:
        return float((reference.run(None, {**inputs, wrt: value})[0] * out_weights).sum())

    fn = lowering(op_type)

    def loss(value):
        args = [value if name == wrt else inputs[name] for name in inputs]
        return jnp.sum(fn(*args, **attrs) * out_weights)

    with jax.enable_x64(True):
        grad = np.asarray(jax.jit(jax.grad(loss))(jnp.asarray(inputs[wrt])))
    assert grad.dtype == np.float64
    for _ in range(3):
        direction = rng.standard_normal(inputs[wrt].shape)
        x = inputs[wrt]
        numeric = (reference_loss(x + eps * direction) - reference_loss(x - eps * direction)) / (2 * eps)
        np.testing.assert_allclose((grad * direction).sum(), numeric, rtol=rtol, atol=1e-8)


@pytest.mark.parametrize(
    "x_shape, w_shape, attrs",
    [
        ((2, 3, 9), (4, 3, 3), dict(strides=[2], pads=[1, 2])),
        ((1, 4, 7, 8), (6, 2, 3, 2), dict(group=2, dilations=[2, 1], pads=[1, 0, 2, 1])),
        ((1, 4, 7, 8), (4, 1, 3, 3), dict(group=4, strides=[2, 3])),  # depthwise
        ((1, 2, 5, 6, 4), (3, 2, 2, 3, 2), dict(strides=[1, 2, 1], pads=[1, 0, 1, 0, 1, 1])),
        ((1, 3, 7, 7), (2, 3, 3, 3), dict(auto_pad="SAME_UPPER", strides=[2, 2])),
        ((1, 3, 8, 7), (2, 3, 4, 2), dict(auto_pad="SAME_LOWER", strides=[3, 2], dilations=[1, 2])),
        ((1, 3, 8, 7), (2, 3, 3, 2), dict(auto_pad="VALID", strides=[2, 2])),
        ((2, 8, 7, 6), (5, 8, 3, 3), dict(strides=[2, 1], dilations=[1, 2], pads=[1, 2, 0, 1])),  # XLA's conv
    ],
)
def test_conv_geometries(x_shape, w_shape, attrs):
    inputs = {"X": rand(*x_shape), "W": rand(*w_shape), "B": rand(w_shape[0])}
    assert_matches_reference("Conv", inputs, rtol=1e-4, atol=1e-5, **attrs)


def test_conv_float64_stays_exact_and_bias_is_optional():
    inputs = {"X": rand(2, 3, 6, 5, dtype=np.float64), "W": rand(4, 3, 3, 3, dtype=np.float64)}
    (y,) = assert_matches_reference("Conv", inputs, rtol=1e-12, atol=1e-12, pads=[1, 1, 1, 1])
    assert y.dtype == np.float64


def test_conv_float16():
    inputs = {"X": rand(1, 2, 5, 5, dtype=np.float16), "W": rand(3, 2, 3, 3, dtype=np.float16)}
    assert_matches_reference("Conv", inputs, rtol=1e-2, atol=1e-2)


def test_conv_bfloat16_keeps_its_dtype():
    x, w = rand(1, 2, 5, 5).astype(ml_dtypes.bfloat16), rand(3, 2, 3, 3).astype(ml_dtypes.bfloat16)
    model = node_model("Conv", {"X": x, "W": w}, pads=[1, 1, 1, 1])
    y = np.asarray(onnxtrain.load(model, check=False).infer({"X": x, "W": w})["out0"])
    assert y.dtype == ml_dtypes.bfloat16
    wide = {"X": x.astype(np.float32), "W": w.astype(np.float32)}
    expected = ReferenceEvaluator(node_model("Conv", wide, pads=[1, 1, 1, 1])).run(None, wide)[0]
    np.testing.assert_allclose(y.astype(np.float32), expected, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("opset", [1, 11])
def test_conv_old_opsets(opset):
    inputs = {"X": rand(1, 2, 6, 6), "W": rand(3, 2, 3, 3), "B": rand(3)}
    assert_matches_reference("Conv", inputs, rtol=1e-4, atol=1e-5, opset=opset, strides=[2, 2], pads=[1, 1, 0, 0])


def test_conv_with_weights_as_initializers_is_static_folded():
    """All inputs known at trace time: the node folds to a constant, with the same values."""
    x, w = rand(1, 2, 5, 5), rand(3, 2, 3, 3)
    node = onnx.helper.make_node("Conv", ["X", "W"], ["Y"], pads=[1, 1, 1, 1])
    graph = onnx.helper.make_graph(
        [node], "g", [], [onnx.helper.make_empty_tensor_value_info("Y")],
        initializer=[onnx.numpy_helper.from_array(x.astype(np.int64).astype(np.float32), "X"),
                     onnx.numpy_helper.from_array(w, "W")],
    )
    model = onnx.helper.make_model(graph)
    ours = onnxtrain.load(model, check=False).infer({})["Y"]
    np.testing.assert_allclose(ours, ReferenceEvaluator(model).run(None, {})[0], rtol=1e-5, atol=1e-5)


def test_conv_errors_name_the_problem():
    model = node_model("Conv", {"X": rand(1, 3, 5, 5), "W": rand(2, 2, 3, 3)})
    with pytest.raises(NodeError, match="channels"):
        onnxtrain.load(model, check=False).infer({"X": rand(1, 3, 5, 5), "W": rand(2, 2, 3, 3)})
    model = node_model("Conv", {"X": rand(1, 2, 5, 5), "W": rand(2, 2, 3, 3)}, kernel_shape=[2, 2])
    with pytest.raises(NodeError, match="kernel_shape"):
        onnxtrain.load(model, check=False).infer({"X": rand(1, 2, 5, 5), "W": rand(2, 2, 3, 3)})
    model = node_model("Conv", {"X": rand(1, 2, 5, 5), "W": rand(2, 2, 3, 3)}, auto_pad="SAME")
    with pytest.raises(NodeError, match="auto_pad"):
        onnxtrain.load(model, check=False).infer({"X": rand(1, 2, 5, 5), "W": rand(2, 2, 3, 3)})


@pytest.mark.parametrize("wrt", ["X", "W"])
def test_conv_gradient(wrt):
    inputs = {"X": rand(2, 4, 6, 5, dtype=np.float64), "W": rand(6, 2, 3, 2, dtype=np.float64)}
    assert_gradient_matches_reference("Conv", inputs, wrt, group=2, strides=[2, 1], pads=[1, 0, 0, 1])


@pytest.mark.parametrize("wrt", ["X", "W"])
@pytest.mark.parametrize(
    "x_shape, w_shape, attrs",
    [
        ((2, 3, 9, 8), (4, 3, 3, 2), dict(strides=[2, 1], dilations=[1, 2], pads=[1, 0, 2, 1])),
        ((2, 1, 11), (3, 1, 5), dict(strides=[3], pads=[2, 1])),
        ((1, 2, 5, 4, 6), (3, 2, 2, 1, 3), dict(strides=[1, 2, 2], pads=[1, 0, 0, 0, 1, 1])),
    ],
)
def test_shallow_conv_gradient(wrt, x_shape, w_shape, attrs):
    """Few input channels take the multiply-add form on CPU; the kernel's gradient is an im2col product."""
    inputs = {"X": rand(*x_shape, dtype=np.float64), "W": rand(*w_shape, dtype=np.float64)}
    assert_gradient_matches_reference("Conv", inputs, wrt, **attrs)


DEPTHWISE = [
    ((2, 6, 9, 8), (6, 1, 3, 3), dict(group=6, pads=[1, 1, 1, 1])),
    ((2, 3, 9, 8), (6, 1, 3, 2), dict(group=3, strides=[2, 1], dilations=[1, 2], pads=[1, 0, 2, 1])),  # 2 per group
    ((1, 4, 5, 4, 6), (4, 1, 2, 1, 3), dict(group=4, strides=[1, 2, 2], pads=[1, 0, 0, 0, 1, 1])),
]


@pytest.mark.parametrize("x_shape, w_shape, attrs", DEPTHWISE)
def test_depthwise_conv(x_shape, w_shape, attrs):
    """One input channel per group: multiply-adds on CPU (XLA-CPU's depthwise convolution is 10-35x slower)."""
    inputs = {"X": rand(*x_shape), "W": rand(*w_shape), "B": rand(w_shape[0])}
    assert_matches_reference("Conv", inputs, rtol=1e-4, atol=1e-5, **attrs)


@pytest.mark.parametrize("wrt", ["X", "W"])
@pytest.mark.parametrize("x_shape, w_shape, attrs", DEPTHWISE)
def test_depthwise_conv_gradient(wrt, x_shape, w_shape, attrs):
    inputs = {"X": rand(*x_shape, dtype=np.float64), "W": rand(*w_shape, dtype=np.float64)}
    assert_gradient_matches_reference("Conv", inputs, wrt, **attrs)


@pytest.mark.parametrize(
    "x_shape, w_shape, attrs",
    [
        ((1, 2, 4), (2, 3, 3), dict(strides=[2], output_padding=[1])),
        ((1, 2, 3, 3), (2, 2, 3, 3), dict(strides=[3, 2], output_shape=[10, 8])),
        ((1, 2, 3, 3), (2, 2, 3, 3), dict(strides=[2, 2], output_shape=[6, 5], auto_pad="SAME_UPPER")),
        ((1, 2, 3, 4), (2, 1, 3, 3), dict(strides=[2, 2], auto_pad="SAME_LOWER")),
        ((1, 2, 3, 4), (2, 1, 2, 3), dict(strides=[2, 2], auto_pad="VALID")),
        ((1, 2, 2, 3, 2), (2, 2, 2, 2, 2), dict(strides=[2, 1, 2], pads=[0, 1, 0, 1, 0, 0])),
    ],
)
def test_conv_transpose_geometries(x_shape, w_shape, attrs):
    inputs = {"X": rand(*x_shape), "W": rand(*w_shape), "B": rand(w_shape[1] * attrs.get("group", 1))}
    assert_matches_reference("ConvTranspose", inputs, rtol=1e-4, atol=1e-5, **attrs)


def test_conv_transpose_groups():
    """onnx's reference mixes up groups with several output channels each: compare with one call per group."""
    attrs = dict(strides=[2, 3], pads=[1, 0, 1, 2], dilations=[2, 1])
    x, w, b = rand(2, 4, 3, 4, dtype=np.float64), rand(4, 2, 3, 3, dtype=np.float64), rand(4, dtype=np.float64)
    inputs = {"X": x, "W": w, "B": b}
    model = node_model("ConvTranspose", {"X": x, "W": w}, group=2, **attrs)
    without_bias = onnxtrain.load(model, check=False).infer({"X": x, "W": w})["out0"]
    per_group = []
    for g in range(2):
        group_inputs = {"X": x[:, 2 * g:2 * g + 2], "W": w[2 * g:2 * g + 2]}
        reference = ReferenceEvaluator(node_model("ConvTranspose", group_inputs, **attrs))
        per_group.append(reference.run(None, group_inputs)[0])
    expected = np.concatenate(per_group, axis=1)
    np.testing.assert_allclose(without_bias, expected, rtol=1e-12, atol=1e-12)
    model = node_model("ConvTranspose", inputs, group=2, **attrs)
    with_bias = onnxtrain.load(model, check=False).infer(inputs)["out0"]
    np.testing.assert_allclose(with_bias, expected + b.reshape(1, 4, 1, 1), rtol=1e-12, atol=1e-12)


def test_conv_transpose_output_shape_splits_odd_padding_by_opset():
    """total padding 1: opset 11+ puts it at the beginning (NOTSET), opset 1 at the end."""
    inputs = {"X": rand(1, 1, 3, 3, dtype=np.float64), "W": rand(1, 1, 3, 3, dtype=np.float64)}
    full = assert_matches_reference("ConvTranspose", inputs, rtol=1e-12, atol=1e-12)[0]  # 5 x 5
    for opset, rows in ((22, slice(1, 5)), (11, slice(1, 5)), (1, slice(0, 4))):
        model = node_model("ConvTranspose", inputs, opset=opset, output_shape=[4, 4])
        ours = onnxtrain.load(model, check=False).infer(inputs)["out0"]
        np.testing.assert_allclose(ours, full[:, :, rows, rows], rtol=1e-12)


def test_conv_transpose_gradient():
    inputs = {"X": rand(1, 4, 3, 4, dtype=np.float64), "W": rand(4, 2, 3, 2, dtype=np.float64)}
    assert_gradient_matches_reference("ConvTranspose", inputs, "X", strides=[2, 2], pads=[1, 0, 0, 1])


@pytest.mark.parametrize("dtypes", [(np.uint8, np.uint8), (np.int8, np.int8), (np.uint8, np.int8)])
def test_conv_integer(dtypes):
    x = RNG.integers(0, 100, (1, 2, 5, 5)).astype(dtypes[0])
    w = RNG.integers(0, 50, (3, 2, 3, 3)).astype(dtypes[1])
    inputs = {"x": x, "w": w, "x_zero_point": np.array(3, dtypes[0])}
    (y,) = assert_matches_reference("ConvInteger", inputs, pads=[1, 1, 1, 1])
    assert y.dtype == np.int32


def test_conv_integer_per_channel_weight_zero_point():
    x = RNG.integers(0, 255, (1, 2, 4, 4)).astype(np.uint8)
    w = RNG.integers(0, 255, (3, 2, 2, 2)).astype(np.uint8)
    inputs = {"x": x, "w": w, "x_zero_point": np.array(128, np.uint8), "w_zero_point": np.array([1, 2, 3], np.uint8)}
    assert_matches_reference("ConvInteger", inputs, strides=[2, 2])


@pytest.mark.parametrize("per_channel", [False, True])
def test_qlinear_conv(per_channel):
    x = RNG.integers(0, 255, (1, 2, 5, 5)).astype(np.uint8)
    w = RNG.integers(-100, 100, (3, 2, 3, 3)).astype(np.int8)
    w_scale = np.array([0.01, 0.02, 0.015], np.float32) if per_channel else np.array(0.01, np.float32)
    inputs = {
        "x": x, "x_scale": np.array(0.05, np.float32), "x_zero_point": np.array(120, np.uint8),
        "w": w, "w_scale": w_scale, "w_zero_point": np.zeros(3 if per_channel else (), np.int8),
        "y_scale": np.array(0.2, np.float32), "y_zero_point": np.array(100, np.uint8),
        "B": RNG.integers(-500, 500, 3).astype(np.int32),
    }
    model = node_model("QLinearConv", inputs, pads=[1, 1, 1, 1])
    ours, theirs = run_both(model, inputs)
    assert ours[0].dtype == np.uint8
    # onnx's reference requantizes in float64, the engine in float32 (as onnxruntime): ties may round apart
    assert np.abs(ours[0].astype(int) - theirs[0].astype(int)).max() <= 1


@pytest.mark.parametrize(
    "attrs",
    [
        dict(),
        dict(group=2, offset_group=2, strides=[2, 1], pads=[1, 1, 0, 1], dilations=[1, 2]),
    ],
)
@pytest.mark.parametrize("with_mask", [False, True])
def test_deform_conv(attrs, with_mask):
    x, w = rand(2, 4, 5, 6), rand(4, 4 // attrs.get("group", 1), 2, 3)
    out = {(): (4, 4), (2,): (3, 4)}[() if not attrs else (2,)]
    offset_group = attrs.get("offset_group", 1)
    inputs = {"X": x, "W": w, "offset": rand(2, offset_group * 6 * 2, *out), "B": rand(4)}
    if with_mask:
        inputs["mask"] = RNG.random((2, offset_group * 6, *out)).astype(np.float32)
    assert_matches_reference("DeformConv", inputs, rtol=1e-4, atol=1e-5, **attrs)


def test_deform_conv_zero_offset_is_conv():
    x, w = rand(1, 2, 5, 5, dtype=np.float64), rand(3, 2, 3, 3, dtype=np.float64)
    offset = np.zeros((1, 18, 3, 3))
    model = node_model("DeformConv", {"X": x, "W": w, "offset": offset})
    ours = onnxtrain.load(model, check=False).infer({"X": x, "W": w, "offset": offset})["out0"]
    conv = ReferenceEvaluator(node_model("Conv", {"X": x, "W": w})).run(None, {"X": x, "W": w})[0]
    np.testing.assert_allclose(ours, conv, rtol=1e-12)
