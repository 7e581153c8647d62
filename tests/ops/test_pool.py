"""Pools against onnx's reference (and NumPy where it has none); gradients against central differences."""

from __future__ import annotations

import math
from fractions import Fraction

import jax
import numpy as np
import pytest

from nodes import assert_matches_reference, node_model, run_both
from onnxtrain.errors import NodeError
from test_conv import assert_gradient_matches_reference, lowering
from nodes import run_outputs as run

# MaxUnpool's output_shape fed as a graph input is compiled in as a constant, with a warning: expected here
pytestmark = pytest.mark.filterwarnings("ignore:.*compiled in as constants")

RNG = np.random.default_rng(1)


def rand(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


POOL_GEOMETRIES = [
    dict(kernel_shape=[3], strides=[2], pads=[1, 1]),
    dict(kernel_shape=[3, 2], strides=[2, 1], pads=[1, 0, 1, 1]),
    dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1),
    dict(kernel_shape=[2, 3], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1),
    dict(kernel_shape=[2, 2], strides=[1, 2], dilations=[2, 2]),
    dict(kernel_shape=[3, 3], strides=[2, 2], auto_pad="SAME_UPPER"),
    dict(kernel_shape=[2, 3], strides=[3, 2], auto_pad="SAME_LOWER"),
    dict(kernel_shape=[3, 3], strides=[2, 2], auto_pad="VALID"),
    dict(kernel_shape=[2, 2], strides=[2, 2]),  # tiles the input: the reshape path, with a cropped remainder
    dict(kernel_shape=[2, 2, 2], strides=[2, 1, 2], pads=[0, 1, 0, 1, 0, 1]),
]


def shape_for(attrs: dict) -> tuple[int, ...]:
    return {1: (2, 3, 9), 2: (2, 3, 7, 9), 3: (1, 2, 5, 6, 5)}[len(attrs["kernel_shape"])]


@pytest.mark.parametrize("attrs", [a for a in POOL_GEOMETRIES if a.get("auto_pad") != "SAME_LOWER"])
def test_max_pool(attrs):
    assert_matches_reference("MaxPool", {"X": rand(*shape_for(attrs))}, **attrs)


def test_max_pool_same_lower_is_ceil_sized():
    """onnx's reference floors SAME_LOWER's output size when strided; the spec says ceil(input / stride), with
    the odd pad at the beginning: here pads [1, 1, 0, 1]."""
    x = rand(2, 3, 7, 9)
    attrs = dict(kernel_shape=[2, 3], strides=[3, 2])
    (y,) = run(node_model("MaxPool", {"X": x}, auto_pad="SAME_LOWER", **attrs), {"X": x})
    (expected,) = run_both(node_model("MaxPool", {"X": x}, pads=[1, 1, 0, 1], **attrs), {"X": x})[1]
    assert y.shape == (2, 3, 3, 5)
    np.testing.assert_array_equal(y, expected)


@pytest.mark.parametrize("attrs", POOL_GEOMETRIES)
@pytest.mark.parametrize("count_include_pad", [0, 1])
def test_average_pool(attrs, count_include_pad):
    x = rand(*shape_for(attrs), dtype=np.float64)
    assert_matches_reference(
        "AveragePool", {"X": x}, rtol=1e-12, atol=1e-12, count_include_pad=count_include_pad, **attrs
    )


@pytest.mark.parametrize("attrs", [a for a in POOL_GEOMETRIES if "pads" not in a and "auto_pad" not in a])
@pytest.mark.parametrize("p", [1, 2, 3])
def test_lp_pool_without_padding(attrs, p):
    assert_matches_reference("LpPool", {"X": rand(*shape_for(attrs))}, rtol=1e-4, atol=1e-5, p=p, **attrs)


def test_lp_pool_padding_counts_as_zero():
    """onnx's reference rescales a padded window's mean by the full kernel size; the spec's norm ignores pads."""
    x = rand(1, 2, 4, 5, dtype=np.float64)
    (y,) = run(node_model("LpPool", {"X": x}, kernel_shape=[3, 3], pads=[1, 1, 1, 1], p=3), {"X": x})
    padded = np.pad(np.abs(x) ** 3, ((0, 0), (0, 0), (1, 1), (1, 1)))
    windows = np.lib.stride_tricks.sliding_window_view(padded, (3, 3), axis=(2, 3))
    np.testing.assert_allclose(y, windows.sum(axis=(-2, -1)) ** (1 / 3), rtol=1e-12)


@pytest.mark.parametrize("opset", [1, 2, 11, 18])
def test_lp_pool_old_opsets(opset):
    x = rand(1, 2, 6, 6)
    p = 2.0 if opset == 1 else 2
    (y,) = run(node_model("LpPool", {"X": x}, opset=opset, kernel_shape=[2, 2], strides=[2, 2], p=p), {"X": x})
    expected = np.sqrt((x.reshape(1, 2, 3, 2, 3, 2) ** 2).sum(axis=(3, 5)))
    np.testing.assert_allclose(y, expected, rtol=1e-5)


@pytest.mark.parametrize("storage_order", [0, 1])
@pytest.mark.parametrize(
    "attrs",
    [
        dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
        dict(kernel_shape=[2, 3], strides=[2, 2], ceil_mode=1, dilations=[2, 1]),
        dict(kernel_shape=[2, 2], strides=[2, 2]),
    ],
)
def test_max_pool_indices(storage_order, attrs):
    x = rand(2, 3, 7, 8)
    ours = assert_matches_reference("MaxPool", {"X": x}, n_outputs=2, storage_order=storage_order, **attrs)
    assert ours[1].dtype == np.int64


@pytest.mark.parametrize(
    "attrs", [dict(kernel_shape=[3], strides=[2]), dict(kernel_shape=[2, 2, 2], strides=[1, 2, 1])]
)
def test_max_pool_indices_1d_3d(attrs):
    assert_matches_reference("MaxPool", {"X": rand(*shape_for(attrs))}, n_outputs=2, **attrs)


def test_max_pool_indices_take_the_first_of_ties():
    x = np.ones((1, 1, 4, 4), np.float32)
    (_, indices) = run(node_model("MaxPool", {"X": x}, n_outputs=2, kernel_shape=[2, 2], strides=[2, 2]), {"X": x})
    np.testing.assert_array_equal(indices[0, 0], [[0, 2], [8, 10]])


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.float16, np.float64])
def test_max_pool_dtypes(dtype):
    x = (RNG.integers(0, 100, (1, 2, 6, 6)) - (50 if dtype == np.int8 else 0)).astype(dtype)
    (y,) = assert_matches_reference("MaxPool", {"X": x}, kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[2, 2])
    assert y.dtype == dtype


def test_average_pool_float16_accumulates_wide():
    x = (RNG.random((1, 1, 8, 8)) * 1000).astype(np.float16)
    (y,) = run(node_model("AveragePool", {"X": x}, kernel_shape=[8, 8]), {"X": x})
    assert y.dtype == np.float16
    np.testing.assert_allclose(y.reshape(()), x.astype(np.float64).mean(), rtol=1e-3)


@pytest.mark.parametrize("opset", [1, 7, 10, 11, 19])
def test_average_pool_old_opsets(opset):
    attrs = dict(kernel_shape=[3, 3], strides=[2, 2])
    if opset >= 7:  # opset 1 has no count_include_pad (onnx's reference then counts pads in, onnxruntime not)
        attrs.update(count_include_pad=1, pads=[1, 1, 1, 1])
    assert_matches_reference("AveragePool", {"X": rand(1, 2, 7, 7)}, opset=opset, rtol=1e-5, atol=1e-6, **attrs)


@pytest.mark.parametrize("opset", [1, 8, 10, 12])
def test_max_pool_old_opsets(opset):
    attrs = dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    assert_matches_reference("MaxPool", {"X": rand(1, 2, 7, 7)}, opset=opset, **attrs)


@pytest.mark.parametrize("op_type, reduce", [("GlobalAveragePool", np.mean), ("GlobalMaxPool", np.max)])
@pytest.mark.parametrize("shape", [(2, 3, 5), (2, 3, 4, 5), (1, 2, 3, 4, 2)])
def test_global_pools(op_type, reduce, shape):
    x = rand(*shape, dtype=np.float64)
    (y,) = run(node_model(op_type, {"X": x}), {"X": x})
    np.testing.assert_allclose(y, reduce(x, axis=tuple(range(2, len(shape))), keepdims=True), rtol=1e-12)


@pytest.mark.parametrize("opset, p", [(1, 3.0), (2, 3), (22, 1)])
def test_global_lp_pool(opset, p):
    x = rand(2, 3, 4, 5, dtype=np.float64)
    (y,) = run(node_model("GlobalLpPool", {"X": x}, opset=opset, p=p), {"X": x})
    np.testing.assert_allclose(y, (np.abs(x) ** p).sum(axis=(2, 3), keepdims=True) ** (1 / p), rtol=1e-12)


def test_max_unpool_inverts_max_pool_when_output_shape_is_the_inferred_one():
    """3x3 stride-2 pad-1 pooling of 7 x 7 infers 7 x 7 back: I indexes it."""
    attrs = dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    x = rand(2, 3, 7, 7)
    y, indices = run(node_model("MaxPool", {"X": x}, n_outputs=2, **attrs), {"X": x})
    inputs = {"X": y, "I": indices, "output_shape": np.array(x.shape, np.int64)}
    (unpooled,) = run(node_model("MaxUnpool", inputs, **attrs), inputs)
    expected = np.zeros(x.size, x.dtype)
    expected[indices.reshape(-1)] = x.reshape(-1)[indices.reshape(-1)]
    np.testing.assert_array_equal(unpooled, expected.reshape(x.shape))


def test_max_unpool_output_shape_pads_the_inferred_shape_at_the_end():
    """The spec: output_shape "will cause pads values to be auto generated". I indexes the inferred 4 x 4."""
    inputs = {"X": np.array([[[[5.0, 6.0], [7.0, 8.0]]]], np.float32),
              "I": np.array([[[[5, 7], [13, 15]]]], np.int64), "output_shape": np.array([1, 1, 5, 5], np.int64)}
    (unpooled,) = run(node_model("MaxUnpool", inputs, kernel_shape=[2, 2], strides=[2, 2]), inputs)
    expected = np.zeros((1, 1, 5, 5), np.float32)
    expected[0, 0, 1, 1], expected[0, 0, 1, 3], expected[0, 0, 3, 1], expected[0, 0, 3, 3] = 5, 6, 7, 8
    np.testing.assert_array_equal(unpooled, expected)


def test_max_unpool_inferred_shape():
    x = rand(2, 3, 6, 6)
    attrs = dict(kernel_shape=[2, 2], strides=[2, 2])
    y, indices = run(node_model("MaxPool", {"X": x}, n_outputs=2, **attrs), {"X": x})
    assert_matches_reference("MaxUnpool", {"X": y, "I": indices}, **attrs)


def max_roi_pool_numpy(x, rois, pooled, scale):
    """Fast R-CNN's RoI pooling, written from its definition."""
    out = np.zeros((len(rois), x.shape[1], *pooled), x.dtype)
    height, width = x.shape[2:]
    for r, (b, *corners) in enumerate(rois):
        x1, y1, x2, y2 = (int(math.floor(v * scale + 0.5)) for v in corners)  # corners here are >= 0
        roi_h, roi_w = max(y2 - y1 + 1, 1), max(x2 - x1 + 1, 1)
        for i in range(pooled[0]):
            h0 = min(max(math.floor(Fraction(i * roi_h, pooled[0])) + y1, 0), height)
            h1 = min(max(math.ceil(Fraction((i + 1) * roi_h, pooled[0])) + y1, 0), height)
            for j in range(pooled[1]):
                w0 = min(max(math.floor(Fraction(j * roi_w, pooled[1])) + x1, 0), width)
                w1 = min(max(math.ceil(Fraction((j + 1) * roi_w, pooled[1])) + x1, 0), width)
                if h1 > h0 and w1 > w0:
                    out[r, :, i, j] = x[int(b), :, h0:h1, w0:w1].max(axis=(1, 2))
    return out


def test_max_roi_pool():
    x = rand(2, 3, 10, 12)
    rois = np.array([[0, 1, 1, 8, 6], [1, 0, 2, 11, 9], [1, 20, 20, 30, 30], [0, 3.4, 2.6, 4, 3]], np.float32)
    (y,) = run(node_model("MaxRoiPool", {"X": x, "rois": rois}, pooled_shape=[3, 2], spatial_scale=0.9),
               {"X": x, "rois": rois})
    np.testing.assert_allclose(y, max_roi_pool_numpy(x, rois, (3, 2), 0.9), rtol=1e-6)


@pytest.mark.parametrize(
    "op_type, attrs",
    [
        ("MaxPool", dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
        ("MaxPool", dict(kernel_shape=[2, 2], strides=[2, 2])),
        ("MaxPool", dict(kernel_shape=[2, 3], strides=[2, 1], dilations=[2, 1], pads=[1, 0, 1, 1], ceil_mode=1)),
        ("AveragePool", dict(kernel_shape=[3, 2], strides=[2, 1], pads=[1, 0, 1, 1], ceil_mode=1)),
        ("AveragePool", dict(kernel_shape=[2, 2], strides=[2, 2], count_include_pad=1)),
    ],
)
def test_pool_gradient(op_type, attrs):
    assert_gradient_matches_reference(op_type, {"X": rand(2, 2, 6, 7, dtype=np.float64)}, "X", **attrs)


def test_max_pool_gradient_goes_to_the_first_of_ties():
    """Overlapping windows over a constant input: each window's gradient lands on its first element."""
    x = np.ones((1, 1, 5, 5))
    with jax.enable_x64(True):
        pool = lowering("MaxPool")
        grad = jax.grad(lambda v: pool(v, kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]).sum())(x)
    expected = np.zeros((5, 5))
    for top in (-1, 1, 3):
        for left in (-1, 1, 3):
            expected[max(top, 0), max(left, 0)] += 1
    np.testing.assert_array_equal(np.asarray(grad)[0, 0], expected)


@pytest.mark.parametrize("kernel", [[2], [2, 3], [2, 1, 2]])
def test_tiled_max_pool_gradient_goes_to_the_first_of_ties(kernel):
    """Non-overlapping windows (their own gradient code) over a constant input, 1-D to 3-D."""
    spatial = [k * 2 for k in kernel]
    x = np.ones((2, 3, *spatial))
    with jax.enable_x64(True):
        pool = lowering("MaxPool")
        grad = np.asarray(jax.grad(lambda v: pool(v, kernel_shape=kernel, strides=kernel).sum())(x))
    expected = np.zeros(spatial)
    expected[tuple(slice(0, None, k) for k in kernel)] = 1  # the first element of each tile
    np.testing.assert_array_equal(grad, np.broadcast_to(expected, x.shape))


@pytest.mark.parametrize("op_type", ["MaxPool", "AveragePool"])
def test_tiled_3d_pool_gradient(op_type):
    assert_gradient_matches_reference(op_type, {"X": rand(2, 3, 4, 5, 6, dtype=np.float64)}, "X",
                                      kernel_shape=[2, 1, 3], strides=[2, 1, 3])


def test_pool_errors_name_the_problem():
    x = rand(1, 1, 4, 4)
    with pytest.raises(NodeError, match="kernel_shape"):
        run(node_model("MaxPool", {"X": x}, kernel_shape=[2]), {"X": x})
    with pytest.raises(NodeError, match="does not fit"):
        run(node_model("AveragePool", {"X": x}, kernel_shape=[5, 5]), {"X": x})
