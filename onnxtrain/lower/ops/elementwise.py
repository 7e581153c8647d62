"""Elementwise math: tables of unary, binary and variadic ops, plus the ops that need more than one jnp call.

Every op is registered for its whole schema history. Versions before 7 mostly differ only in legacy attributes:
`consumed_inputs` (an in-place hint, meaningless here) and the binary ops' `broadcast`/`axis`, where the
second operand lines up with the first starting at `axis` instead of at the trailing dimension:
registry.register adapts them.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ...dtypes import HALF_FLOAT_DTYPES
from ..registry import register
from ..values import Array, is_static, is_text


def _same_dtype(fn: Callable) -> Callable:
    """`fn` with its result cast back to the input's dtype, for ops whose output type is their input type but
    whose jnp function promotes (erf of an integer, for one)."""

    def impl(x: Array) -> Array:
        return jnp.asarray(fn(x)).astype(jnp.result_type(x))

    impl.__name__ = getattr(fn, "__name__", "unary")
    return impl


UNARY: dict[str, Callable] = {
    "Abs": jnp.abs,
    "Neg": jnp.negative,
    "Exp": jnp.exp,
    "Log": jnp.log,
    "Sqrt": jnp.sqrt,
    "Reciprocal": jnp.reciprocal,
    "Floor": jnp.floor,
    "Ceil": jnp.ceil,
    "Round": jnp.round,  # round half to even, as ONNX specifies
    "Sign": jnp.sign,
    "Sin": jnp.sin,
    "Cos": jnp.cos,
    "Tan": jnp.tan,
    "Asin": jnp.arcsin,
    "Acos": jnp.arccos,
    "Atan": jnp.arctan,
    "Sinh": jnp.sinh,
    "Cosh": jnp.cosh,
    "Asinh": jnp.arcsinh,
    "Acosh": jnp.arccosh,
    "Atanh": jnp.arctanh,
    "Tanh": jnp.tanh,
    "Sigmoid": jax.nn.sigmoid,
    "Relu": jax.nn.relu,
    "Erf": jax.scipy.special.erf,
    "Softsign": jax.nn.soft_sign,
    "Not": jnp.logical_not,
    "BitwiseNot": jnp.bitwise_not,
}


def broadcast_in_float32(fn: Callable) -> Callable:
    """`fn` (+, -, *, /) of two float16/bfloat16 operands of which one is broadcast computed in float32 and rounded
    to their type: the same values (float32 holds more than twice their digits, so rounding twice rounds as once),
    but the broadcast operand's gradient, a sum over the axes it was broadcast along, accumulates in float32, as
    torch's does. JAX transposes the broadcast into a sum in the gradient's own type, which XLA-CPU accumulates in
    bfloat16 for short sums: a bfloat16 Linear's bias gradient over 8 rows had 3.4x the error of a rounded exact
    sum, and a module `.to(torch.bfloat16)` trained farther from float64 than PyTorch."""

    def impl(a: Array, b: Array) -> Array:
        dtype = jnp.result_type(a)
        if (dtype in HALF_FLOAT_DTYPES and jnp.result_type(b) == dtype and jnp.shape(a) != jnp.shape(b)
                and not is_static(a, b)):
            return fn(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)).astype(dtype)
        return fn(a, b)

    impl.__name__ = getattr(fn, "__name__", "binary")
    return impl


BINARY: dict[str, Callable] = {
    "Add": broadcast_in_float32(jnp.add),
    "Sub": broadcast_in_float32(jnp.subtract),
    "Mul": broadcast_in_float32(jnp.multiply),
    "And": jnp.logical_and,
    "Or": jnp.logical_or,
    "Xor": jnp.logical_xor,
    "BitwiseAnd": jnp.bitwise_and,
    "BitwiseOr": jnp.bitwise_or,
    "BitwiseXor": jnp.bitwise_xor,
}


def _comparison(device: Callable, host: Callable) -> Callable:
    """String tensors never reach XLA (they are always static NumPy arrays): compare them on the host."""

    def compare(a: Array, b: Array) -> Array:
        if is_text(a) or is_text(b):
            return np.asarray(host(np.asarray(a, dtype=object), np.asarray(b, dtype=object)), dtype=bool)
        return device(a, b)

    compare.__name__ = device.__name__
    return compare


COMPARISONS: dict[str, tuple[Callable, Callable]] = {
    "Equal": (jnp.equal, np.equal),
    "Greater": (jnp.greater, np.greater),
    "Less": (jnp.less, np.less),
    "GreaterOrEqual": (jnp.greater_equal, np.greater_equal),
    "LessOrEqual": (jnp.less_equal, np.less_equal),
}


def _is_integer(x: Array) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.integer)


@broadcast_in_float32
def div(a: Array, b: Array) -> Array:
    if _is_integer(a):  # C semantics: the quotient truncates toward zero
        return jax.lax.div(*jnp.broadcast_arrays(a, b))
    return jnp.divide(a, b)


def pow_(x: Array, y: Array) -> Array:
    """The exponent may have another type than the base; the result has the base's type. A float base raised to
    a static whole exponent (an exporter's x ** 3.0 in GELU, x ** 2.0 in RMS norms) is repeated multiplication,
    as PyTorch computes it, not XLA's exp-log pow (~10x the time on the CPU)."""
    if is_static(y) and np.size(y) == 1 and jnp.issubdtype(jnp.result_type(x), jnp.floating):
        whole = float(np.ravel(y)[0])
        if whole.is_integer() and abs(whole) <= 16:
            shape = jnp.broadcast_shapes(jnp.shape(x), np.shape(y))  # a [1] exponent broadcasts a 0-d base
            return lax.integer_pow(jnp.asarray(x), int(whole)).reshape(shape)
    return jnp.power(x, y).astype(jnp.result_type(x))


def bit_shift(x: Array, y: Array, *, direction: str) -> Array:
    """A shift by a negative amount or by the width or more keeps only the sign fill (XLA's semantics too)."""
    if direction == "LEFT":
        return jnp.left_shift(x, y)
    if direction == "RIGHT":
        return jnp.right_shift(x, y)  # arithmetic for signed types, logical for unsigned
    raise ValueError(f"direction must be 'LEFT' or 'RIGHT', got {direction!r}")


def mod(a: Array, b: Array, *, fmod: int = 0) -> Array:
    if fmod not in (0, 1):
        raise ValueError(f"fmod must be 0 or 1, got {fmod}")
    if fmod:
        return jnp.fmod(a, b)  # truncated: the sign of the dividend
    result = jnp.remainder(a, b)  # floored: the sign of the divisor
    if _is_integer(result):
        return result
    return jnp.where(result == 0, jnp.copysign(jnp.zeros_like(result), b), result)  # a zero takes b's sign too


def is_inf(x: Array, *, detect_negative: int = 1, detect_positive: int = 1) -> Array:
    positive = jnp.isposinf(x) if detect_positive else jnp.zeros(jnp.shape(x), bool)
    negative = jnp.isneginf(x) if detect_negative else jnp.zeros(jnp.shape(x), bool)
    return positive | negative


def clip(x: Array, low: Array | None = None, high: Array | None = None) -> Array:
    """Clip-11+: absent bounds do not clip; with low > high every element becomes high (max last).

    Selected, not jnp.maximum / jnp.minimum, for the gradient at a bound: those split a tie half and half, so an
    element exactly at a bound had passed half its gradient, where torch.clamp (and TensorFlow's clip_by_value,
    both exported as Clip) pass all of it: 1 for lo <= x <= hi, and a traced bound takes the gradient of the
    elements it replaces. (PyTorch's relu6 / hardtanh, exported as the same Clip, pass none at the bounds: the
    graph cannot tell them apart, docs/semantics.md.)"""
    dtype = jnp.result_type(x)
    if low is not None:
        low = jnp.asarray(low, dtype)
        x = jnp.where(x < low, low, x)
    if high is not None:
        high = jnp.asarray(high, dtype)
        x = jnp.where(x > high, high, x)
    return x


def clip_with_attributes(x: Array, *, min: float | None = None, max: float | None = None) -> Array:  # noqa: A002
    """Clip-1 and Clip-6 take the bounds as float attributes."""
    return clip(x, min, max)


def _variadic(fn: Callable) -> Callable:
    def fold(*inputs: Array) -> Array:
        return functools.reduce(fn, inputs)

    fold.__name__ = fn.__name__
    return fold


def mean(*inputs: Array) -> Array:
    dtype = jnp.result_type(inputs[0])
    return (functools.reduce(jnp.add, inputs) / len(inputs)).astype(dtype)


VARIADIC: dict[str, Callable] = {
    "Max": _variadic(jnp.maximum),  # NaN in any input gives NaN, as jnp.maximum does
    "Min": _variadic(jnp.minimum),
    "Sum": _variadic(jnp.add),
    "Mean": mean,
}

for _name, _fn in UNARY.items():
    register(_name, _same_dtype(_fn), elementwise=True)
for _name, _fn in BINARY.items():
    register(_name, _fn, binary=True, elementwise=True)
for _name, (_device, _host) in COMPARISONS.items():
    register(_name, _comparison(_device, _host), binary=True, elementwise=True)
for _name, _fn in VARIADIC.items():
    register(_name, _fn, elementwise=True)
register("Div", div, binary=True, elementwise=True)
register("Pow", pow_, binary=True, elementwise=True)
register("Mod", mod, elementwise=True)
register("BitShift", bit_shift, elementwise=True)
register("IsInf", is_inf, elementwise=True)
register("IsNaN", jnp.isnan, elementwise=True)
register("Clip", clip_with_attributes, until=10, elementwise=True)
register("Clip", clip, since=11, elementwise=True)
