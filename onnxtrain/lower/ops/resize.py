"""Resampling: Resize (and the older Upsample), GridSample, AffineGrid.

Resize is separable: each resized axis is one gather per interpolation tap with weights, both computed in NumPy
at trace time from the static sizes/scales. GridSample samples at traced positions: every tap combination is
one gather (sampling.gather_taps, shared with DeformConv).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import jax.numpy as jnp
import numpy as np

from ...dtypes import is_float
from ..layout import CHANNELS_LAST, ChannelsLast, channels_first, channels_last
from ..registry import op, versions
from ..sampling import gather_taps
from ..values import static, static_ints

COORDINATE_MODES = (
    "half_pixel",
    "half_pixel_symmetric",
    "pytorch_half_pixel",
    "align_corners",
    "asymmetric",
    "tf_half_pixel_for_nn",
    "tf_crop_and_resize",
)
NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")
LEGACY_NEAREST = "legacy"  # Resize-10 / Upsample: truncate when upsampling, ceil when downsampling (as onnxruntime)
ASPECT_POLICIES = ("stretch", "not_larger", "not_smaller")


def source_coordinates(mode: str, out_size: int, in_size: int, scale: float, roi: tuple[float, float]) -> np.ndarray:
    """x_original for every output index of one axis (float64, as the spec's formulas)."""
    y = np.arange(out_size, dtype=np.float64)
    length = scale * in_size  # the resized length before flooring: the formulas use it, not out_size
    if mode == "half_pixel":
        return (y + 0.5) / scale - 0.5
    if mode == "half_pixel_symmetric":
        offset = in_size / 2 * (1 - out_size / length)
        return offset + (y + 0.5) / scale - 0.5
    if mode == "pytorch_half_pixel":
        return (y + 0.5) / scale - 0.5 if out_size > 1 else np.zeros_like(y)
    if mode == "align_corners":
        return y * (in_size - 1) / (length - 1) if length != 1 else np.zeros_like(y)
    if mode == "asymmetric":
        return y / scale
    if mode == "tf_half_pixel_for_nn":
        return (y + 0.5) / scale
    if mode == "tf_crop_and_resize":
        start, end = roi
        extent = (end - start) * (in_size - 1)
        x = y * extent / (length - 1) if length != 1 else np.full_like(y, extent / 2)
        return x + start * (in_size - 1)
    raise ValueError(f"coordinate_transformation_mode must be one of {', '.join(COORDINATE_MODES)}, got {mode!r}")


def nearest_index(x: np.ndarray, nearest_mode: str, scale: float) -> np.ndarray:
    if nearest_mode == "round_prefer_floor":
        return np.ceil(x - 0.5)
    if nearest_mode == "round_prefer_ceil":
        return np.floor(x + 0.5)
    if nearest_mode == "floor":
        return np.floor(x)
    if nearest_mode == "ceil":
        return np.ceil(x)
    if nearest_mode == LEGACY_NEAREST:
        return np.ceil(x) if scale < 1 else np.trunc(x)
    raise ValueError(f"nearest_mode must be one of {', '.join(NEAREST_MODES)}, got {nearest_mode!r}")


def linear_kernel(distance: np.ndarray) -> np.ndarray:
    return np.clip(1 - np.abs(distance), 0, 1)


def cubic_kernel(a: float) -> Callable[[np.ndarray], np.ndarray]:
    """Keys' cubic convolution kernel with coefficient `a`."""

    def kernel(distance: np.ndarray) -> np.ndarray:
        d = np.abs(distance)
        near = ((a + 2) * d - (a + 3)) * d * d + 1
        far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
        return np.where(d <= 1, near, np.where(d < 2, far, 0.0))

    return kernel


@dataclass(frozen=True)
class AxisPlan:
    """How one output axis reads its input axis: out[i] = sum_j weights[i, j] * in[indices[i, j]]."""

    indices: np.ndarray  # (out, taps), clamped into the input
    weights: np.ndarray | None  # (out, taps); None: a single tap of weight 1 (nearest)
    outside: np.ndarray | None  # (out,): tf_crop_and_resize positions that take extrapolation_value


def interpolation_plan(
    x: np.ndarray, in_size: int, scale: float, mode: str, cubic_coeff_a: float, antialias: bool, exclude_outside: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Taps around each source position: the kernel (stretched by 1/scale when antialiasing a downscale)
    evaluated at the distance to every input index it covers."""
    radius, kernel = (1, linear_kernel) if mode == "linear" else (2, cubic_kernel(cubic_coeff_a))
    stretch = min(scale, 1.0) if antialias else 1.0
    first = math.floor(-radius / stretch) + 1
    taps = 2 * (1 - first)
    indices = np.floor(x)[:, None].astype(np.int64) + first + np.arange(taps)[None, :]
    weights = kernel((indices - x[:, None]) * stretch)
    if antialias:
        weights = weights / weights.sum(axis=1, keepdims=True)
    if exclude_outside:
        weights = np.where((indices < 0) | (indices >= in_size), 0.0, weights)
        sums = weights.sum(axis=1, keepdims=True)
        weights = weights / np.where(sums == 0, 1.0, sums)
    return np.clip(indices, 0, in_size - 1), weights


def axis_plan(
    in_size: int, out_size: int, scale: float, roi: tuple[float, float], *, mode: str, coordinate_mode: str,
    nearest_mode: str, cubic_coeff_a: float, antialias: bool, exclude_outside: bool,
) -> AxisPlan:
    x = source_coordinates(coordinate_mode, out_size, in_size, scale, roi)
    outside = ((x < 0) | (x > in_size - 1)) if coordinate_mode == "tf_crop_and_resize" else None
    if mode == "nearest":
        index = np.clip(nearest_index(x, nearest_mode, scale), 0, in_size - 1).astype(np.int64)
        return AxisPlan(index[:, None], None, outside)
    if mode not in ("linear", "cubic"):
        raise ValueError(f"mode must be nearest, linear or cubic, got {mode!r}")
    indices, weights = interpolation_plan(x, in_size, scale, mode, cubic_coeff_a, antialias, exclude_outside)
    return AxisPlan(indices, weights, outside)


def take_axis(x, indices: np.ndarray, axis: int):
    """x's entries `indices` along `axis`; a plain nearest upsample by an integer factor is a repeat."""
    size = x.shape[axis]
    if np.array_equal(indices, np.arange(size)):
        return x
    factor = len(indices) // size if size else 0
    if factor > 1 and len(indices) == factor * size and np.array_equal(indices, np.repeat(np.arange(size), factor)):
        return jnp.repeat(x, factor, axis=axis)
    return jnp.take(x, jnp.asarray(indices), axis=axis)


def apply_plan(x, axis: int, plan: AxisPlan, extrapolation_value: float):
    if plan.weights is None:
        y = take_axis(x, plan.indices[:, 0], axis)
    else:
        shape = [1] * x.ndim
        shape[axis] = -1
        y = None
        for j in range(plan.indices.shape[1]):
            w = plan.weights[:, j]
            if not w.any():  # e.g. the far taps of positions that fall exactly on an input index
                continue
            term = take_axis(x, plan.indices[:, j], axis) * jnp.asarray(w.reshape(shape), x.dtype)
            y = term if y is None else y + term
        if y is None:
            y = jnp.zeros((*x.shape[:axis], len(plan.indices), *x.shape[axis + 1:]), x.dtype)
    if plan.outside is not None and plan.outside.any():
        shape = [1] * x.ndim
        shape[axis] = -1
        y = jnp.where(jnp.asarray(plan.outside.reshape(shape)), jnp.asarray(extrapolation_value, y.dtype), y)
    return y


def compute_dtype(dtype, mode: str):
    """Interpolation runs in floating point: integers in float64 (exact for 32-bit ones), halves in float32."""
    if mode == "nearest":
        return dtype
    if is_float(dtype):
        return jnp.float32 if jnp.dtype(dtype).itemsize < 4 else dtype
    return jnp.float64


def saturate(y, dtype):
    """Back to X's dtype: integers round half to even and clip to their range."""
    if y.dtype == dtype:
        return y
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        return jnp.clip(jnp.round(y), info.min, info.max).astype(dtype)
    return y.astype(dtype)


def present(v) -> bool:
    """Resize-11 passes empty roi/scales to mean 'not given'."""
    return v is not None and math.prod(np.shape(v)) > 0


def resize_core(
    X, roi, scales, sizes, *, antialias=0, axes=None, coordinate_transformation_mode="half_pixel",
    cubic_coeff_a=-0.75, exclude_outside=0, extrapolation_value=0.0, keep_aspect_ratio_policy="stretch",
    mode="nearest", nearest_mode="round_prefer_floor",
):
    rank = X.ndim
    axes = [a + rank if a < 0 else a for a in (axes if axes else range(rank))]
    if present(scales) == present(sizes):
        raise ValueError("exactly one of 'scales' and 'sizes' must be given")
    if keep_aspect_ratio_policy not in ASPECT_POLICIES:
        raise ValueError(f"keep_aspect_ratio_policy must be one of {', '.join(ASPECT_POLICIES)}")
    in_sizes = [X.shape[a] for a in axes]
    if present(scales):
        factors = [float(s) for s in static(scales, "scales").reshape(-1)]
        if len(factors) != len(axes):
            raise ValueError(f"scales has {len(factors)} entries for {len(axes)} axes")
        if any(f <= 0 for f in factors):
            raise ValueError(f"scales must be positive, got {factors}")
        out_sizes = [int(math.floor(f * n)) for f, n in zip(factors, in_sizes)]
    else:
        out_sizes = static_ints(sizes, "sizes")
        if len(out_sizes) != len(axes):
            raise ValueError(f"sizes has {len(out_sizes)} entries for {len(axes)} axes")
        factors = [o / n for o, n in zip(out_sizes, in_sizes)]
        if keep_aspect_ratio_policy != "stretch":
            common = min(factors) if keep_aspect_ratio_policy == "not_larger" else max(factors)
            factors = [common] * len(axes)
            out_sizes = [int(common * n + 0.5) for n in in_sizes]
    rois = [(0.0, 1.0)] * len(axes)
    if coordinate_transformation_mode == "tf_crop_and_resize":
        if not present(roi):
            raise ValueError("coordinate_transformation_mode tf_crop_and_resize needs the 'roi' input")
        box = [float(v) for v in static(roi, "roi").reshape(-1)]
        if len(box) != 2 * len(axes):
            raise ValueError(f"roi has {len(box)} entries, expected {2 * len(axes)}")
        rois = list(zip(box[: len(axes)], box[len(axes):]))
    plans = {
        axis: axis_plan(
            n, out, scale, box, mode=mode, coordinate_mode=coordinate_transformation_mode, nearest_mode=nearest_mode,
            cubic_coeff_a=cubic_coeff_a, antialias=bool(antialias), exclude_outside=bool(exclude_outside),
        )
        for axis, n, out, scale, box in zip(axes, in_sizes, out_sizes, factors, rois)
        if out != n or scale != 1 or box != (0.0, 1.0)  # every mode maps such an axis onto itself
    }
    # an image's spatial axes: resample channels-last, like the convolutions around it (lower/layout.py)
    spatial_only = rank >= 3 and bool(plans) and all(axis >= 2 for axis in plans)
    y = (channels_last(X) if spatial_only else channels_first(X)).astype(compute_dtype(X.dtype, mode))
    for axis, plan in plans.items():
        y = apply_plan(y, axis - 1 if spatial_only else axis, plan, extrapolation_value)
    y = saturate(y, X.dtype)
    return ChannelsLast(y) if spatial_only else y


@op("Resize", *versions("Resize", since=11), layout=CHANNELS_LAST)
def resize(
    X, roi=None, scales=None, sizes=None, *, antialias=0, axes=None, coordinate_transformation_mode="half_pixel",
    cubic_coeff_a=-0.75, exclude_outside=0, extrapolation_value=0.0, keep_aspect_ratio_policy="stretch",
    mode="nearest", nearest_mode="round_prefer_floor",
):
    if nearest_mode not in NEAREST_MODES:
        raise ValueError(f"nearest_mode must be one of {', '.join(NEAREST_MODES)}, got {nearest_mode!r}")
    return resize_core(
        X, roi, scales, sizes, antialias=antialias, axes=axes,
        coordinate_transformation_mode=coordinate_transformation_mode, cubic_coeff_a=cubic_coeff_a,
        exclude_outside=exclude_outside, extrapolation_value=extrapolation_value,
        keep_aspect_ratio_policy=keep_aspect_ratio_policy, mode=mode, nearest_mode=nearest_mode,
    )


def legacy_resize(X, scales, mode: str):
    """Resize-10 and Upsample: asymmetric coordinates and onnxruntime's legacy nearest rounding."""
    mode = "linear" if mode == "bilinear" else mode
    if mode not in ("nearest", "linear"):
        raise ValueError(f"mode must be nearest or linear, got {mode!r}")
    return resize_core(X, None, scales, None, coordinate_transformation_mode="asymmetric", mode=mode,
                       nearest_mode=LEGACY_NEAREST)


@op("Resize", 10, layout=CHANNELS_LAST)
@op("Upsample", *versions("Upsample", since=9), layout=CHANNELS_LAST)
def resize_v10(X, scales, *, mode="nearest"):
    return legacy_resize(X, scales, mode)


@op("Upsample", 7, layout=CHANNELS_LAST)
def upsample_v7(X, *, mode="nearest", scales):
    return legacy_resize(X, np.asarray(scales, np.float32), mode)


@op("Upsample", 1, layout=CHANNELS_LAST)
def upsample_v1(X, *, mode="nearest", height_scale, width_scale):
    if X.ndim != 4:
        raise ValueError(f"Upsample-1 takes a 4-D input, got shape {X.shape}")
    return legacy_resize(X, np.array([1, 1, height_scale, width_scale], np.float32), mode)


def reflect(x, low: float, high: float):
    """Fold coordinates back into [low, high] by mirroring at the borders, as often as needed."""
    extent = high - low
    if extent <= 0:
        return jnp.full_like(x, low)
    below = x < low
    distance = jnp.where(below, low - x, x - high)
    folds = jnp.floor(distance / extent)
    rest = distance - folds * extent
    even = jnp.mod(folds, 2) == 0
    from_low = jnp.where(even, low + rest, high - rest)
    from_high = jnp.where(even, high - rest, low + rest)
    return jnp.where(below, from_low, jnp.where(x > high, from_high, x))


def grid_taps(coords, size: int, mode: str, padding_mode: str, align_corners: bool):
    """GridSample's taps on one axis for normalized coordinates: [(index, weight, inside)]."""
    x = (coords + 1) / 2 * (size - 1) if align_corners else ((coords + 1) * size - 1) / 2
    low, high = (0.0, size - 1.0) if align_corners else (-0.5, size - 0.5)
    if mode == "nearest":
        x = jnp.round(x)  # half to even, as PyTorch
    if padding_mode == "border":
        x = jnp.where((x < low) | (x > high), jnp.clip(x, 0, size - 1), x)
    elif padding_mode == "reflection":
        x = reflect(x, low, high)

    def tap(position, weight):
        if padding_mode == "zeros":
            index = position.astype(jnp.int32)
            return index, weight, (position >= 0) & (position < size)
        if padding_mode == "reflection":
            position = reflect(position, low, high)
        return position.astype(jnp.int32), weight, None  # border: the gather clamps

    if mode == "nearest":
        return [tap(x, None)]
    base = jnp.floor(x)
    t = x - base
    if mode == "linear":
        return [tap(base, 1 - t), tap(base + 1, t)]
    kernel_at = cubic_weights(t)
    return [tap(base + k, w) for k, w in zip((-1, 0, 1, 2), kernel_at)]


def cubic_weights(t, a: float = -0.75):
    """Keys' weights of the four taps at -1, 0, 1, 2 for fractional offsets t (traced)."""

    def near(d):
        return ((a + 2) * d - (a + 3)) * d * d + 1

    def far(d):
        return ((a * d - 5 * a) * d + 8 * a) * d - 4 * a

    return far(t + 1), near(t), near(1 - t), far(2 - t)


GRID_MODES = ("linear", "nearest", "cubic")
PADDING_MODES = ("zeros", "border", "reflection")


def grid_sample_core(X, grid, align_corners: int, mode: str, padding_mode: str):
    if mode not in GRID_MODES:
        raise ValueError(f"mode must be one of {', '.join(GRID_MODES)}, got {mode!r}")
    if padding_mode not in PADDING_MODES:
        raise ValueError(f"padding_mode must be one of {', '.join(PADDING_MODES)}, got {padding_mode!r}")
    rank = X.ndim - 2
    if grid.ndim != X.ndim or grid.shape[-1] != rank or grid.shape[0] != X.shape[0]:
        raise ValueError(f"grid must have shape (N, *out, {rank}) for X {X.shape}, got {grid.shape}")
    n, c = X.shape[:2]
    out = grid.shape[1:-1]
    points = jnp.reshape(grid, (n, -1, rank))
    # grid's last axis lists x (the innermost axis) first
    taps = [
        grid_taps(points[..., rank - 1 - a], X.shape[2 + a], mode, padding_mode, bool(align_corners))
        for a in range(rank)
    ]
    value_dtype = X.dtype if mode == "nearest" else compute_dtype(jnp.result_type(X.dtype, grid.dtype), mode)
    y = gather_taps(jnp.reshape(X, (n, c, -1)).astype(value_dtype), taps, X.shape[2:])
    return saturate(jnp.reshape(y, (n, c, *out)), X.dtype)


@op("GridSample", *versions("GridSample", since=20))
def grid_sample(X, grid, *, align_corners=0, mode="linear", padding_mode="zeros"):
    return grid_sample_core(X, grid, align_corners, mode, padding_mode)


@op("GridSample", 16)
def grid_sample_v16(X, grid, *, align_corners=0, mode="bilinear", padding_mode="zeros"):
    """Opset 16 named the modes bilinear/bicubic and took 4-D inputs only."""
    if X.ndim != 4:
        raise ValueError(f"GridSample-16 takes a 4-D input, got shape {X.shape}")
    renamed = {"bilinear": "linear", "bicubic": "cubic", "nearest": "nearest"}
    if mode not in renamed:
        raise ValueError(f"mode must be bilinear, nearest or bicubic, got {mode!r}")
    return grid_sample_core(X, grid, align_corners, renamed[mode], padding_mode)


def normalized_positions(size: int, align_corners: bool) -> np.ndarray:
    """Pixel centres in [-1, 1]: the corner pixels' centres are +-1 with align_corners, else their edges."""
    if align_corners:
        return np.linspace(-1.0, 1.0, size) if size > 1 else np.array([-1.0])
    return (2 * np.arange(size) + 1) / size - 1


@op("AffineGrid", *versions("AffineGrid"))
def affine_grid(theta, size, *, align_corners=0):
    dims = static_ints(size, "size")
    spatial = dims[2:]
    rank = len(spatial)
    if rank not in (2, 3) or theta.shape[1:] != (rank, rank + 1):
        raise ValueError(f"theta must be (N, {rank}, {rank + 1}) for size {dims}, got {theta.shape}")
    axes = [normalized_positions(s, bool(align_corners)) for s in spatial]
    mesh = np.meshgrid(*axes, indexing="ij")
    # homogeneous coordinates (x, y[, z], 1): x walks the innermost axis
    base = np.stack([*reversed(mesh), np.ones(spatial)], axis=-1).astype(theta.dtype)
    # rank + 1 multiply-adds rather than a matmul: GPUs would round a float32 matmul to TF32
    theta = jnp.reshape(theta, (theta.shape[0], *[1] * rank, rank, rank + 1))
    return sum(base[..., None, k] * theta[..., k] for k in range(rank + 1))
