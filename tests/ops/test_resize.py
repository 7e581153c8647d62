"""Resize/Upsample, GridSample, AffineGrid, RoiAlign against onnx's reference, or NumPy written here where the
reference does not cover a version or mode."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import pytest
from onnx import helper

import onnxtrain
from nodes import assert_matches_reference, node_model
from test_conv import assert_gradient_matches_reference, lowering
from nodes import run_outputs as run

# sizes, scales and rois fed as graph inputs are compiled in as constants, with a warning: expected here
pytestmark = pytest.mark.filterwarnings("ignore:.*compiled in as constants")

RNG = np.random.default_rng(2)


def rand(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def resize_model(inputs: dict[str, np.ndarray | None], opset: int | None = None, op_type: str = "Resize", **attrs):
    """A Resize node whose absent optional inputs (None) are empty names."""
    names = [name if value is not None else "" for name, value in inputs.items()]
    node = helper.make_node(op_type, names, ["Y"], **attrs)
    given = {n: v for n, v in inputs.items() if v is not None}
    graph = helper.make_graph(
        [node], "resize",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape) for n, v in given.items()],
        [helper.make_empty_tensor_value_info("Y")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset or onnx.defs.onnx_opset_version())])


def scales(*values):
    return np.array(values, np.float32)


def sizes(*values):
    return np.array(values, np.int64)


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
@pytest.mark.parametrize(
    "coordinate_mode",
    ["half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric"],
)
@pytest.mark.parametrize("how", ["up_scales", "down_sizes"])
def test_resize_modes(mode, coordinate_mode, how):
    x = rand(1, 2, 4, 5)
    target = {"up_scales": {"scales": scales(1, 1, 1.7, 2.5)}, "down_sizes": {"sizes": sizes(1, 2, 3, 2)}}[how]
    inputs = {"X": x, "roi": np.zeros(0, np.float32), **target}
    assert_matches_reference(
        "Resize", inputs, rtol=1e-4, atol=1e-5, mode=mode, coordinate_transformation_mode=coordinate_mode
    )


@pytest.mark.parametrize("nearest_mode", ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"])
def test_resize_nearest_modes(nearest_mode):
    inputs = {"X": rand(1, 1, 5, 7), "roi": np.zeros(0, np.float32), "scales": scales(1, 1, 2.3, 0.6)}
    assert_matches_reference("Resize", inputs, mode="nearest", nearest_mode=nearest_mode)


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
def test_resize_tf_crop_and_resize(mode):
    inputs = {
        "X": rand(1, 1, 5, 6), "roi": np.array([0, 0, 0.2, -0.1, 1, 1, 0.9, 1.2], np.float32),
        "scales": np.zeros(0, np.float32), "sizes": sizes(1, 1, 4, 5),
    }
    assert_matches_reference(
        "Resize", inputs, rtol=1e-4, atol=1e-5, mode=mode, coordinate_transformation_mode="tf_crop_and_resize",
        extrapolation_value=-3.0,
    )


@pytest.mark.parametrize("mode", ["linear", "cubic"])
@pytest.mark.parametrize("target", [{"scales": scales(1, 1, 0.4, 0.7)}, {"sizes": sizes(1, 1, 3, 9)}])
def test_resize_antialias(mode, target):
    inputs = {"X": rand(1, 2, 9, 11), "roi": np.zeros(0, np.float32), **target}
    if "sizes" in target:
        inputs = {"X": inputs["X"], "roi": inputs["roi"], "scales": np.zeros(0, np.float32), **target}
    assert_matches_reference("Resize", inputs, rtol=1e-4, atol=1e-5, mode=mode, antialias=1)


def test_resize_cubic_exclude_outside_and_coefficient():
    inputs = {"X": rand(1, 1, 4, 6), "roi": np.zeros(0, np.float32), "scales": scales(1, 1, 1.5, 0.5)}
    assert_matches_reference(
        "Resize", inputs, rtol=1e-4, atol=1e-5, mode="cubic", cubic_coeff_a=-0.5, exclude_outside=1
    )


@pytest.mark.parametrize("policy", ["not_larger", "not_smaller"])
@pytest.mark.parametrize("axes", [[2, 3], [-1, -2]])
def test_resize_keep_aspect_ratio_with_axes(policy, axes):
    x = rand(1, 2, 4, 6)
    inputs = {"X": x, "roi": np.zeros(0, np.float32), "scales": np.zeros(0, np.float32), "sizes": sizes(7, 5)}
    (y,) = assert_matches_reference(
        "Resize", inputs, rtol=1e-4, atol=1e-5, mode="linear", keep_aspect_ratio_policy=policy,
        axes=[a % 4 for a in axes],
    )
    model = node_model("Resize", inputs, mode="linear", keep_aspect_ratio_policy=policy, axes=axes)
    np.testing.assert_allclose(run(model, inputs)[0], y, rtol=1e-6)


def test_resize_integers_round_and_saturate():
    x = np.array([[[[0, 255, 3, 250], [255, 0, 128, 9]]]], np.uint8)
    inputs = {"X": x, "roi": np.zeros(0, np.float32), "scales": scales(1, 1, 2, 1.5)}
    (y,) = assert_matches_reference("Resize", inputs, mode="cubic")
    assert y.dtype == np.uint8
    nearest = {**inputs, "X": x.astype(np.int64) * 1000000007}
    (y,) = assert_matches_reference("Resize", nearest, mode="nearest", rtol=0, atol=0)
    assert y.dtype == np.int64


def test_resize_float64_stays_exact():
    """(linear: onnx's reference evaluates cubic weights in float32, through the float32 attribute cubic_coeff_a)"""
    inputs = {"X": rand(1, 1, 5, 5, dtype=np.float64), "roi": np.zeros(0, np.float32), "scales": scales(1, 1, 1.3, 3)}
    (y,) = assert_matches_reference("Resize", inputs, rtol=1e-12, atol=1e-12, mode="linear")
    assert y.dtype == np.float64


def test_resize_opset13_optional_inputs_left_out():
    x = rand(1, 1, 3, 4)
    model = resize_model({"X": x, "roi": None, "scales": None, "sizes": sizes(1, 1, 6, 2)}, opset=13, mode="linear")
    (y,) = run(model, {"X": x, "sizes": sizes(1, 1, 6, 2)})
    full = {"X": x, "roi": np.zeros(0, np.float32), "scales": np.zeros(0, np.float32), "sizes": sizes(1, 1, 6, 2)}
    (expected,) = assert_matches_reference("Resize", full, mode="linear")
    np.testing.assert_allclose(y, expected, rtol=1e-6)


def test_resize_opset11_tf_half_pixel_for_nn():
    x = rand(1, 1, 4, 6)
    inputs = {"X": x, "roi": np.zeros(0, np.float32), "scales": scales(1, 1, 0.5, 1.5)}
    model = resize_model(inputs, opset=11, mode="nearest", coordinate_transformation_mode="tf_half_pixel_for_nn")
    (y,) = run(model, inputs)
    rows = np.minimum(np.ceil((np.arange(2) + 0.5) / 0.5 - 0.5), 3).astype(int)  # round_prefer_floor
    cols = np.minimum(np.ceil((np.arange(9) + 0.5) / 1.5 - 0.5), 5).astype(int)
    np.testing.assert_array_equal(y, x[:, :, rows][:, :, :, cols])


@pytest.mark.parametrize("op_type, opset", [("Resize", 10), ("Upsample", 9), ("Upsample", 10)])
def test_legacy_nearest_truncates_up_and_ceils_down(op_type, opset):
    x = rand(1, 1, 5, 4)
    inputs = {"X": x, "scales": scales(1, 1, 0.6, 1.5)}
    (y,) = run(resize_model(inputs, opset=opset, op_type=op_type), inputs)
    rows = np.minimum(np.ceil(np.arange(3) / 0.6), 4).astype(int)
    cols = np.floor(np.arange(6) / 1.5).astype(int)
    np.testing.assert_array_equal(y, x[:, :, rows][:, :, :, cols])


def linear_asymmetric(x: np.ndarray, axis: int, factor: float) -> np.ndarray:
    """Linear interpolation at y / factor, clamped at the end (the pre-11 Resize and Upsample coordinates)."""
    n = x.shape[axis]
    pos = np.arange(int(np.floor(n * factor))) / np.float32(factor)
    low = np.minimum(np.floor(pos).astype(int), n - 1)
    high = np.minimum(low + 1, n - 1)
    t = (pos - low).reshape([-1 if a == axis else 1 for a in range(x.ndim)])
    return np.take(x, low, axis) * (1 - t) + np.take(x, high, axis) * t


@pytest.mark.parametrize(
    "op_type, opset, attrs, inputs",
    [
        ("Upsample", 7, dict(mode="linear", scales=[1.0, 1.0, 2.0, 1.5]), {}),
        ("Upsample", 9, dict(mode="linear"), {"scales": scales(1, 1, 2, 1.5)}),
        ("Resize", 10, dict(mode="linear"), {"scales": scales(1, 1, 2, 1.5)}),
        ("Upsample", 1, dict(mode="bilinear", height_scale=2.0, width_scale=1.5), {}),
    ],
)
def test_legacy_linear(op_type, opset, attrs, inputs):
    x = rand(1, 2, 3, 4)
    feeds = {"X": x, **inputs}
    (y,) = run(resize_model(feeds, opset=opset, op_type=op_type, **attrs), feeds)
    np.testing.assert_allclose(y, linear_asymmetric(linear_asymmetric(x, 2, 2.0), 3, 1.5), rtol=1e-5, atol=1e-6)


def test_resize_gradient():
    inputs = {"X": rand(1, 2, 4, 5, dtype=np.float64), "roi": np.zeros(0, np.float32), "scales": scales(1, 1, 1.5, 0.6)}
    assert_gradient_matches_reference("Resize", inputs, "X", mode="linear", antialias=1)


def test_resize_errors_name_the_problem():
    inputs = {
        "X": rand(1, 1, 2, 2), "roi": np.zeros(0, np.float32), "scales": scales(1, 1, 2, 2), "sizes": sizes(1, 1, 4, 4)
    }
    with pytest.raises(onnxtrain.errors.NodeError, match="exactly one of 'scales' and 'sizes'"):
        run(node_model("Resize", inputs), inputs)
    inputs = {"X": rand(1, 1, 2, 2), "roi": np.zeros(0, np.float32), "scales": scales(2, 2)}
    with pytest.raises(onnxtrain.errors.NodeError, match="scales has 2 entries"):
        run(node_model("Resize", inputs), inputs)


@pytest.mark.parametrize("mode", ["linear", "nearest", "cubic"])
@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align_corners", [0, 1])
def test_grid_sample_2d(mode, padding_mode, align_corners):
    inputs = {"X": rand(1, 2, 4, 5), "grid": RNG.uniform(-1.3, 1.3, (1, 3, 3, 2)).astype(np.float32)}
    assert_matches_reference(
        "GridSample", inputs, rtol=1e-4, atol=1e-5, mode=mode, padding_mode=padding_mode,
        align_corners=align_corners,
    )


@pytest.mark.parametrize("mode", ["linear", "nearest"])
@pytest.mark.parametrize("padding_mode", ["zeros", "reflection"])
def test_grid_sample_3d(mode, padding_mode):
    inputs = {"X": rand(1, 2, 3, 4, 5), "grid": RNG.uniform(-1.2, 1.2, (1, 2, 3, 2, 3)).astype(np.float32)}
    assert_matches_reference("GridSample", inputs, rtol=1e-4, atol=1e-5, mode=mode, padding_mode=padding_mode)


@pytest.mark.parametrize("old, new", [("bilinear", "linear"), ("bicubic", "cubic"), ("nearest", "nearest")])
def test_grid_sample_opset16_mode_names(old, new):
    inputs = {"X": rand(1, 2, 4, 5), "grid": RNG.uniform(-1.1, 1.1, (1, 3, 3, 2)).astype(np.float32)}
    (y16,) = run(node_model("GridSample", inputs, opset=16, mode=old, padding_mode="border"), inputs)
    (y,) = assert_matches_reference("GridSample", inputs, rtol=1e-4, atol=1e-5, mode=new, padding_mode="border")
    np.testing.assert_allclose(y16, y, rtol=1e-6)


def test_grid_sample_integers_nearest_exact_and_float64():
    """Eighths keep onnx's reference (which denormalizes in float32) exact."""
    x = RNG.integers(-(2**40), 2**40, (1, 1, 4, 4))
    grid = RNG.integers(-9, 10, (1, 3, 3, 2)) / 8
    (y,) = assert_matches_reference("GridSample", {"X": x, "grid": grid}, rtol=0, atol=0, mode="nearest")
    assert y.dtype == np.int64
    (y,) = assert_matches_reference("GridSample", {"X": x.astype(np.float64), "grid": grid}, rtol=1e-12)
    assert y.dtype == np.float64


def test_grid_sample_gradient_wrt_x():
    """(rtol 1e-5: onnx's reference weighs in float32)"""
    rng = np.random.default_rng(3)
    inputs = {"X": rng.standard_normal((1, 2, 4, 5)), "grid": rng.uniform(-1.1, 1.1, (1, 3, 2, 2))}
    assert_gradient_matches_reference("GridSample", inputs, "X", mode="cubic", padding_mode="reflection", rtol=1e-5)


@pytest.mark.parametrize("mode", ["linear", "cubic"])
@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
def test_grid_sample_gradient_wrt_grid(mode, padding_mode):
    """onnx's reference denormalizes the grid in float32, too coarse for differences: differentiate our own
    forward (checked against the reference above) in float64 instead."""
    x, grid = rand(1, 2, 4, 5, dtype=np.float64), RNG.uniform(-1.1, 1.1, (1, 3, 2, 2))
    out_weights = RNG.standard_normal((1, 2, 3, 2))
    fn = lowering("GridSample")

    def loss(g):
        return jnp.sum(fn(x, g, mode=mode, padding_mode=padding_mode) * out_weights)

    with jax.enable_x64(True):
        grad = np.asarray(jax.jit(jax.grad(loss))(grid))
        direction = RNG.standard_normal(grid.shape)
        numeric = (loss(grid + 1e-6 * direction) - loss(grid - 1e-6 * direction)) / 2e-6
    np.testing.assert_allclose((grad * direction).sum(), numeric, rtol=1e-6)


@pytest.mark.parametrize("size", [[2, 3, 4, 5], [1, 2, 3, 4, 2], [1, 1, 1, 3]])
@pytest.mark.parametrize("align_corners", [0, 1])
def test_affine_grid(size, align_corners):
    rank = len(size) - 2
    theta = rand(size[0], rank, rank + 1)
    assert_matches_reference(
        "AffineGrid", {"theta": theta, "size": np.array(size, np.int64)}, rtol=1e-5, atol=1e-6,
        align_corners=align_corners,
    )


def test_affine_grid_keeps_float64():
    theta = rand(1, 2, 3, dtype=np.float64)
    model = node_model("AffineGrid", {"theta": theta, "size": np.array([1, 1, 3, 2], np.int64)}, align_corners=1)
    (y,) = run(model, {"theta": theta, "size": np.array([1, 1, 3, 2], np.int64)})
    assert y.dtype == np.float64
    xs, ys = np.meshgrid([-1.0, 1.0], [-1.0, 0.0, 1.0])
    base = np.stack([xs, ys, np.ones_like(xs)], -1)
    np.testing.assert_allclose(y[0], base @ theta[0].T, rtol=1e-14)


ROIS = np.array([[0.5, 1.0, 6.2, 4.8], [2.0, 0.0, 3.0, 1.0], [-3.0, -2.0, 9.5, 8.0], [4.0, 4.0, 3.5, 3.0]], np.float32)


@pytest.mark.parametrize("mode", ["avg", "max"])
@pytest.mark.parametrize("coordinate_mode", ["half_pixel", "output_half_pixel"])
@pytest.mark.parametrize("sampling_ratio", [0, 2])
def test_roi_align(mode, coordinate_mode, sampling_ratio):
    inputs = {"X": rand(2, 3, 6, 7), "rois": ROIS, "batch_indices": np.array([0, 1, 1, 0], np.int64)}
    assert_matches_reference(
        "RoiAlign", inputs, rtol=1e-4, atol=1e-5, mode=mode, coordinate_transformation_mode=coordinate_mode,
        sampling_ratio=sampling_ratio, output_height=3, output_width=2, spatial_scale=0.8,
    )


def test_roi_align_opset10_is_output_half_pixel():
    inputs = {"X": rand(2, 3, 6, 7), "rois": ROIS, "batch_indices": np.array([1, 0, 1, 0], np.int64)}
    attrs = dict(output_height=2, output_width=3, sampling_ratio=2)
    (y10,) = run(node_model("RoiAlign", inputs, opset=10, **attrs), inputs)
    (y,) = assert_matches_reference(
        "RoiAlign", inputs, rtol=1e-4, atol=1e-5, coordinate_transformation_mode="output_half_pixel", **attrs
    )
    np.testing.assert_allclose(y10, y, rtol=1e-6)
