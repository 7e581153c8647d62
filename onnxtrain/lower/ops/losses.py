"""Classification losses: NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss.

Both pick -input[n, target[n, d...], d...] per sample, weight it by weight[target] (0 where target is
`ignore_index`), then reduce: 'none' keeps the (N, d1, ...) losses, 'sum' adds them, 'mean' divides the sum by
the total weight (the count of non-ignored samples when there is no weight), as PyTorch does (every sample
ignored: a NaN mean whose gradient is zero, as PyTorch's).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..registry import op, versions

REDUCTIONS = ("none", "sum", "mean")


def class_loss(log_prob, target, weight=None, *, reduction: str, ignore_index: int | None):
    """The reduced loss of `log_prob` (N, C, d...) against `target` (N, d...), in `log_prob`'s dtype."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if log_prob.ndim < 2 or target.shape != (log_prob.shape[0], *log_prob.shape[2:]):
        raise ValueError(f"target shape {tuple(target.shape)} does not fit input shape {tuple(log_prob.shape)}")
    dtype = jnp.promote_types(log_prob.dtype, jnp.float32)  # half-precision sums drift
    classes = log_prob.shape[1]
    # an ignored target may lie outside [0, C): clip it so the gathers stay in bounds, its weight is 0 anyway
    index = jnp.clip(target, 0, classes - 1).astype(jnp.int32)
    picked = jnp.take_along_axis(log_prob.astype(dtype), index[:, None], axis=1)[:, 0]
    sample_weight = jnp.ones(target.shape, dtype) if weight is None else jnp.take(weight.astype(dtype), index)
    valid = (target >= 0) & (target < classes)
    if ignore_index is not None:
        sample_weight = jnp.where(target == ignore_index, jnp.zeros((), dtype), sample_weight)
        valid |= target == ignore_index
    # any other target outside [0, C) has no loss (ONNX Runtime and PyTorch raise): NaN, not the clipped class's
    # loss, so a label that does not fit the classes shows in the loss instead of training toward class C - 1
    picked = jnp.where(valid, picked, jnp.full((), jnp.nan, dtype))
    losses = -picked * sample_weight
    if reduction == "none":
        total = losses
    elif reduction == "sum":
        total = jnp.sum(losses)
    else:
        # every sample ignored: torch's 0 / 0, a NaN loss, yet a zero gradient (its backward writes nothing for
        # ignored samples), where 1 / 0 times their zero gradients made it NaN, and an update made the weights NaN
        count = jnp.sum(sample_weight)
        empty = count == 0
        total = (jnp.sum(losses) / jnp.where(empty, jnp.ones((), dtype), count)
                 + jnp.where(empty, jnp.full((), jnp.nan, dtype), jnp.zeros((), dtype)))
    return total.astype(log_prob.dtype)


@op("NegativeLogLikelihoodLoss", *versions("NegativeLogLikelihoodLoss"))
def negative_log_likelihood_loss(input, target, weight=None, *, reduction, ignore_index=None):
    return class_loss(input, target, weight, reduction=reduction, ignore_index=ignore_index)


@op("SoftmaxCrossEntropyLoss", *versions("SoftmaxCrossEntropyLoss"))
def softmax_cross_entropy_loss(scores, labels, weights=None, *, reduction, ignore_index=None):
    """Returns (loss, log_prob); log_prob is the optional second output."""
    dtype = jnp.promote_types(scores.dtype, jnp.float32)
    log_prob = jax.nn.log_softmax(scores.astype(dtype), axis=1)
    loss = class_loss(log_prob, labels, weights, reduction=reduction, ignore_index=ignore_index)
    return loss.astype(scores.dtype), log_prob.astype(scores.dtype)
