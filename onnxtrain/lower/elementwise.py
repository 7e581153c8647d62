"""Elementwise math: one table of unary ops, one of binary ops (NumPy-style broadcasting, opset >= 7)."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from .registry import op, versions


def _sign_preserving_round(x):
    return jnp.round(x)  # ONNX Round is round-half-to-even, as jnp.round


UNARY: dict[str, tuple[Callable, int]] = {
    # name: (function, first since_version with today's semantics)
    "Abs": (jnp.abs, 6),
    "Neg": (jnp.negative, 6),
    "Exp": (jnp.exp, 6),
    "Log": (jnp.log, 6),
    "Sqrt": (jnp.sqrt, 6),
    "Reciprocal": (jnp.reciprocal, 6),
    "Floor": (jnp.floor, 6),
    "Ceil": (jnp.ceil, 6),
    "Round": (_sign_preserving_round, 11),
    "Sign": (jnp.sign, 9),
    "Sin": (jnp.sin, 7),
    "Cos": (jnp.cos, 7),
    "Tan": (jnp.tan, 7),
    "Asin": (jnp.arcsin, 7),
    "Acos": (jnp.arccos, 7),
    "Atan": (jnp.arctan, 7),
    "Sinh": (jnp.sinh, 9),
    "Cosh": (jnp.cosh, 9),
    "Asinh": (jnp.arcsinh, 9),
    "Acosh": (jnp.arccosh, 9),
    "Atanh": (jnp.arctanh, 9),
    "Tanh": (jnp.tanh, 6),
    "Sigmoid": (jax.nn.sigmoid, 6),
    "Relu": (jax.nn.relu, 6),
    "Erf": (jax.scipy.special.erf, 9),
    "Not": (jnp.logical_not, 1),
    "IsNaN": (jnp.isnan, 9),
    "Softsign": (jax.nn.soft_sign, 1),
    "BitwiseNot": (jnp.bitwise_not, 18),
}

BINARY: dict[str, tuple[Callable, int]] = {
    "Add": (jnp.add, 7),
    "Sub": (jnp.subtract, 7),
    "Mul": (jnp.multiply, 7),
    "And": (jnp.logical_and, 7),
    "Or": (jnp.logical_or, 7),
    "Xor": (jnp.logical_xor, 7),
    "Equal": (jnp.equal, 7),
    "Greater": (jnp.greater, 7),
    "Less": (jnp.less, 7),
    "GreaterOrEqual": (jnp.greater_equal, 12),
    "LessOrEqual": (jnp.less_equal, 12),
    "BitwiseAnd": (jnp.bitwise_and, 18),
    "BitwiseOr": (jnp.bitwise_or, 18),
    "BitwiseXor": (jnp.bitwise_xor, 18),
}


def _register_table(table: dict[str, tuple[Callable, int]]) -> None:
    for name, (fn, since) in table.items():
        op(name, *versions(name, since=since))(fn)


_register_table(UNARY)
_register_table(BINARY)
