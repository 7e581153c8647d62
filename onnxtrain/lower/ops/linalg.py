"""Matrix products and determinants."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from ..autocast import low_precision, product_result
from ..registry import register
from ..target import target_platform
from ..values import Array
from .elementwise import BINARY


def matmul(a: Array, b: Array) -> Array:
    """NumPy matmul semantics (1-D operands promoted and squeezed, batch dims broadcast)."""
    (a, b), accumulate = low_precision(a, b)
    if jnp.ndim(a) >= 2 and jnp.ndim(b) == 2:
        # Activations [..., K] times a weight [K, N] as one 2-D product: XLA-CPU otherwise lowers the weight
        # gradient of the batched form to many small dots plus a transposed copy (~10% of a transformer step).
        flat = jnp.reshape(a, (-1, a.shape[-1]))
        if accumulate is not None:  # mixed precision: see _product_backward
            flat = weight_product(flat, b, accumulate)
        else:
            flat = jnp.matmul(flat, b, preferred_element_type=accumulate)
        return product_result(jnp.reshape(flat, (*a.shape[:-1], b.shape[-1])), a, accumulate)
    return product_result(jnp.matmul(a, b, preferred_element_type=accumulate), a, accumulate)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def weight_product(a: Array, b: Array, accumulate: jnp.dtype | None) -> Array:
    """a [M, K] @ b [K, N], differentiated with the products XLA-CPU runs fastest (`_product_backward`)."""
    return jnp.matmul(a, b, preferred_element_type=accumulate)


def _product_forward(a: Array, b: Array, accumulate: jnp.dtype | None) -> tuple[Array, tuple[Array, Array]]:
    return weight_product(a, b, accumulate), (a, b)


def _product_backward(accumulate: jnp.dtype | None, residuals: tuple[Array, Array], g: Array) -> tuple[Array, Array]:
    """Under mixed precision: b's gradient a^T g, on the CPU with a^T copied row-major first. XLA-CPU converts
    both operands of a low-precision product contracting their leading axes to float32, ~5x slower than the
    row-major form in bfloat16 (BERT's [256, 768] x [256, 3072]: 4.9 against 1.05 ms), and its layout
    assignment folds a plain transpose back into the slow form: the optimization barrier keeps the copy.
    BERT-base's bfloat16 train step went from 709 to 417 ms. (In float32 the same form ran 15% faster alone but
    made BERT's float32 step 4% slower, so float32 products keep JAX's own gradient.) The gradient enters both
    products in the operands' type, as torch.autocast computes the backward products in bfloat16 too."""
    a, b = residuals
    g = g.astype(a.dtype)
    da = lax.dot_general(g, b, (((1,), (1,)), ((), ())), preferred_element_type=accumulate)
    a_t = a.T
    if target_platform() == "cpu":
        a_t = jnp.reshape(lax.optimization_barrier(jnp.reshape(a_t, (-1,))), a_t.shape)
    db = jnp.matmul(a_t, g, preferred_element_type=accumulate)
    return da.astype(a.dtype), db.astype(b.dtype)


weight_product.defvjp(_product_forward, _product_backward)


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
        y = BINARY["Add"](y, c * beta if beta != 1 else c)  # ONNX's Add: a bias's gradient sums in float32
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
    product = jnp.einsum(explicit_equation(equation, [jnp.ndim(x) for x in inputs]), *inputs,
                         preferred_element_type=accumulate)
    return product_result(product, inputs[0], accumulate)


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
