"""Indexing: gathers and scatters, selection (Where, OneHot, Compress, NonZero, Unique), ReverseSequence.

Gathers and scatters take traced data and traced indices (only shapes are static) and stay differentiable in
the data, as training graphs need them (embeddings, cross-entropy). Indices known at trace time are range-checked
up front, since ONNX makes an out-of-range index an error that XLA would otherwise silently fill or drop.
Ops whose output shape depends on values (NonZero, Unique, Compress) read those values with `static()`.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from ...dtypes import is_float
from ..axes import normalize_axis, wrap_indices
from ..registry import op, versions
from ..values import Value, is_text, static, static_int


def _xp(*tensors: Value) -> Any:
    """NumPy when strings are involved (XLA has no strings; they are always static), else jax.numpy."""
    return np if any(is_text(t) for t in tensors) else jnp


def _host(value: Value, what: str, xp: Any) -> Value:
    """An index input that must be static when the data is computed on the host."""
    return static(value, what) if xp is np else value


# ---- gathers -------------------------------------------------------------------------------------------------


@op("Gather", *versions("Gather"))
def gather(data: Value, indices: Value, *, axis: int = 0) -> Value:
    axis = normalize_axis(axis, np.ndim(data))
    xp = _xp(data)
    return xp.take(data, wrap_indices(_host(indices, "indices", xp), np.shape(data)[axis]), axis=axis)


@op("GatherElements", *versions("GatherElements"))
def gather_elements(data: Value, indices: Value, *, axis: int = 0) -> Value:
    axis = normalize_axis(axis, np.ndim(data))
    if np.ndim(indices) != np.ndim(data):
        raise ValueError(f"indices have rank {np.ndim(indices)}, data rank {np.ndim(data)}; they must be equal")
    # Off the gather axis, indices may be shorter than data: only the leading block of data takes part.
    block = tuple(slice(None) if d == axis else slice(0, n) for d, n in enumerate(np.shape(indices)))
    xp = _xp(data)
    data = xp.asarray(data)[block]
    return xp.take_along_axis(data, wrap_indices(_host(indices, "indices", xp), data.shape[axis]), axis=axis)


@op("GatherND", *versions("GatherND"))
def gather_nd(data: Value, indices: Value, *, batch_dims: int = 0) -> Value:
    data_shape, index_shape, b = np.shape(data), np.shape(indices), batch_dims
    depth = index_shape[-1]
    if not 1 <= depth <= len(data_shape) - b:
        raise ValueError(f"indices' last dimension is {depth}, it must be in [1, {len(data_shape) - b}]")
    if data_shape[:b] != index_shape[:b]:
        raise ValueError(f"the {b} batch dimensions differ: data {data_shape[:b]}, indices {index_shape[:b]}")
    xp = _xp(data)
    positions = wrap_indices(_host(indices, "indices", xp), np.array(data_shape[b : b + depth]))
    # Fold the batch dimensions into one so a single advanced-indexing gather serves every batch_dims.
    batches, per_batch = int(np.prod(data_shape[:b])), int(np.prod(index_shape[b:-1]))
    flat_data = xp.asarray(data).reshape((batches,) + data_shape[b:])
    flat_positions = positions.reshape(batches, per_batch, depth)
    batch_ids = np.arange(batches)[:, None]
    picked = flat_data[(batch_ids, *(flat_positions[..., j] for j in range(depth)))]
    return picked.reshape(index_shape[:-1] + data_shape[b + depth :])


# ---- scatters ------------------------------------------------------------------------------------------------

_REDUCTIONS = {"none": "set", "add": "add", "mul": "multiply", "max": "max", "min": "min"}


def _scatter(data: Value, where: tuple, updates: Value, reduction: str) -> Value:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; expected one of {sorted(_REDUCTIONS)}")
    if is_text(data):
        if reduction != "none":
            raise ValueError(f"reduction {reduction!r} is not defined for strings")
        written = data.copy()
        written[tuple(static(w, "indices") for w in where)] = updates
        return written
    return getattr(jnp.asarray(data).at[where], _REDUCTIONS[reduction])(updates)


@op("Scatter", *versions("Scatter"))
@op("ScatterElements", *versions("ScatterElements"))
def scatter_elements(data: Value, indices: Value, updates: Value, *, axis: int = 0, reduction: str = "none") -> Value:
    axis = normalize_axis(axis, np.ndim(data))
    if np.shape(indices) != np.shape(updates):
        raise ValueError(f"indices {np.shape(indices)} and updates {np.shape(updates)} must have the same shape")
    where = list(np.indices(np.shape(indices), sparse=True))
    where[axis] = wrap_indices(indices, np.shape(data)[axis])
    return _scatter(data, tuple(where), updates, reduction)


@op("ScatterND", *versions("ScatterND"))
def scatter_nd(data: Value, indices: Value, updates: Value, *, reduction: str = "none") -> Value:
    depth = np.shape(indices)[-1]
    expected = np.shape(indices)[:-1] + np.shape(data)[depth:]
    if np.shape(updates) != expected:
        raise ValueError(f"updates have shape {np.shape(updates)}, expected {expected}")
    positions = wrap_indices(indices, np.array(np.shape(data)[:depth]))
    return _scatter(data, tuple(positions[..., j] for j in range(depth)), updates, reduction)


@op("TensorScatter", *versions("TensorScatter"))
def tensor_scatter(
    past_cache: Value, update: Value, write_indices: Value = None, *, axis: int = -2, mode: str = "linear"
) -> Value:
    rank = np.ndim(past_cache)
    axis = normalize_axis(axis, rank)
    if axis == 0:
        raise ValueError("axis must not be 0, the batch axis")
    if mode not in ("linear", "circular"):
        raise ValueError(f"unknown mode {mode!r}; expected 'linear' or 'circular'")
    cache_shape, update_shape = np.shape(past_cache), np.shape(update)
    if cache_shape[:axis] + cache_shape[axis + 1 :] != update_shape[:axis] + update_shape[axis + 1 :]:
        raise ValueError(f"update {update_shape} must match past_cache {cache_shape} except along axis {axis}")
    xp = _xp(past_cache)
    if write_indices is None:
        starts = np.zeros(cache_shape[0], np.int64)
    else:
        starts = xp.asarray(_host(write_indices, "write_indices", xp))
    # Row `i` of the update lands at cache row write_indices[batch] + i, along `axis`; later axes are sliced.
    steps = xp.arange(update_shape[axis], dtype=starts.dtype).reshape((1,) * axis + (-1,))
    rows = starts.reshape((-1,) + (1,) * axis) + steps
    if mode == "circular":
        rows = rows % cache_shape[axis]
    prefix = np.indices(update_shape[:axis] + (1,), sparse=True)[:axis]
    return _scatter(past_cache, (*prefix, rows), update, "none")


# ---- selection -----------------------------------------------------------------------------------------------


@op("Where", *versions("Where"))
def where(condition: Value, x: Value, y: Value) -> Value:
    xp = _xp(x, y)
    return xp.where(_host(condition, "condition", xp), x, y)


def _one_hot(indices: Value, depth: Value, values: Value, axis: int, wrap_negative: bool) -> Value:
    classes = static_int(depth, "depth")
    if classes < 0:
        raise ValueError(f"depth must not be negative, got {classes}")
    axis = normalize_axis(axis, np.ndim(indices) + 1)
    xp = _xp(values)
    positions = jnp.asarray(_host(indices, "indices", xp))
    if jnp.issubdtype(positions.dtype, jnp.integer):
        positions = positions.astype(jnp.int64)
    if wrap_negative:
        positions = jnp.where(positions < 0, positions + classes, positions)
    # Out-of-range (and, for float indices, fractional) positions match no class and stay all off.
    hot = jnp.expand_dims(positions, axis) == jnp.arange(classes).reshape((-1,) + (1,) * (np.ndim(indices) - axis))
    return xp.where(hot, values[1], values[0])


@op("OneHot", *versions("OneHot", since=11))
def one_hot(indices: Value, depth: Value, values: Value, *, axis: int = -1) -> Value:
    return _one_hot(indices, depth, values, axis, wrap_negative=True)


@op("OneHot", *versions("OneHot", until=10))
def one_hot_v9(indices: Value, depth: Value, values: Value, *, axis: int = -1) -> Value:
    """Before opset 11 the valid range was [0, depth): a negative index is out of range, not counted from the end."""
    return _one_hot(indices, depth, values, axis, wrap_negative=False)


@op("Compress", *versions("Compress"))
def compress(input: Value, condition: Value, *, axis: int | None = None) -> Value:  # noqa: A002 - ONNX's name
    keep = np.flatnonzero(static(condition, "condition").reshape(-1))
    xp = _xp(input)
    data = xp.asarray(input)
    if axis is None:
        data, axis = data.reshape(-1), 0
    axis = normalize_axis(axis, data.ndim)
    if keep.size and keep[-1] >= data.shape[axis]:
        raise ValueError(f"condition selects index {keep[-1]} beyond axis {axis} of size {data.shape[axis]}")
    return xp.take(data, keep, axis=axis)


@op("NonZero", *versions("NonZero"))
def non_zero(x: Value) -> np.ndarray:
    values = static(x, "X")
    # A scalar has no coordinates: shape (0, nnz), as shape inference's (rank, nnz) says.
    found = np.stack(np.nonzero(np.atleast_1d(values)))[: values.ndim]
    return found.astype(np.int64)


@op("Unique", *versions("Unique"))
def unique(x: Value, *, axis: int | None = None, sorted: int = 1) -> tuple[np.ndarray, ...]:  # noqa: A002
    values = static(x, "X")
    if axis is None:
        values, axis = values.reshape(-1), 0
    axis = normalize_axis(axis, values.ndim)
    # ml_dtypes floats (bfloat16...) widen exactly to float32, which NumPy's sort-based unique understands.
    keys = values.astype(np.float32) if is_float(values.dtype) and values.dtype.kind != "f" else values
    _, first, inverse, counts = np.unique(keys, return_index=True, return_inverse=True, return_counts=True, axis=axis)
    inverse = inverse.reshape(-1)
    if not sorted:
        order = np.argsort(first, kind="stable")
        first, counts, inverse = first[order], counts[order], np.argsort(order)[inverse]
    as_int64 = lambda a: np.asarray(a, dtype=np.int64)  # noqa: E731
    return np.take(values, first, axis=axis), as_int64(first), as_int64(inverse), as_int64(counts)


@op("ReverseSequence", *versions("ReverseSequence"))
def reverse_sequence(
    input: Value, sequence_lens: Value, *, batch_axis: int = 1, time_axis: int = 0  # noqa: A002 - ONNX's name
) -> Value:
    if {batch_axis, time_axis} != {0, 1}:
        raise ValueError(f"batch_axis and time_axis must be 0 and 1 in some order, got {batch_axis}, {time_axis}")
    xp = _xp(input)
    data = xp.asarray(input)
    time = xp.arange(data.shape[time_axis]).reshape((-1, 1) if time_axis == 0 else (1, -1))
    lengths = xp.asarray(_host(sequence_lens, "sequence_lens", xp), dtype=np.int64)
    lengths = lengths.reshape((1, -1) if time_axis == 0 else (-1, 1))
    source = xp.where(time < lengths, lengths - 1 - time, time)
    source = xp.broadcast_to(source.reshape(source.shape + (1,) * (data.ndim - 2)), data.shape)
    return xp.take_along_axis(data, source, axis=time_axis)
