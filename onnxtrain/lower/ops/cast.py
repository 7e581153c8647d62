"""Cast, CastLike and BitCast across every ONNX element type JAX can hold.

Numeric casts are XLA converts, with the ONNX rules XLA does not apply by itself: float8 saturation, FLOAT8E8M0's
rounding modes, and wrap-around for float -> 4/2-bit integers (as ml_dtypes does). Strings, and the 6-bit floats
XLA has no type for, are converted on the host, so those inputs must be static.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import onnx
from jax import lax

from ...dtypes import HOST_ONLY_DTYPES, is_float, np_dtype, onnx_type
from ..registry import op, versions
from ..values import static

T = onnx.TensorProto

SATURATING_FLOAT8 = {T.FLOAT8E4M3FN, T.FLOAT8E4M3FNUZ, T.FLOAT8E5M2, T.FLOAT8E5M2FNUZ}
SUB_BYTE_INTEGERS = {T.INT4, T.UINT4, T.INT2, T.UINT2}
E8M0_ROUND_MODES = ("up", "down", "nearest")


def is_string(dtype: np.dtype) -> bool:
    return np.dtype(dtype).kind in "OUS"


def cast(x, to: int, saturate: int = 1, round_mode: str = "up"):
    target = np_dtype(to)
    if to == T.STRING:
        return numbers_to_strings(static(x, "input"))
    if is_string(x.dtype):
        return cast(strings_to_numbers(static(x, "input"), target), to, saturate, round_mode)
    if target in HOST_ONLY_DTYPES or np.dtype(x.dtype) in HOST_ONLY_DTYPES:
        return np.asarray(static(x, "input")).astype(target)
    if to == T.FLOAT8E8M0:
        return to_float8e8m0(x, bool(saturate), round_mode)
    if to in SATURATING_FLOAT8 and saturate:
        return clip_to_range(x, target).astype(target)
    if to in SUB_BYTE_INTEGERS and is_float(x.dtype):
        # Through int32 so out-of-range values wrap (as ml_dtypes does) instead of clamping (XLA's convert).
        return x.astype(np.int32).astype(target)
    return jnp.asarray(x).astype(target)


def clip_to_range(x, target: np.dtype):
    """Clamp to the target's finite range (NaN stays NaN), in a float type wide enough to hold the bounds."""
    wide = np.float64 if np.dtype(x.dtype).itemsize == 8 else np.float32
    info = ml_dtypes.finfo(target)
    return jnp.clip(jnp.asarray(x).astype(wide), float(info.min), float(info.max))


def to_float8e8m0(x, saturate: bool, round_mode: str):
    """FLOAT8E8M0 keeps only a float32's exponent field; the mantissa decides the rounding.

    Inf saturates to the largest power of two (or NaN without `saturate`), NaN stays NaN, and the sign is
    ignored (negative inputs are undefined by the spec).
    """
    if round_mode not in E8M0_ROUND_MODES:
        raise ValueError(f"unknown round_mode {round_mode!r}; expected one of {E8M0_ROUND_MODES}")
    bits = lax.bitcast_convert_type(jnp.asarray(x).astype(np.float32), np.uint32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    if round_mode == "up":
        bump = mantissa != 0
    elif round_mode == "nearest":
        # Half-way rounds up except for subnormals, whose exponent field is already 0.
        bump = (mantissa >= 0x400000) & ((mantissa != 0x400000) | (exponent > 0))
    else:
        bump = jnp.zeros_like(mantissa, dtype=bool)
    largest = 0xFE
    finite = exponent != 0xFF
    if saturate:
        bump = bump & (exponent < largest)
    rounded = jnp.where(finite, exponent + bump.astype(np.uint32), 0xFF)
    if saturate:
        is_inf = (~finite) & (mantissa == 0)
        rounded = jnp.where(is_inf, largest, rounded)
    return lax.bitcast_convert_type(rounded.astype(np.uint8), ml_dtypes.float8_e8m0fnu)


def numbers_to_strings(x: np.ndarray) -> np.ndarray:
    """Numbers in NumPy's shortest round-trip form ('0.1', '1e-07', 'inf', 'nan'), as an object array."""
    if np.dtype(x.dtype).kind == "V":  # ml_dtypes floats print through float32, which holds them exactly
        x = x.astype(np.float32)
    return np.asarray(x.astype(np.str_), dtype=object)


def parse_number(text: str | bytes, integral: bool) -> float | int:
    text = text.decode("utf-8") if isinstance(text, bytes) else str(text)
    if integral:
        try:
            return int(text)  # exact for 64-bit values a float would round
        except ValueError:
            pass
    # float() reads plain and scientific forms and, case-insensitively, INF, +INF, -INF and NaN.
    return float(text)


def strings_to_numbers(x: np.ndarray, target: np.dtype) -> np.ndarray:
    integral = np.issubdtype(target, np.integer)
    values = [parse_number(s, integral) for s in x.reshape(-1).tolist()]
    if values and all(isinstance(v, int) for v in values):
        unsigned = target == np.uint64 and min(values) >= 0
        return np.asarray(values, dtype=np.uint64 if unsigned else np.int64).reshape(x.shape)
    return np.asarray(values, dtype=np.float64).reshape(x.shape)


@op("Cast", *versions("Cast", since=6))
def cast_op(x, *, to: int, saturate: int = 1, round_mode: str = "up"):
    return cast(x, to, saturate, round_mode)


@op("Cast", 1)
def cast_v1(x, *, to: str):
    """Opset 1 named the target type ('FLOAT') instead of giving its enum value."""
    return cast(x, T.DataType.Value(to.upper()))


@op("CastLike", *versions("CastLike"))
def cast_like(x, target_type, *, saturate: int = 1, round_mode: str = "up"):
    return cast(x, onnx_type(np.dtype(target_type.dtype)), saturate, round_mode)


@op("BitCast", *versions("BitCast"))
def bit_cast(x, *, to: int):
    source, target = np.dtype(x.dtype), np_dtype(to)
    if is_string(source) or is_string(target):
        raise ValueError("BitCast does not take strings")
    if bit_width(source) != bit_width(target):
        raise ValueError(f"cannot bitcast {source} ({bit_width(source)} bits) to {target} ({bit_width(target)} bits)")
    return jnp.asarray(x).view(target)


def bit_width(dtype: np.dtype) -> int:
    if dtype.kind != "V":  # NumPy's own types, bool and complex included
        return dtype.itemsize * 8
    try:
        return ml_dtypes.finfo(dtype).bits
    except ValueError:
        return ml_dtypes.iinfo(dtype).bits
