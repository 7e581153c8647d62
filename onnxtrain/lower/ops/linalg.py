"""Matrix products and determinants."""

from __future__ import annotations

import jax.numpy as jnp

from ..autocast import low_precision
from ..registry import register
from ..values import Array


def matmul(a: Array, b: Array) -> Array:
    """NumPy matmul semantics (1-D operands promoted and squeezed, batch dims broadcast)."""
    (a, b), accumulate = low_precision(a, b)
    if jnp.ndim(a) > 2 and jnp.ndim(b) == 2:
        # Activations [..., K] times a weight [K, N] as one 2-D product: XLA-CPU otherwise lowers the weight
        # gradient of the batched form to many small dots plus a transposed copy (~10% of a transformer step).
        flat = jnp.matmul(jnp.reshape(a, (-1, a.shape[-1])), b, preferred_element_type=accumulate)
        return jnp.reshape(flat, (*a.shape[:-1], b.shape[-1]))
    return jnp.matmul(a, b, preferred_element_type=accumulate)


def gemm(
    a: Array,
    b: Array,
    c: Array | None = None,
    *,
    alpha: float = 1.0,
    beta: float = 1.0,
    transA: int = 0,  # noqa: N803 - ONNX attribute names
    transB: int = 0,  # noqa: N803
    broadcast: int = 0,  # Gemm-1/6 only: C always broadcasts (unidirectionally) here, as from Gemm-7 on
) -> Array:
    dtype = jnp.result_type(a)
    y = matmul(jnp.transpose(a) if transA else a, jnp.transpose(b) if transB else b)
    if alpha != 1:
        y = y * alpha
    if c is not None and beta != 0:  # as BLAS: with beta = 0, C is not read (its NaNs do not leak in)
        y = y + (c * beta if beta != 1 else c)
    return y.astype(dtype)  # integer Gemm with a fractional alpha/beta stays integer


def matmul_integer(a: Array, b: Array, a_zero_point: Array | None = None, b_zero_point: Array | None = None) -> Array:
    """int32 products of zero-point-shifted 8-bit operands. A 1-D a_zero_point holds one zero point per row
    of A, a 1-D b_zero_point one per column of B."""
    a = jnp.asarray(a, jnp.int32)
    b = jnp.asarray(b, jnp.int32)
    if a_zero_point is not None:
        zero = jnp.asarray(a_zero_point, jnp.int32)
        a = a - (jnp.reshape(zero, (-1, 1)) if jnp.ndim(zero) == 1 and jnp.ndim(a) >= 2 else zero)
    if b_zero_point is not None:
        b = b - jnp.asarray(b_zero_point, jnp.int32)
    return jnp.matmul(a, b, preferred_element_type=jnp.int32)


def einsum(*inputs: Array, equation: str) -> Array:
    # one operand is a transposition or a reduction, not a product: float32 as the other reductions
    inputs, accumulate = low_precision(*inputs) if len(inputs) > 1 else (inputs, None)
    return jnp.einsum(explicit_equation(equation, [jnp.ndim(x) for x in inputs]), *inputs,
                      preferred_element_type=accumulate)


def explicit_equation(equation: str, ranks: list[int]) -> str:
    """The equation with its right-hand side written out: ONNX's implicit output is the ellipsis first, then
    the letters used exactly once in ASCII order (upper case before lower case). Spaces are dropped."""
    equation = equation.replace(" ", "")
    if "->" in equation:
        return equation
    terms = equation.split(",")
    if len(terms) != len(ranks):
        raise ValueError(f"equation {equation!r} has {len(terms)} operand terms, the node has {len(ranks)} inputs")
    letters = "".join(term.replace("...", "") for term in terms)
    once = sorted(letter for letter in set(letters) if letters.count(letter) == 1)
    ellipsis = "..." if "..." in equation else ""
    return f"{equation}->{ellipsis}{''.join(once)}"


def det(x: Array) -> Array:
    """Determinants of the trailing square matrices; LU runs in at least float32 (no float16 LU in XLA)."""
    dtype = jnp.result_type(x)
    wide = jnp.promote_types(dtype, jnp.float32)
    return jnp.linalg.det(jnp.asarray(x, wide)).astype(dtype)


register("MatMul", matmul)
register("Gemm", gemm)
register("MatMulInteger", matmul_integer)
register("Einsum", einsum)
register("Det", det)
