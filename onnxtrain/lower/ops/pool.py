"""Pooling: MaxPool (with Indices), AveragePool, LpPool, their Global forms, MaxUnpool, and the region-of-interest
pools MaxRoiPool and RoiAlign.

Window geometry (auto_pad, ceil_mode, dilations) comes from window.sliding_window. Everything runs channels-last,
like the convolutions, so the transposes between a convolution and a pool cancel. Non-overlapping windows without
padding (stride == kernel) reduce through a reshape; the others use reduce_window, and overlapping max pooling
has its own gradient (sliding_max) because XLA's select-and-scatter is slow on CPU.
"""

from __future__ import annotations

import functools
import itertools
import math
from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ...dtypes import is_float
from ..layout import CHANNELS_LAST, ChannelsLast, channels_first, channels_last
from ..registry import op, versions
from ..values import static, static_ints
from ..window import Window, explicit_pads, sliding_window, spatial_param, window_views


def pool_window(x, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode) -> Window:
    if x.ndim < 3:
        raise ValueError(f"X must have a batch, a channel and at least one spatial axis, got shape {x.shape}")
    if kernel_shape is None or len(kernel_shape) != x.ndim - 2:
        raise ValueError(f"kernel_shape {kernel_shape} must have one entry per spatial axis of X {x.shape}")
    return sliding_window(x.shape[2:], kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)


def lowest(dtype) -> np.generic:
    dtype = np.dtype(dtype)
    if is_float(dtype):
        return np.array(-np.inf, dtype)
    return np.array(jnp.iinfo(dtype).min, dtype)


def reduce_windows(x, window: Window, kind: str):
    """Max or sum of every window of x (a ChannelsLast, or channels-last data (N, *spatial, C)), as
    channels-last data; padding contributes the reduction's identity."""
    if window.is_tiling and isinstance(x, ChannelsLast) and x.at is not None:
        # each window member computed by the producer at its own positions (see layout.ChannelsLast.at)
        offsets = itertools.product(*[range(k) for k in window.kernel])
        return combine_members([x.at((offset, window.kernel, window.out)) for offset in offsets], kind)
    x = x.data if isinstance(x, ChannelsLast) else x
    if window.is_tiling:
        x = x[(slice(None), *[slice(0, o * k) for o, k in zip(window.out, window.kernel)])]
        tiles = [d for o, k in zip(window.out, window.kernel) for d in (o, k)]
        return reduce_tiles(jnp.reshape(x, (x.shape[0], *tiles, x.shape[-1])), kind)
    if kind == "max":
        return sliding_max(x, window)
    return window_reduce(x, window, np.array(0, x.dtype), lax.add)


def _tile_axes(tiled) -> tuple[int, ...]:
    """The within-tile axes of (N, out1, k1, out2, k2, ..., C)."""
    return tuple(range(2, tiled.ndim - 1, 2))


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def reduce_tiles(tiled, kind: str):
    """Max or sum over the within-tile axes of (N, out1, k1, ..., C). Computed elementwise over each tile's
    members, not as a reduction: XLA-CPU fused a reduction with the convolution feeding it into one slow kernel.
    Its gradient is written out (autodiff's, of either form, was a fifth of a small CNN's train step): a sum's
    goes to every member, a maximum's to the tile's first maximum, as sliding_max's does and as ONNX Runtime and
    PyTorch do."""
    combine = jnp.maximum if kind == "max" else jnp.add
    for axis in reversed(_tile_axes(tiled)):
        members = [lax.index_in_dim(tiled, i, axis, keepdims=False) for i in range(tiled.shape[axis])]
        tiled = functools.reduce(combine, members)
    return tiled


def _reduce_tiles_forward(tiled, kind: str):
    reduced = reduce_tiles(tiled, kind)
    return reduced, (tiled, reduced)


def _reduce_tiles_backward(kind: str, residuals, grad):
    tiled, reduced = residuals
    axes = _tile_axes(tiled)
    if kind != "max":
        return (jnp.broadcast_to(jnp.expand_dims(grad, axes), tiled.shape),)
    members = []
    for member in itertools.product(*[range(tiled.shape[a]) for a in axes]):
        value = tiled
        for axis, i in zip(reversed(axes), reversed(member)):
            value = lax.index_in_dim(value, i, axis, keepdims=False)
        members.append(value)
    shares = first_maximum_shares(members, reduced, grad)
    # shares: one (N, out1, out2, ..., C) per member in row-major member order; interleave them back into tiles
    kernel = [tiled.shape[a] for a in axes]
    stacked = jnp.reshape(jnp.stack(shares), (*kernel, *reduced.shape))
    rank = len(kernel)
    order = [rank] + [i for k in range(rank) for i in (rank + 1 + k, k)] + [2 * rank + 1]
    return (jnp.transpose(stacked, order),)


reduce_tiles.defvjp(_reduce_tiles_forward, _reduce_tiles_backward)


def first_maximum_shares(members: list, maximum, grad) -> list:
    """The gradient of maximum = max(members) as each member's share: all of it to the first member equal to
    the maximum (per element)."""
    zero = jnp.zeros((), grad.dtype)
    claimed = jnp.zeros(maximum.shape, bool)
    shares = []
    for value in members:
        hit = (value == maximum) & ~claimed
        claimed = claimed | hit
        shares.append(jnp.where(hit, grad, zero))
    return shares


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def combine_members(members: list, kind: str):
    """Max or sum of same-shaped arrays, differentiated as the tiled pools are (first maximum)."""
    return functools.reduce(jnp.maximum if kind == "max" else jnp.add, members)


def _combine_members_forward(members: list, kind: str):
    combined = combine_members(members, kind)
    return combined, (members, combined)


def _combine_members_backward(kind: str, residuals, grad):
    members, combined = residuals
    if kind != "max":
        return ([grad] * len(members),)
    return (first_maximum_shares(members, combined, grad),)


combine_members.defvjp(_combine_members_forward, _combine_members_backward)


def window_reduce(x, window: Window, identity, monoid):
    """reduce_window over the spatial axes of channels-last x."""
    return lax.reduce_window(
        x,
        identity,
        monoid,
        (1, *window.kernel, 1),
        (1, *window.strides, 1),
        ((0, 0), *window.exact_pads, (0, 0)),
        window_dilation=(1, *window.dilations, 1),
    )


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def sliding_max(x, window: Window):
    """Overlapping max pooling of channels-last x. Its gradient goes to each window's first maximum, as XLA's
    select-and-scatter would, but as one strided slice and pad per window offset: several times faster on CPU."""
    return window_reduce(x, window, lowest(x.dtype), lax.max)


def _sliding_max_forward(x, window: Window):
    y = sliding_max(x, window)
    return y, (x, y)


def _sliding_max_backward(window: Window, residuals, grad):
    x, y = residuals
    padding = [(0, 0, 0), *[(b, e, 0) for b, e in window.exact_pads], (0, 0, 0)]
    padded = lax.pad(x, lowest(x.dtype), padding)
    views = list(window_views(padded, window.kernel, window.strides, window.dilations, window.out))
    shares = first_maximum_shares([view for _, view in views], y, grad)
    zero = np.zeros((), grad.dtype)
    total = jnp.zeros(padded.shape, grad.dtype)
    for (offset, _), share in zip(views, shares):
        # each share back where its view was sliced from: the slice's transpose
        spread = [(0, 0, 0)]
        for j, d, s, o, size in zip(offset, window.dilations, window.strides, window.out, padded.shape[1:-1]):
            spread.append((j * d, size - j * d - (o - 1) * s - 1, s - 1))
        total = total + lax.pad(share, zero, spread + [(0, 0, 0)])
    unpad = [(-low, -high, 0) for low, high, _ in padding]
    return (lax.pad(total, zero, unpad),)


sliding_max.defvjp(_sliding_max_forward, _sliding_max_backward)


def window_counts(window: Window, include_pad: bool) -> np.ndarray:
    """How many elements each window averages over: the input's, or also the declared padding's."""
    per_axis = []
    for size, k, s, d, (begin, end), o in zip(
        window.in_size, window.kernel, window.strides, window.dilations, window.pads, window.out
    ):
        positions = np.arange(o)[:, None] * s + np.arange(k)[None, :] * d - begin
        low, high = (-begin, size + end) if include_pad else (0, size)
        per_axis.append(((positions >= low) & (positions < high)).sum(axis=1))
    counts = per_axis[0]
    for c in per_axis[1:]:
        counts = np.multiply.outer(counts, c)
    return counts


def accumulation_dtype(dtype):
    """Half-precision sums drift; accumulate them in float32."""
    return jnp.float32 if jnp.dtype(dtype).itemsize < 4 and is_float(dtype) else dtype


@op("AveragePool", *versions("AveragePool"), layout=CHANNELS_LAST)
def average_pool(
    X, *, auto_pad="NOTSET", ceil_mode=0, count_include_pad=0, dilations=None, kernel_shape, pads=None, strides=None
):
    window = pool_window(X, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    wide = accumulation_dtype(X.dtype)
    x = X if isinstance(X, ChannelsLast) and X.dtype == wide else channels_last(X).astype(wide)
    sums = reduce_windows(x, window, "sum")
    counts = window_counts(window, bool(count_include_pad))[..., None]  # the channel axis is last
    return ChannelsLast((sums / jnp.asarray(counts, x.dtype)).astype(X.dtype))


@op("MaxPool", *versions("MaxPool"), layout=CHANNELS_LAST)
def max_pool(
    X, *, auto_pad="NOTSET", ceil_mode=0, dilations=None, kernel_shape, pads=None, storage_order=0, strides=None,
    ctx=None,
):
    window = pool_window(X, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    y = ChannelsLast(reduce_windows(X if isinstance(X, ChannelsLast) else channels_last(X), window, "max"))
    wants_indices = ctx is not None and len(ctx.node.outputs) > 1 and bool(ctx.node.outputs[1])
    if not wants_indices:
        return y
    return y, argmax_indices(channels_first(X), window, storage_order)


def argmax_indices(x, window: Window, storage_order: int):
    """MaxPool's Indices: the flat index (batch and channel included) of each window's first maximum."""
    x = lax.stop_gradient(x)  # the indices are integers; keep autodiff away from the variadic reduction
    spatial = x.shape[2:]
    size = math.prod(spatial)
    position = lax.broadcasted_iota(jnp.int64, (1, 1, size), 2).reshape((1, 1, *spatial))
    position = jnp.broadcast_to(position, x.shape)

    def first_max(a, b):
        (value_a, index_a), (value_b, index_b) = a, b
        take_b = (value_b > value_a) | ((value_b == value_a) & (index_b < index_a))
        return jnp.where(take_b, value_b, value_a), jnp.where(take_b, index_b, index_a)

    _, index = lax.reduce_window(
        (x, position),
        (lowest(x.dtype), np.array(np.iinfo(np.int64).max, np.int64)),
        first_max,
        (1, 1, *window.kernel),
        (1, 1, *window.strides),
        ((0, 0), (0, 0), *window.exact_pads),
        window_dilation=(1, 1, *window.dilations),
    )
    if storage_order:  # column-major numbering of the spatial position
        coords, remaining = [], index
        for axis_size in reversed(spatial):
            coords.append(remaining % axis_size)
            remaining = remaining // axis_size
        index = sum(c * math.prod(spatial[:i]) for i, c in enumerate(reversed(coords)))
    n, c = x.shape[:2]
    plane = lax.broadcasted_iota(jnp.int64, (n, c, *[1] * len(spatial)), 0) * c
    plane = plane + lax.broadcasted_iota(jnp.int64, (n, c, *[1] * len(spatial)), 1)
    return index + plane * size


@op("LpPool", *versions("LpPool"), layout=CHANNELS_LAST)
def lp_pool(X, *, auto_pad="NOTSET", ceil_mode=0, dilations=None, kernel_shape, p=2, pads=None, strides=None):
    """(sum |x|^p)^(1/p) over each window; padding adds nothing to the sum."""
    window = pool_window(X, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    x = channels_last(X).astype(accumulation_dtype(X.dtype))
    powered = reduce_windows(jnp.abs(x) ** p, window, "sum")
    return ChannelsLast((powered ** (1.0 / p)).astype(X.dtype))


def spatial_axes(x) -> tuple[int, ...]:
    """The spatial axes of channels-last data."""
    if x.ndim < 3:
        raise ValueError(f"X must have a batch, a channel and at least one spatial axis, got shape {x.shape}")
    return tuple(range(1, x.ndim - 1))


@op("GlobalAveragePool", *versions("GlobalAveragePool"), layout=CHANNELS_LAST)
def global_average_pool(X):
    x = channels_last(X)
    return ChannelsLast(jnp.mean(x, axis=spatial_axes(x), keepdims=True).astype(X.dtype))


@op("GlobalMaxPool", *versions("GlobalMaxPool"), layout=CHANNELS_LAST)
def global_max_pool(X):
    x = channels_last(X)
    return ChannelsLast(jnp.max(x, axis=spatial_axes(x), keepdims=True))


@op("GlobalLpPool", *versions("GlobalLpPool"), layout=CHANNELS_LAST)
def global_lp_pool(X, *, p=2):
    x = channels_last(X).astype(accumulation_dtype(X.dtype))
    powered = jnp.sum(jnp.abs(x) ** p, axis=spatial_axes(x), keepdims=True)
    return ChannelsLast((powered ** (1.0 / p)).astype(X.dtype))


@op("MaxUnpool", *versions("MaxUnpool"))
def max_unpool(X, I, output_shape=None, *, kernel_shape, pads=None, strides=None):
    """Scatter X to the flat positions I (MaxPool's Indices) of a zero tensor of the shape inferred from
    kernel_shape, strides and pads; an `output_shape` then pads that tensor at the end of each axis.

    This is the spec's letter ("output_shape ... will cause pads values to be auto generated") and ONNX's test.
    ONNX Runtime and PyTorch instead read I as positions in output_shape itself (onnx/onnx#2398); the two
    agree whenever output_shape equals the inferred shape."""
    rank = X.ndim - 2
    if len(kernel_shape) != rank:
        raise ValueError(f"kernel_shape {list(kernel_shape)} must have one entry per spatial axis of X {X.shape}")
    strides = spatial_param(strides, rank, 1, "strides")
    padding = explicit_pads(pads, rank)
    shape = (*X.shape[:2], *[
        (size - 1) * s - (begin + end) + k
        for size, s, (begin, end), k in zip(X.shape[2:], strides, padding, kernel_shape)
    ])
    flat = jnp.zeros((math.prod(shape),), X.dtype).at[jnp.reshape(I, (-1,))].set(jnp.reshape(X, (-1,)), mode="drop")
    unpooled = jnp.reshape(flat, shape)
    if output_shape is None:
        return unpooled
    target = tuple(static_ints(output_shape, "output_shape"))
    if len(target) != X.ndim or any(t < n for t, n in zip(target, shape)):
        raise ValueError(f"output_shape {list(target)} must have rank {X.ndim} and be at least {list(shape)}")
    return jnp.pad(unpooled, [(0, t - n) for t, n in zip(target, shape)])


def round_half_away(v):
    return jnp.sign(v) * jnp.floor(jnp.abs(v) + 0.5)


def roi_bins(start, length, bins: int, limit: int):
    """[start, end) of each of `bins` bins splitting `length` pixels from `start`, clipped to the image. Integer
    arithmetic: floor(i * length / bins) and ceil((i + 1) * length / bins) exactly, where float rounding wobbles."""
    i = jnp.arange(bins, dtype=jnp.int32)
    low = jnp.clip(i * length // bins + start, 0, limit)
    high = jnp.clip(-(-(i + 1) * length // bins) + start, 0, limit)
    return low, high


@op("MaxRoiPool", *versions("MaxRoiPool"))
def max_roi_pool(X, rois, *, pooled_shape: Sequence[int], spatial_scale=1.0):
    """Fast R-CNN's RoI pooling: each roi (batch, x1, y1, x2, y2) is cut into pooled_shape bins, max of each."""
    if X.ndim != 4 or rois.ndim != 2 or rois.shape[1] != 5:
        raise ValueError(f"expected X (N, C, H, W) and rois (R, 5), got {X.shape} and {rois.shape}")
    pooled_h, pooled_w = (int(v) for v in pooled_shape)
    height, width = X.shape[2:]
    floor_value = lowest(X.dtype)

    def pool_one(roi):
        corners = round_half_away(roi[1:] * spatial_scale).astype(jnp.int32)
        x1, y1, x2, y2 = corners[0], corners[1], corners[2], corners[3]
        h_low, h_high = roi_bins(y1, jnp.maximum(y2 - y1 + 1, 1), pooled_h, height)
        w_low, w_high = roi_bins(x1, jnp.maximum(x2 - x1 + 1, 1), pooled_w, width)
        rows = jnp.arange(height)
        cols = jnp.arange(width)
        in_rows = (rows >= h_low[:, None]) & (rows < h_high[:, None])  # (pooled_h, H)
        in_cols = (cols >= w_low[:, None]) & (cols < w_high[:, None])  # (pooled_w, W)
        image = jnp.take(X, roi[0].astype(jnp.int32), axis=0)  # (C, H, W)
        by_col = jnp.max(jnp.where(in_cols[None, None], image[:, :, None, :], floor_value), axis=-1)  # C, H, pw
        pooled = jnp.max(jnp.where(in_rows[None, :, :, None], by_col[:, None], floor_value), axis=2)  # C, ph, pw
        empty = (h_high <= h_low)[:, None] | (w_high <= w_low)[None, :]
        return jnp.where(empty[None], jnp.zeros((), X.dtype), pooled)

    return lax.map(pool_one, jnp.asarray(rois).astype(X.dtype))


def roi_axis_samples(start, extent, bins: int, grid, grid_max: int, size: int):
    """RoiAlign's bilinear taps along one axis for every (roi, bin, sample): [(index, weight)], validity."""
    bin_size = extent / bins
    sample = jnp.arange(grid_max, dtype=start.dtype)
    pos = (
        start[:, None, None]
        + jnp.arange(bins, dtype=start.dtype)[None, :, None] * bin_size[:, None, None]
        + (sample[None, None, :] + 0.5) * (bin_size / jnp.maximum(grid, 1))[:, None, None]
    )  # (rois, bins, grid_max)
    inside = (pos >= -1.0) & (pos <= size)
    pos = jnp.maximum(pos, 0)
    low = jnp.floor(pos).astype(jnp.int32)
    at_edge = low >= size - 1
    low = jnp.where(at_edge, size - 1, low)
    high = jnp.where(at_edge, size - 1, low + 1)
    frac = jnp.where(at_edge, 0, pos - low)
    used = sample[None, None, :] < grid[:, None, None]
    return [(low, 1 - frac), (high, frac)], inside, used


def roi_align_core(
    X, rois, batch_indices, *, half_pixel: bool, mode: str, output_height: int, output_width: int,
    sampling_ratio: int, spatial_scale: float,
):
    if X.ndim != 4 or rois.ndim != 2 or rois.shape[1] != 4:
        raise ValueError(f"expected X (N, C, H, W) and rois (R, 4), got {X.shape} and {rois.shape}")
    if mode not in ("avg", "max"):
        raise ValueError(f"mode must be avg or max, got {mode!r}")
    height, width = X.shape[2:]
    dtype = X.dtype
    offset = 0.5 if half_pixel else 0.0
    # with sampling_ratio 0 the number of samples per bin follows each roi's size: the rois must be static, and
    # the geometry is computed in NumPy (jnp would stage it into the trace)
    xp = jnp if sampling_ratio > 0 else np
    rois = rois if sampling_ratio > 0 else static(rois, "rois")
    boxes = xp.asarray(rois).astype(dtype) * xp.asarray(spatial_scale, dtype) - xp.asarray(offset, dtype)
    extent_w, extent_h = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    if not half_pixel:  # malformed rois are forced to 1x1
        extent_w, extent_h = xp.maximum(extent_w, 1.0), xp.maximum(extent_h, 1.0)
    if sampling_ratio > 0:
        grid_h = grid_w = jnp.full((rois.shape[0],), sampling_ratio, jnp.int32)
        max_h = max_w = sampling_ratio
    else:
        grid_h = np.ceil(extent_h / output_height).astype(np.int32)
        grid_w = np.ceil(extent_w / output_width).astype(np.int32)
        max_h, max_w = max(int(grid_h.max(initial=0)), 1), max(int(grid_w.max(initial=0)), 1)
    taps_y, inside_y, used_y = roi_axis_samples(boxes[:, 1], extent_h, output_height, grid_h, max_h, height)
    taps_x, inside_x, used_x = roi_axis_samples(boxes[:, 0], extent_w, output_width, grid_w, max_w, width)
    batch = jnp.asarray(batch_indices).astype(jnp.int32)[:, None, None, None, None]
    # samples laid out (roi, bin_y, sample_y, bin_x, sample_x, channel)
    corners = []
    for y_index, y_weight in taps_y:
        for x_index, x_weight in taps_x:
            values = X[batch, :, y_index[:, :, :, None, None], x_index[:, None, None, :, :]]
            weight = y_weight[:, :, :, None, None] * x_weight[:, None, None, :, :]
            corners.append(values * weight[..., None].astype(dtype))
    inside = (inside_y[:, :, :, None, None] & inside_x[:, None, None, :, :])[..., None]
    used = (used_y[:, :, :, None, None] & used_x[:, None, None, :, :])[..., None]
    if mode == "avg":
        samples = jnp.where(inside & used, sum(corners), jnp.zeros((), dtype))
        count = jnp.maximum(grid_h * grid_w, 1).astype(dtype)[:, None, None, None]
        pooled = jnp.sum(samples, axis=(2, 4)) / count
    else:
        best_corner = corners[0]
        for corner in corners[1:]:
            best_corner = jnp.maximum(best_corner, corner)
        samples = jnp.where(inside, best_corner, jnp.zeros((), dtype))
        samples = jnp.where(used, samples, jnp.asarray(-jnp.inf, dtype))
        pooled = jnp.max(samples, axis=(2, 4))
        pooled = jnp.where(jnp.isneginf(pooled), jnp.zeros((), dtype), pooled)  # a roi with no samples
    return jnp.moveaxis(pooled, -1, 1)  # (rois, C, output_height, output_width)


@op("RoiAlign", *versions("RoiAlign", since=16))
def roi_align(
    X, rois, batch_indices, *, coordinate_transformation_mode="half_pixel", mode="avg", output_height=1,
    output_width=1, sampling_ratio=0, spatial_scale=1.0,
):
    if coordinate_transformation_mode not in ("half_pixel", "output_half_pixel"):
        raise ValueError("coordinate_transformation_mode must be half_pixel or output_half_pixel")
    return roi_align_core(
        X, rois, batch_indices, half_pixel=coordinate_transformation_mode == "half_pixel", mode=mode,
        output_height=output_height, output_width=output_width, sampling_ratio=sampling_ratio,
        spatial_scale=spatial_scale,
    )


@op("RoiAlign", 10)
def roi_align_v10(X, rois, batch_indices, *, mode="avg", output_height=1, output_width=1, sampling_ratio=0,
                  spatial_scale=1.0):
    """Opset 10 had no coordinate_transformation_mode: it behaved as output_half_pixel."""
    return roi_align_core(
        X, rois, batch_indices, half_pixel=False, mode=mode, output_height=output_height,
        output_width=output_width, sampling_ratio=sampling_ratio, spatial_scale=spatial_scale,
    )
