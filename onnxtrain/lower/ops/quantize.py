"""Linear quantization: QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear and QLinearMatMul.

A scale (and zero point) is per tensor (a scalar or a one-element vector), per axis (a vector along `axis`) or
blocked (the input's rank, `axis` shrunk by `block_size`); `_spread` turns each form into a tensor that
broadcasts against the input. Conversions to float8/float4/float6 go through Cast's own conversion, which knows
float8 saturation and keeps the 6-bit floats XLA has no type for on the host.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import onnx
from jax import lax

from ...dtypes import is_float, np_dtype, onnx_type
from .cast import cast
from ..registry import op, versions
from ..values import to_static

Array = Any  # a jax array or a NumPy array (static value)
T = onnx.TensorProto


def _spread(param: Array, shape: tuple[int, ...], axis: int, block_size: int, what: str) -> Array:
    """`param` (a scale or zero point) laid out to broadcast against an input of `shape`."""
    if np.size(param) == 1 and np.ndim(param) <= 1:
        return jnp.reshape(param, ())
    rank = len(shape)
    if not -rank <= axis < rank:
        raise ValueError(f"axis {axis} is out of range for an input of rank {rank}")
    axis %= rank
    if block_size <= 0:
        if np.shape(param) != (shape[axis],):
            raise ValueError(
                f"per-axis {what} must be a vector of length {shape[axis]} (input axis {axis}), got shape "
                f"{np.shape(param)}; blocked quantization needs a positive block_size"
            )
        return jnp.reshape(param, tuple(-1 if d == axis else 1 for d in range(rank)))
    blocks = -(-shape[axis] // block_size)
    expected = shape[:axis] + (blocks,) + shape[axis + 1 :]
    if np.shape(param) != expected:
        raise ValueError(
            f"blocked {what} must have shape {expected} (input {shape}, axis {axis}, block_size {block_size}), "
            f"got {np.shape(param)}"
        )
    return lax.slice_in_dim(jnp.repeat(param, block_size, axis=axis), 0, shape[axis], axis=axis)


def _exact_float(dtype: np.dtype) -> np.dtype:
    """A float type that holds every value of `dtype`: int32 needs float64, float8e8m0's range float32."""
    dtype = np.dtype(dtype)
    if not is_float(dtype):
        return np.dtype(np.float64)
    return np.dtype(np.float32) if dtype.itemsize == 1 else dtype


def _quantized_type(zero_point: Array | None, output_dtype: int) -> int:
    if zero_point is None:
        return output_dtype or T.UINT8
    found = onnx_type(np.dtype(zero_point.dtype))
    if output_dtype and output_dtype != found:
        raise ValueError(
            f"output_dtype {T.DataType.Name(output_dtype)} differs from y_zero_point's type {T.DataType.Name(found)}"
        )
    return found


def quantize_linear(
    x: Array,
    y_scale: Array,
    y_zero_point: Array | None = None,
    *,
    axis: int = 1,
    saturate: int = 1,
    block_size: int = 0,
    output_dtype: int = 0,
    precision: int = 0,
) -> Array:
    target = _quantized_type(y_zero_point, output_dtype)
    shape = np.shape(x)
    # The division runs in `precision` when given, else in a type wide enough for both operands (NumPy's rule,
    # which ONNX's reference follows: float32 x over a float16 scale divides in float32).
    if precision:
        wide = np_dtype(precision)
    else:
        wide = jnp.promote_types(_exact_float(x.dtype), _exact_float(y_scale.dtype))
    scaled = jnp.asarray(x).astype(wide) / _spread(y_scale, shape, axis, block_size, "y_scale").astype(wide)
    zero = None if y_zero_point is None else _spread(y_zero_point, shape, axis, block_size, "y_zero_point")
    return _requantize(scaled, zero, target, saturate)


def _requantize(scaled: Array, zero: Array | None, target: int, saturate: int = 1) -> Array:
    """saturate(round(scaled) + zero) for integer targets; float targets add the zero point and convert."""
    dtype = np_dtype(target)
    if not is_float(dtype):
        bounds = ml_dtypes.iinfo(dtype)
        # Rounded, then moved to a float that holds every integer of the target range and its zero points.
        rounded = jnp.round(scaled)
        rounded = rounded.astype(jnp.promote_types(rounded.dtype, np.float32))
        if zero is not None:
            rounded = rounded + jnp.asarray(zero).astype(rounded.dtype)
        return jnp.clip(rounded, bounds.min, bounds.max).astype(dtype)
    if zero is not None:
        scaled = scaled + cast(zero, onnx_type(np.dtype(scaled.dtype)))
    # to_static: a value computed at trace time must reach Cast's host-only conversions (float6) as NumPy.
    return cast(to_static(scaled), target, saturate)


def dequantize_linear(
    x: Array,
    x_scale: Array,
    x_zero_point: Array | None = None,
    *,
    axis: int = 1,
    block_size: int = 0,
    output_dtype: int = 0,
) -> Array:
    if output_dtype:
        out = np_dtype(output_dtype)
    elif np.dtype(x_scale.dtype).itemsize > 1:
        out = np.dtype(x_scale.dtype)
    else:
        raise ValueError(f"x_scale of type {np.dtype(x_scale.dtype)} needs the output_dtype attribute")
    if x_zero_point is not None and np.dtype(x_zero_point.dtype) != np.dtype(x.dtype):
        raise ValueError(f"x_zero_point has type {np.dtype(x_zero_point.dtype)}, x has {np.dtype(x.dtype)}")
    shape = np.shape(x)
    # Integers subtract exactly in an integer type first; the product is taken in float32 (float64 for int32
    # inputs, which float32 would round) and rounded once to the output type.
    if is_float(x.dtype):
        wide = np.dtype(np.float32)
        shifted = cast(x, T.FLOAT)
        if x_zero_point is not None:
            shifted = shifted - _spread(cast(x_zero_point, T.FLOAT), shape, axis, block_size, "x_zero_point")
    else:
        exact = np.int64 if np.dtype(x.dtype).itemsize >= 4 else np.int32
        wide = np.dtype(np.float64 if exact == np.int64 else np.float32)
        shifted = jnp.asarray(x).astype(exact)
        if x_zero_point is not None:
            shifted = shifted - _spread(x_zero_point, shape, axis, block_size, "x_zero_point").astype(exact)
        shifted = shifted.astype(wide)
    scale = _spread(x_scale, shape, axis, block_size, "x_scale").astype(jnp.promote_types(wide, _exact_float(out)))
    return (shifted * scale).astype(out)


for _name, _fn in (("QuantizeLinear", quantize_linear), ("DequantizeLinear", dequantize_linear)):
    # Every version computes the same thing; later ones only add attributes (axis, saturate, block_size,
    # output_dtype, precision) whose defaults reproduce the earlier behaviour, and absent ones keep them.
    op(_name, *versions(_name))(_fn)


@op("DynamicQuantizeLinear", *versions("DynamicQuantizeLinear"))
def dynamic_quantize_linear(x: Array) -> tuple[Array, Array, Array]:
    """uint8 quantization over a range stretched to include zero, so that zero is exactly representable."""
    x = jnp.asarray(x)
    low, high = jnp.min(x, initial=0.0), jnp.max(x, initial=0.0)
    scale = jnp.where(high == low, 1.0, high - low).astype(x.dtype) / 255  # an all-zero input keeps a usable scale
    zero_point = jnp.round(jnp.clip(-low / scale, 0, 255))
    y = jnp.clip(jnp.round(x / scale) + zero_point, 0, 255)
    return y.astype(np.uint8), scale, zero_point.astype(np.uint8)


def _per_row(param: Array, rank: int) -> Array:
    """A's scale or zero point as a vector holds one value per row: it must broadcast along the columns."""
    return jnp.reshape(param, (-1, 1)) if np.ndim(param) == 1 and rank >= 2 else param


def _centered(values: Array, zero_point: Array, exact: Any) -> Array:
    return jnp.asarray(values).astype(exact) - jnp.asarray(zero_point).astype(exact)


def qlinear_matmul(
    a: Array,
    a_scale: Array,
    a_zero_point: Array,
    b: Array,
    b_scale: Array,
    b_zero_point: Array,
    y_scale: Array,
    y_zero_point: Array,
) -> Array:
    rank = np.ndim(a)
    a_scale, a_zero_point = _per_row(a_scale, rank), _per_row(a_zero_point, rank)
    floats = is_float(a.dtype) or is_float(b.dtype)
    if floats:  # float8 operands
        a_ = _centered(cast(a, T.FLOAT), cast(a_zero_point, T.FLOAT), np.float32)
        b_ = _centered(cast(b, T.FLOAT), cast(b_zero_point, T.FLOAT), np.float32)
        product = jnp.matmul(a_, b_)
    else:  # integer operands accumulate exactly in int32, as the spec allows
        a_ = _centered(a, a_zero_point, np.int32)
        b_ = _centered(b, b_zero_point, np.int32)
        product = jnp.matmul(a_, b_, preferred_element_type=np.int32)
    # The requantization factor is formed in the scales' own type (as ONNX's reference does), then applied in
    # float32.
    factor = (jnp.asarray(a_scale) * jnp.asarray(b_scale) / jnp.asarray(y_scale)).astype(np.float32)
    return _requantize(product.astype(np.float32) * factor, y_zero_point, onnx_type(np.dtype(y_zero_point.dtype)))


op("QLinearMatMul", *versions("QLinearMatMul"))(qlinear_matmul)
