"""Mixed precision (`load(..., mixed_precision="bfloat16" | "float16")`): torch.autocast's rule for ONNX graphs.

The float32 matrix products (MatMul, Gemm, Einsum, Conv, ConvTranspose, the two products of Attention) read
their operands rounded to the compute type, accumulate in float32 (`preferred_element_type`) and return their
result rounded to the compute type and widened to float32 (`product_result`), so every ONNX value keeps its
declared float32 type (on a GPU a convolution returns the compute type, converted to float32 right after; on the
CPU one XLA computes stays float32, and one computed as a product of its patches under bfloat16 reads rounded
operands and returns its float32 accumulation: lower/ops/conv.py says why). The weights therefore stay float32 (the
master copy: the rounding's gradient hands a float32 gradient back to the weight), and so do their gradients and
the optimizer state.
Everything else (softmax, normalizations, losses, reductions, the optimizer) computes in float32, as under
torch.autocast, where those ops are on its float32 list.

float16 has 5 exponent bits: a product's gradient below 6e-8 rounds to zero. The Gradient node therefore seeds
its backward pass with `loss_scale` instead of 1 and divides the float32 gradients by it (lower/ops/training.py).
The scale is static: no step is skipped and the scale never adapts (PyTorch's GradScaler does both), because
skipping would make a compiled step's state update depend on its values; a scale so large that a gradient
overflows shows as a non-finite loss or state, which `fit` reports (DivergenceError). bfloat16 has float32's
exponent range and needs no scale.

The option reaches the lowerings through the trace (`TraceContext.mixed_precision`); the walker makes it the
current one while it runs a graph's nodes (`autocasting`), so the product lowerings read it without taking the
node's context, which would exclude them from folding at load (folding.py).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Iterator

import jax.numpy as jnp
import onnx

from ..dtypes import HALF_FLOAT_TYPES, type_name
from ..errors import OptionError
from .values import is_static

COMPUTE_DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}
# float16's default: scaled by 2**12, a product operand's gradient stays above float16's smallest subnormal (6e-8)
# down to 1.5e-11 and finite up to 16 (65504 / 2**12), a range that covers a loss of order 1's gradients.
DEFAULT_LOSS_SCALE = 2.0**12


@dataclass(frozen=True)
class MixedPrecision:
    dtype: Any  # jnp.bfloat16 or jnp.float16: the type the float32 products compute in
    loss_scale: float = 1.0  # what the Gradient node seeds its backward pass with (float16 only)


def mixed_precision_of(name: str | None, loss_scale: float | None = None) -> MixedPrecision | None:
    """The options of `load` checked: OptionError naming the option and its allowed values otherwise."""
    if name is None:
        if loss_scale is not None:
            raise OptionError("loss_scale only applies with mixed_precision='float16'; mixed_precision is off")
        return None
    if name not in COMPUTE_DTYPES:
        raise OptionError(f"mixed_precision={name!r} is not one of {sorted(COMPUTE_DTYPES)} (or None)")
    if name != "float16":
        if loss_scale is not None:
            raise OptionError(f"loss_scale only applies with mixed_precision='float16' ({name} has float32's "
                              "exponent range and needs no scale)")
        return MixedPrecision(COMPUTE_DTYPES[name])
    scale = DEFAULT_LOSS_SCALE if loss_scale is None else loss_scale
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise OptionError(f"loss_scale={loss_scale!r} must be a finite number > 0")
    return MixedPrecision(COMPUTE_DTYPES[name], float(scale))


def check_master_weights(precision: MixedPrecision | None, model: onnx.ModelProto) -> None:
    """OptionError for mixed precision on a model whose weights are float16/bfloat16 (a module
    `.to(torch.bfloat16)` before its export, as Hugging Face fine-tunes): it has no float32 master weights and no
    float32 products to round, and computes in its weights' type already. The option had loaded and changed nothing
    (bfloat16), or scaled the loss of gradients that are float16 themselves, which overflow above 65504 / scale
    (float16: torch's GradScaler refuses them, "Attempting to unscale FP16 gradients"). The weights are the
    trained ones where the model trains (an exporter lifts a few float32 constants beside bfloat16 weights), else
    the float initializers. A float64 model's products are left as they are, as are half-precision products among
    float32 weights."""
    if precision is None:
        return
    trained = {b.key for info in model.training_info for b in info.update_binding}
    weights = [t for t in model.graph.initializer if t.name in trained] or model.graph.initializer
    types = {t.data_type for t in weights}
    half = sorted({type_name(t) for t in types & HALF_FLOAT_TYPES})
    if half and onnx.TensorProto.FLOAT not in types:
        raise OptionError(f"mixed_precision={jnp.dtype(precision.dtype).name!r}: the model's weights are "
                          f"{' and '.join(half)}, not float32 master copies, so it computes in their type already "
                          f"(as PyTorch trains a module after .to(torch.{half[0]})); load it without mixed_precision")


_ACTIVE: ContextVar[MixedPrecision | None] = ContextVar("onnxtrain_mixed_precision", default=None)


@contextmanager
def autocasting(precision: MixedPrecision | None) -> Iterator[None]:
    token = _ACTIVE.set(precision)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def product_result(y: Any, operand: Any, accumulate: Any) -> Any:
    """A product's result under mixed precision (`accumulate` from low_precision: not None) rounded to the compute
    type, `operand`'s (one of the rounded operands), as torch.autocast's products return it, and widened back to
    float32, the type the ONNX value declares; unchanged otherwise. What a step keeps for its backward pass of the
    ops that read a product (a GELU's input, a norm's) is then the compute type's rounding, which XLA stores as
    such, the widening fused into its readers: BERT-base's bfloat16 step at batch 32 planned 2203 MB of
    temporaries on an H200 with float32 results, 1881 MB so (its peak 2750 -> 2301-2413 MB, autocast's 2332),
    at the same speed and with losses within 3e-4 over 5 steps. The gradient reaching the product is rounded
    alike, as autocast's is."""
    if accumulate is None:
        return y
    return y.astype(jnp.result_type(operand)).astype(accumulate)


def low_precision(*operands: Any) -> tuple[tuple, Any]:
    """`(operands, accumulate)` for a product: under mixed precision, float32 operands rounded to the compute
    type, with float32 to accumulate in and return (the product's `preferred_element_type`). Unchanged, with
    None, otherwise: mixed precision off, an operand that is not float32 (float64, integers, already half), or
    constants alone (folded at load in float32, and so here as well)."""
    dtype = compute_dtype(*operands)
    if dtype is None:
        return operands, None
    return tuple(jnp.asarray(x).astype(dtype) for x in operands), jnp.float32


def compute_dtype(*operands: Any) -> Any:
    """The type low_precision rounds these product operands to (None: it leaves them as they are), for a product
    that rounds them itself, later (lower/ops/conv.py's patches)."""
    precision = _ACTIVE.get()
    if (precision is None or is_static(*operands)
            or any(jnp.result_type(x) != jnp.float32 for x in operands)):
        return None
    return precision.dtype
