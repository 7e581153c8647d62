"""Shape ops: views, rearrangements, padding, Trilu.

Tensors built from scalars and attributes (Constant, ConstantOfShape, Range, EyeLike) are creation.py.

Shapes, axes, pads and repeats are read with `static()`: XLA needs them at compile time. `Shape` and `Size`
answer from the (always concrete) static shape, so shape arithmetic on traced tensors folds at trace time.
Old opsets that took attributes where newer ones take inputs are thin adapters over one implementation.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Callable

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..axes import normalize_axis
from ..registry import op, versions
from ..values import Value, is_text, static_ints


def optional_ints(value: Value, what: str) -> list[int] | None:
    return None if value is None else static_ints(value, what)


def moves_strings(fn: Callable) -> Callable:
    """Let a pure data-movement op take string tensors (always static): it moves int64 positions into a pool
    of the strings, and NumPy gathers the strings at the positions that come out."""

    @functools.wraps(fn)
    def lowered(*inputs, **attributes):
        if not any(is_text(v) for v in inputs):
            return fn(*inputs, **attributes)
        pool: list = []
        positions = []
        for v in inputs:
            if is_text(v):
                positions.append(np.arange(len(pool), len(pool) + v.size, dtype=np.int64).reshape(v.shape))
                pool.extend(v.reshape(-1).tolist())
            else:
                positions.append(v)
        strings = np.asarray(pool, dtype=object)
        moved = fn(*positions, **attributes)
        if isinstance(moved, tuple):
            return tuple(strings[np.asarray(m)] for m in moved)
        return strings[np.asarray(moved)]

    return lowered


# --- shape queries: always static NumPy, even for traced data ----------------------------------------------


@op("Shape", *versions("Shape"))
def shape(data, *, start: int = 0, end: int | None = None) -> np.ndarray:
    # Python slicing clamps start/end exactly as ONNX specifies (negative from the back, then into [0, rank]).
    return np.asarray(np.shape(data), dtype=np.int64)[start:end]


@op("Size", *versions("Size"))
def size(data) -> np.ndarray:
    return np.asarray(math.prod(np.shape(data)), dtype=np.int64)


# --- views ----------------------------------------------------------------------------------------------------


def reshape_to(data, dims: list[int], allowzero: int = 0):
    if not allowzero:
        dims = [data.shape[i] if d == 0 else d for i, d in enumerate(dims)]
    return jnp.reshape(data, dims)


@op("Reshape", *versions("Reshape", since=5))
@moves_strings
def reshape(data, shape_, *, allowzero: int = 0):
    return reshape_to(data, static_ints(shape_, "shape"), allowzero)


@op("Reshape", 1)
@moves_strings
def reshape_v1(data, *, shape: list[int], consumed_inputs: list[int] | None = None):
    return reshape_to(data, shape)


@op("Flatten", *versions("Flatten"))
@moves_strings
def flatten(data, *, axis: int = 1):
    rank = data.ndim
    if not -rank <= axis <= rank:
        raise ValueError(f"axis {axis} is out of range for rank {rank}")
    axis = axis + rank if axis < 0 else axis
    return jnp.reshape(data, (math.prod(data.shape[:axis]), math.prod(data.shape[axis:])))


def squeeze_axes(data, axes: list[int] | None):
    if axes is None:
        return jnp.squeeze(data)
    axes = [normalize_axis(a, data.ndim) for a in axes]
    wrong = [a for a in axes if data.shape[a] != 1]
    if wrong:
        raise ValueError(f"cannot squeeze axes {wrong} of shape {tuple(data.shape)}: their size is not 1")
    return jnp.squeeze(data, axis=tuple(axes))


@op("Squeeze", *versions("Squeeze", since=13))
@moves_strings
def squeeze(data, axes=None):
    return squeeze_axes(data, optional_ints(axes, "axes"))


@op("Squeeze", *versions("Squeeze", until=12))
@moves_strings
def squeeze_attr(data, *, axes: list[int] | None = None):
    return squeeze_axes(data, axes)


def unsqueeze_axes(data, axes: list[int]):
    out_rank = data.ndim + len(axes)
    normalized = [normalize_axis(a, out_rank) for a in axes]
    if len(set(normalized)) != len(normalized):
        raise ValueError(f"axes {axes} repeat an axis")
    return jnp.expand_dims(data, tuple(normalized))


@op("Unsqueeze", *versions("Unsqueeze", since=13))
@moves_strings
def unsqueeze(data, axes):
    return unsqueeze_axes(data, static_ints(axes, "axes"))


@op("Unsqueeze", *versions("Unsqueeze", until=12))
@moves_strings
def unsqueeze_attr(data, *, axes: list[int]):
    return unsqueeze_axes(data, axes)


@op("Transpose", *versions("Transpose"))
@moves_strings
def transpose(data, *, perm: list[int] | None = None):
    return jnp.transpose(data, perm)


@op("Identity", *versions("Identity"))
def identity(value=None):
    # Tensors, sequences (lists) and optionals alike; an empty optional arrives as no argument at all.
    return value


# --- joining and splitting ------------------------------------------------------------------------------------


@op("Concat", *versions("Concat"))
@moves_strings
def concat(*inputs, axis: int = 1):  # opset 1 documents 1 as the default axis
    return jnp.concatenate(inputs, axis=normalize_axis(axis, inputs[0].ndim))


def split_sizes(dim: int, parts: int) -> list[int]:
    """Equal parts; when `dim` does not divide evenly the last part is the smaller one (opset 18's rule)."""
    chunk = -(-dim // parts)
    sizes = [chunk] * (parts - 1) + [dim - chunk * (parts - 1)]
    if sizes[-1] < 0:
        raise ValueError(f"cannot split a dimension of {dim} into {parts} parts")
    return sizes


def split_along(data, axis: int, sizes: list[int] | None, parts: int) -> tuple:
    axis = normalize_axis(axis, data.ndim)
    dim = data.shape[axis]
    sizes = split_sizes(dim, parts) if sizes is None else sizes
    if sum(sizes) != dim or min(sizes, default=0) < 0:
        raise ValueError(f"split sizes {sizes} do not add up to dimension {axis} of size {dim}")
    offsets = itertools.accumulate(sizes, initial=0)
    return tuple(lax.slice_in_dim(data, start, start + n, axis=axis) for start, n in zip(offsets, sizes))


@op("Split", *versions("Split", since=13))
@moves_strings
def split(data, sizes=None, *, axis: int = 0, num_outputs: int | None = None, ctx):
    parts = num_outputs if num_outputs is not None else len(ctx.node.outputs)
    sizes = optional_ints(sizes, "split")
    return split_along(data, axis, sizes or None, parts)  # exporters write an empty `split` for "not given"


@op("Split", *versions("Split", until=12))
@moves_strings
def split_attr(data, sizes=None, *, axis: int = 0, split: list[int] | None = None, ctx):
    # Opset 1 also accepted the sizes as an optional second input.
    sizes = split if split is not None else optional_ints(sizes, "split")
    return split_along(data, axis, sizes, len(ctx.node.outputs))


# --- slicing --------------------------------------------------------------------------------------------------


def slice_bounds(start: int, end: int, step: int, dim: int) -> tuple[int, int, int]:
    """(first index taken, count, |step|) for one axis, after ONNX's negative-index and clamping rules."""
    if step == 0:
        raise ValueError("slice step cannot be 0")
    start = start + dim if start < 0 else start
    end = end + dim if end < 0 else end
    if step > 0:
        start, end = min(max(start, 0), dim), min(max(end, 0), dim)
        count = max(0, -(-(end - start) // step))
    else:
        start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
        count = max(0, -(-(start - end) // -step))
    return start, count, abs(step)


def slice_axes(data, starts: list[int], ends: list[int], axes: list[int] | None, steps: list[int] | None):
    axes = list(range(len(starts))) if axes is None else [normalize_axis(a, data.ndim) for a in axes]
    steps = [1] * len(starts) if steps is None else steps
    if not len(starts) == len(ends) == len(axes) == len(steps):
        raise ValueError(f"starts, ends, axes and steps differ in length: {starts}, {ends}, {axes}, {steps}")
    lo, hi, strides = [0] * data.ndim, list(data.shape), [1] * data.ndim
    reversed_axes = []
    for axis, start, end, step in zip(axes, starts, ends, steps):
        first, count, stride = slice_bounds(start, end, step, data.shape[axis])
        # A negative step takes the same elements as a positive slice ending at `first`, read backwards.
        lowest = first if step > 0 else first - stride * (count - 1)
        lo[axis], hi[axis], strides[axis] = (lowest, lowest + stride * (count - 1) + 1, stride) if count else (0, 0, 1)
        if step < 0:
            reversed_axes.append(axis)
    out = lax.slice(data, lo, hi, strides)
    return lax.rev(out, reversed_axes) if reversed_axes else out


@op("Slice", *versions("Slice", since=10))
@moves_strings
def slice_(data, starts, ends, axes=None, steps=None):
    return slice_axes(
        data,
        static_ints(starts, "starts"),
        static_ints(ends, "ends"),
        optional_ints(axes, "axes"),
        optional_ints(steps, "steps"),
    )


@op("Slice", 1)
@moves_strings
def slice_attr(data, *, starts: list[int], ends: list[int], axes: list[int] | None = None):
    return slice_axes(data, starts, ends, axes, None)


# --- broadcasting and repetition ------------------------------------------------------------------------------


@op("Expand", *versions("Expand"))
@moves_strings
def expand(data, shape_):
    target = np.broadcast_shapes(tuple(data.shape), tuple(static_ints(shape_, "shape")))
    return jnp.broadcast_to(data, target)


@op("Tile", *versions("Tile", since=6))
@moves_strings
def tile(data, repeats):
    reps = static_ints(repeats, "repeats")
    if len(reps) != data.ndim:
        raise ValueError(f"repeats {reps} must have one entry per dimension of the rank-{data.ndim} input")
    return jnp.tile(data, reps)


@op("Tile", 1)
@moves_strings
def tile_v1(data, tiles, axis):
    """Opset 1 repeated the whole tensor `tiles` times along one `axis`."""
    reps = [1] * data.ndim
    reps[normalize_axis(static_ints(axis, "axis")[0], data.ndim)] = static_ints(tiles, "tiles")[0]
    return jnp.tile(data, reps)


# --- padding --------------------------------------------------------------------------------------------------

PAD_MODES = ("constant", "reflect", "edge", "wrap")  # the same names as jnp.pad's


def pad_axes(data, pads: list[int], mode: str, value, axes: list[int] | None = None):
    """Pad (or, for negative pads, crop) `axes` (all by default); pads are [begin..., end...]."""
    rank = data.ndim
    axes = list(range(rank)) if axes is None else [normalize_axis(a, rank) for a in axes]
    if len(pads) != 2 * len(axes):
        raise ValueError(f"pads {pads} must hold a begin and an end for each of the {len(axes)} axes")
    widths = [(0, 0)] * rank
    for i, axis in enumerate(axes):
        widths[axis] = (pads[i], pads[i + len(axes)])
    if mode not in PAD_MODES:
        raise ValueError(f"unknown pad mode {mode!r}; expected one of {PAD_MODES}")
    if mode == "constant":
        # lax.pad crops on negative widths itself, and takes a traced fill value.
        fill = jnp.asarray(0 if value is None else value, dtype=data.dtype).reshape(())
        return lax.pad(data, fill, [(lo, hi, 0) for lo, hi in widths])
    cropped = data[tuple(slice(max(-lo, 0), data.shape[a] - max(-hi, 0)) for a, (lo, hi) in enumerate(widths))]
    return jnp.pad(cropped, [(max(lo, 0), max(hi, 0)) for lo, hi in widths], mode=mode)


@op("Pad", *versions("Pad", since=11))
def pad(data, pads, constant_value=None, axes=None, *, mode: str = "constant"):
    return pad_axes(data, static_ints(pads, "pads"), mode, constant_value, optional_ints(axes, "axes"))


@op("Pad", 2)
def pad_v2(data, *, pads: list[int], mode: str = "constant", value: float = 0.0):
    return pad_axes(data, pads, mode, value)


@op("Pad", 1)
def pad_v1(data, *, paddings: list[int], mode: str = "constant", value: float = 0.0):
    return pad_axes(data, paddings, mode, value)


@op("CenterCropPad", *versions("CenterCropPad"))
def center_crop_pad(data, shape_, *, axes: list[int] | None = None):
    """Crop or zero-pad each axis to the wanted size around its centre (the odd element goes to the end)."""
    sizes = static_ints(shape_, "shape")
    axes = list(range(data.ndim)) if axes is None else [normalize_axis(a, data.ndim) for a in axes]
    if len(sizes) != len(axes):
        raise ValueError(f"shape {sizes} must have one entry per axis {axes}")
    widths = [(0, 0, 0)] * data.ndim
    for axis, size_ in zip(axes, sizes):
        extra = size_ - data.shape[axis]
        before = extra // 2 if extra >= 0 else -((-extra) // 2)
        widths[axis] = (before, extra - before, 0)
    return lax.pad(data, jnp.zeros((), data.dtype), widths)


# --- block rearrangements -------------------------------------------------------------------------------------


def require_rank4_blocks(data, blocksize: int, mode: str) -> None:
    if data.ndim != 4:
        raise ValueError(f"expects a rank-4 NCHW input, got shape {tuple(data.shape)}")
    if mode not in ("DCR", "CRD"):
        raise ValueError(f"unknown mode {mode!r}; expected 'DCR' or 'CRD'")
    if blocksize < 1:
        raise ValueError(f"blocksize must be positive, got {blocksize}")


@op("DepthToSpace", *versions("DepthToSpace"))
@moves_strings
def depth_to_space(data, *, blocksize: int, mode: str = "DCR"):
    require_rank4_blocks(data, blocksize, mode)
    b, c, h, w = data.shape
    depth = c // (blocksize * blocksize)
    if mode == "DCR":
        blocks = jnp.reshape(data, (b, blocksize, blocksize, depth, h, w)).transpose(0, 3, 4, 1, 5, 2)
    else:
        blocks = jnp.reshape(data, (b, depth, blocksize, blocksize, h, w)).transpose(0, 1, 4, 2, 5, 3)
    return jnp.reshape(blocks, (b, depth, h * blocksize, w * blocksize))


@op("SpaceToDepth", *versions("SpaceToDepth"))
@moves_strings
def space_to_depth(data, *, blocksize: int, mode: str = "DCR"):
    require_rank4_blocks(data, blocksize, mode)
    b, c, h, w = data.shape
    if h % blocksize or w % blocksize:
        raise ValueError(f"spatial dims {h}x{w} are not divisible by blocksize {blocksize}")
    tiles = jnp.reshape(data, (b, c, h // blocksize, blocksize, w // blocksize, blocksize))
    order = (0, 3, 5, 1, 2, 4) if mode == "DCR" else (0, 1, 3, 5, 2, 4)
    return jnp.reshape(tiles.transpose(order), (b, c * blocksize * blocksize, h // blocksize, w // blocksize))


@op("Col2Im", *versions("Col2Im"))
def col2im(data, image_shape, block_shape, *, strides=None, pads=None, dilations=None):
    """Sum each column block back into its window of the image (the adjoint of im2col)."""
    image = static_ints(image_shape, "image_shape")
    block = static_ints(block_shape, "block_shape")
    n_dims = len(image)
    strides = strides or [1] * n_dims
    dilations = dilations or [1] * n_dims
    pads = pads or [0] * (2 * n_dims)
    padded = [image[d] + pads[d] + pads[d + n_dims] for d in range(n_dims)]
    counts = [(padded[d] - dilations[d] * (block[d] - 1) - 1) // strides[d] + 1 for d in range(n_dims)]
    n, cols, length = data.shape
    channels = cols // math.prod(block)
    if channels * math.prod(block) != cols or math.prod(counts) != length or min(counts) < 1:
        raise ValueError(
            f"input shape {tuple(data.shape)} does not match image {image}, block {block}, "
            f"strides {strides}, pads {pads}, dilations {dilations} ({counts} blocks)"
        )
    columns = jnp.reshape(data, (n, channels, *block, *counts))
    out = jnp.zeros((n, channels, *padded), data.dtype)
    for offset in itertools.product(*(range(b) for b in block)):
        window = tuple(
            slice(o * dilations[d], o * dilations[d] + strides[d] * (counts[d] - 1) + 1, strides[d])
            for d, o in enumerate(offset)
        )
        out = out.at[(slice(None), slice(None), *window)].add(columns[(slice(None), slice(None), *offset)])
    crop = tuple(slice(pads[d], pads[d] + image[d]) for d in range(n_dims))
    return out[(slice(None), slice(None), *crop)]


@op("Trilu", *versions("Trilu"))
def trilu(data, k=None, *, upper: int = 1):
    diagonal = 0 if k is None else static_ints(k, "k")[0]
    if data.ndim < 2:
        raise ValueError(f"expects rank >= 2, got shape {tuple(data.shape)}")
    return jnp.triu(data, diagonal) if upper else jnp.tril(data, diagonal)
