"""Axis and index arguments: ONNX counts a negative axis, and a negative index along an axis, from the end."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .values import Value, is_static


def normalize_axis(axis: int, rank: int, what: str = "axis") -> int:
    """`axis` in [-rank, rank-1] as a non-negative index; a clear error outside that range."""
    if not -rank <= axis < rank:
        raise ValueError(f"{what} {axis} is out of range for a tensor of rank {rank}")
    return axis % rank


def wrap_indices(indices: Value, size: int | np.ndarray) -> Value:
    """Negative indices count from the end. `size` broadcasts against `indices` (one size per index column). Static
    indices outside [-size, size-1] are an IndexError; traced ones cannot be checked while tracing."""
    if is_static(indices):
        idx = np.asarray(indices)
        sizes = np.broadcast_to(np.asarray(size, dtype=np.int64), idx.shape)
        bad = (idx < -sizes) | (idx >= sizes)
        if bad.any():
            raise IndexError(f"index {idx[bad][0]} is out of range for an axis of size {sizes[bad][0]}")
        return np.where(idx < 0, idx + sizes, idx).astype(np.int64)
    return jnp.where(indices < 0, indices + jnp.asarray(size, dtype=indices.dtype), indices)
