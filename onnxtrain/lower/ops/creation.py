"""Tensor creation: Constant, ConstantOfShape, Range and EyeLike build a tensor from attributes, a shape or
scalars. Their outputs' shapes come from values, so those values are read with `static()` and, where the whole
output is known, it is built on the host.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from ...dtypes import np_dtype
from ..registry import op, versions
from ..values import host_sized, static, static_ints


@op("Range", *versions("Range"))
def range_(start, limit, delta, *, stash_type: int | None = None):
    """Length is data-dependent, so the three scalars must be static and the range is built on the host;
    values are start + i * delta."""
    names = ("start", "limit", "delta")
    first, stop, step = (static(v, what).reshape(()) for v, what in zip((start, limit, delta), names))
    dtype = first.dtype
    if step == 0:
        raise ValueError("delta cannot be 0")
    if np.issubdtype(dtype, np.integer):
        count, compute = max(0, -((int(first) - int(stop)) // int(step))), np.int64
    else:
        count = max(0, math.ceil((float(stop) - float(first)) / float(step)))
        # Opset 27's stash_type sets the precision float16/bfloat16 ranges are computed in.
        low_precision = dtype.itemsize == 2
        compute = np_dtype(stash_type) if low_precision and stash_type is not None else np.float64
    host_sized([count], compute, "its steps")  # computed in a type at least as wide as the output's
    return (first.astype(compute) + np.arange(count, dtype=compute) * step.astype(compute)).astype(dtype)


@op("ConstantOfShape", *versions("ConstantOfShape"))
def constant_of_shape(shape_, *, value: np.ndarray | None = None) -> np.ndarray:
    # The output is a compile-time constant whatever the graph, so it is built on the host directly.
    fill = np.zeros((), np.float32) if value is None else np.asarray(value).reshape(())
    return np.full(host_sized(static_ints(shape_, "input"), fill.dtype), fill, dtype=fill.dtype)


CONSTANT_ATTRIBUTES = {
    # attribute: how its decoded value becomes the output tensor
    "value": np.asarray,
    "sparse_value": np.asarray,
    "value_float": lambda v: np.asarray(v, np.float32),
    "value_floats": lambda v: np.asarray(v, np.float32).reshape(-1),
    "value_int": lambda v: np.asarray(v, np.int64),
    "value_ints": lambda v: np.asarray(v, np.int64).reshape(-1),
    "value_string": lambda v: np.asarray(v, dtype=object),
    "value_strings": lambda v: np.asarray(list(v), dtype=object).reshape(-1),
}


@op("Constant", *versions("Constant"))
def constant(**attributes) -> np.ndarray:
    given = {k: v for k, v in attributes.items() if v is not None}
    unknown = set(given) - set(CONSTANT_ATTRIBUTES)
    if unknown or len(given) != 1:
        raise ValueError(f"exactly one of {sorted(CONSTANT_ATTRIBUTES)} must be set, got {sorted(given)}")
    (name, value), = given.items()
    return CONSTANT_ATTRIBUTES[name](value)


@op("EyeLike", *versions("EyeLike"))
def eye_like(data, *, k: int = 0, dtype: int | None = None):
    if data.ndim != 2:
        raise ValueError(f"expects a rank-2 input, got shape {tuple(data.shape)}")
    out_dtype = data.dtype if dtype is None else np_dtype(dtype)
    return jnp.eye(data.shape[0], data.shape[1], k=k, dtype=out_dtype)
