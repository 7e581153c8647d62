"""Activation functions and the softmax family.

Each activation is one function of `x` and the op's attributes, registered for its whole schema history (the
`consumed_inputs` of version 1 is dropped by `register`). Float attributes are Python floats, which JAX treats
as weakly typed, so a float16 input stays float16.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from ..registry import register
from ..values import Array


def leaky_relu(x: Array, *, alpha: float = 0.01) -> Array:
    return jnp.where(x >= 0, x, alpha * x)


def elu(x: Array, *, alpha: float = 1.0) -> Array:
    return jnp.where(x >= 0, x, alpha * jnp.expm1(jnp.minimum(x, 0)))  # min keeps exp's overflow off the gradient


def selu(x: Array, *, alpha: float, gamma: float) -> Array:  # Selu-1 and Selu-6 default them differently
    return gamma * jnp.where(x > 0, x, alpha * jnp.expm1(jnp.minimum(x, 0)))


def celu(x: Array, *, alpha: float = 1.0) -> Array:
    return jnp.maximum(x, 0) + jnp.minimum(0, alpha * jnp.expm1(jnp.minimum(x, 0) / alpha))


def hard_sigmoid(x: Array, *, alpha: float = 0.2, beta: float = 0.5) -> Array:
    return jnp.clip(alpha * x + beta, 0, 1)


def hard_swish(x: Array) -> Array:
    return x * hard_sigmoid(x, alpha=1 / 6, beta=0.5)


def softplus(x: Array) -> Array:
    return jax.nn.softplus(x)


def thresholded_relu(x: Array, *, alpha: float = 1.0) -> Array:
    return jnp.where(x > alpha, x, jnp.zeros_like(x))


def shrink(x: Array, *, bias: float = 0.0, lambd: float = 0.5) -> Array:
    """Defined for integer types too: the shifted values are cast back to x's type."""
    dtype = jnp.result_type(x)
    shifted = jnp.where(x < -lambd, x + bias, x - bias).astype(dtype)
    return jnp.where((x < -lambd) | (x > lambd), shifted, jnp.zeros_like(x))


def gelu(x: Array, *, approximate: str = "none") -> Array:
    """The schema's formulas. The exact one is written with erf, as the schema and PyTorch's CPU kernel write it;
    jax.nn.gelu computes it through erfc, which XLA-CPU expands into three loop kernels around an exp (BERT-base's
    train step 707 -> 694 ms with erf, alternating in one process; [256, 3072] alone 0.64 -> 0.46 ms)."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    if approximate == "tanh":
        return jax.nn.gelu(x, approximate=True)
    x = jnp.asarray(x)
    return (x * (1 + lax.erf(x * jnp.asarray(math.sqrt(0.5), x.dtype))) * jnp.asarray(0.5, x.dtype)).astype(x.dtype)


def mish(x: Array) -> Array:
    return x * jnp.tanh(jax.nn.softplus(x))


def swish(x: Array, *, alpha: float = 1.0) -> Array:
    return x * jax.nn.sigmoid(alpha * x)


def prelu(x: Array, slope: Array) -> Array:
    """PRelu-7+: the slope broadcasts to x (unidirectionally)."""
    return jnp.where(x < 0, slope * x, x).astype(jnp.result_type(x))


def prelu_per_channel(x: Array, slope: Array) -> Array:
    """PRelu-1/6 follow Caffe2: a 1-D slope of x.shape[1] elements holds one slope per channel (axis 1)."""
    if jnp.ndim(slope) == 1 and jnp.ndim(x) > 2 and jnp.shape(slope)[0] == jnp.shape(x)[1] != 1:
        slope = jnp.reshape(slope, (-1,) + (1,) * (jnp.ndim(x) - 2))
    return prelu(x, slope)


ACTIVATIONS: dict[str, Callable] = {
    "LeakyRelu": leaky_relu,
    "Elu": elu,
    "Selu": selu,
    "Celu": celu,
    "HardSigmoid": hard_sigmoid,
    "HardSwish": hard_swish,
    "Softplus": softplus,
    "ThresholdedRelu": thresholded_relu,
    "Shrink": shrink,
    "Gelu": gelu,
    "Mish": mish,
    "Swish": swish,
}


def softmax(x: Array, axis: int) -> Array:
    return jax.nn.softmax(x, axis=axis)


def log_softmax(x: Array, axis: int) -> Array:
    return jax.nn.log_softmax(x, axis=axis)


def hardmax(x: Array, axis: int) -> Array:
    """One at the first maximum along `axis`, zero elsewhere."""
    return jax.nn.one_hot(jnp.argmax(x, axis=axis), jnp.shape(x)[axis], dtype=jnp.result_type(x), axis=axis)


NORMALIZERS: dict[str, Callable[[Array, int], Array]] = {
    "Softmax": softmax,
    "LogSoftmax": log_softmax,
    "Hardmax": hardmax,
}


def _along_axis(fn: Callable[[Array, int], Array]) -> Callable:
    """Version 13 on: normalize along the one axis `axis`."""

    def impl(x: Array, *, axis: int = -1) -> Array:
        return fn(x, axis)

    impl.__name__ = fn.__name__
    return impl


def _over_flattened_tail(fn: Callable[[Array, int], Array]) -> Callable:
    """Before version 13 the input is coerced to 2-D, [prod(shape[:axis]), prod(shape[axis:])], and normalized
    along its second dimension: all the dims from `axis` on are normalized together."""

    def impl(x: Array, *, axis: int = 1) -> Array:
        shape = jnp.shape(x)
        axis = axis + len(shape) if axis < 0 else axis  # as the coercion reads: axis == rank makes one column
        rows, columns = math.prod(shape[:axis]), math.prod(shape[axis:])
        return jnp.reshape(fn(jnp.reshape(x, (rows, columns)), 1), shape)

    impl.__name__ = f"{fn.__name__}_2d"
    return impl


for _name, _fn in ACTIVATIONS.items():
    register(_name, _fn, elementwise=True)
register("PRelu", prelu_per_channel, until=6)
register("PRelu", prelu, since=7, elementwise=True)  # the slope broadcasts unidirectionally to X
for _name, _fn in NORMALIZERS.items():
    register(_name, _over_flattened_tail(_fn), until=12)
    register(_name, _along_axis(_fn), since=13)
