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
from ..target import target_platform

REDUCTIONS = ("none", "sum", "mean")


def picked(values, index):
    """values[n, index[n, d...], d...]. On the CPU a gather. Elsewhere a sum over a one-hot select, which joins
    the kernels of the reductions beside it, and whose gradient (NegativeLogLikelihoodLoss's) is a select inside
    the next elementwise kernel where the gather's is a zeros kernel and a scatter: a GPU step of a small model
    is paced by its kernel launches (benchmarks/README.md). On the CPU the select's pass over (N, C) cost more
    than it saved (GPT-2's vocabulary over 256 tokens: 29 -> 37 ms for the loss and its gradient)."""
    if target_platform() == "cpu":
        return jnp.take_along_axis(values, index[:, None], axis=1)[:, 0]
    classes = jax.lax.broadcasted_iota(index.dtype, values.shape, 1)
    return jnp.sum(jnp.where(classes == index[:, None], values, jnp.zeros((), values.dtype)), axis=1)


@jax.custom_vjp
def label_log_softmax(scores, index):
    """log_softmax(scores, axis=1) at each sample's label: (N, d...) of (N, C, d...). Its value and gradient are
    torch's numbers (log_softmax's output and backward: a model trained to a small loss drifted from PyTorch's
    by 1e-4 when the logsumexp less the label's score computed it), but the (N, C, d...) log-softmax is never
    held: the gradient computes the softmax from the scores again, inside its one elementwise kernel, where
    log_softmax's gradient kept it until the backward pass, an LM head's largest temporary (GPT-2's vocabulary
    over 256 tokens: 51 MB; the loss and its gradient 41 -> 52 ms on 2 CPU cores, the exponentials computed
    twice), and the label's pick added a scatter."""
    return label_log_softmax_forward(scores, index)[0]


def label_log_softmax_forward(scores, index):
    # torch's order: the scores less their maximum, less the log of the sum of their exponentials (the label's
    # shifted score is exactly 0 where it is the maximum, so a small loss keeps its digits)
    shift = jnp.max(scores, axis=1, keepdims=True)
    log_sum = jnp.log(jnp.sum(jnp.exp(scores - shift), axis=1, keepdims=True))
    return (picked(scores, index) - shift[:, 0]) - log_sum[:, 0], (scores, index, shift, log_sum)


def label_log_softmax_backward(residuals, cotangent):
    scores, index, shift, log_sum = residuals
    cotangent = jnp.expand_dims(cotangent, 1)
    labels = jax.lax.broadcasted_iota(index.dtype, scores.shape, 1) == jnp.expand_dims(index, 1)
    # torch's log_softmax backward, for a gradient that is the cotangent at the label and 0 elsewhere
    softmax = jnp.exp(scores - shift - log_sum)
    return jnp.where(labels, cotangent, jnp.zeros((), scores.dtype)) - softmax * cotangent, None


label_log_softmax.defvjp(label_log_softmax_forward, label_log_softmax_backward)


def class_loss(log_prob, target, weight=None, *, reduction: str, ignore_index: int | None,
               log_softmax_of: bool = False):
    """The reduced loss of `log_prob` (N, C, d...) against `target` (N, d...), in `log_prob`'s dtype;
    `log_softmax_of`: `log_prob` holds scores, whose log-softmax it is (label_log_softmax)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    # the schema's Tind: class indices. torch.onnx's dynamo exporter writes cross_entropy against class
    # probabilities (float targets shaped as the scores) as this node too, which the shape check below had
    # reported as "target shape (N, C) does not fit input shape (N, C)"
    if not jnp.issubdtype(target.dtype, jnp.integer):
        raise ValueError(f"target is {target.dtype}, not class indices (int32 or int64): a target of class "
                         f"probabilities (torch's cross_entropy with a float target) is no loss of this op")
    if log_prob.ndim < 2 or target.shape != (log_prob.shape[0], *log_prob.shape[2:]):
        raise ValueError(f"target shape {tuple(target.shape)} does not fit input shape {tuple(log_prob.shape)}")
    dtype = jnp.promote_types(log_prob.dtype, jnp.float32)  # half-precision sums drift
    classes = log_prob.shape[1]
    # an ignored target may lie outside [0, C): clip it so the gathers stay in bounds, its weight is 0 anyway
    index = jnp.clip(target, 0, classes - 1).astype(jnp.int32)
    log_likelihood = (label_log_softmax if log_softmax_of else picked)(log_prob.astype(dtype), index)
    sample_weight = jnp.ones(target.shape, dtype) if weight is None else jnp.take(weight.astype(dtype), index)
    valid = (target >= 0) & (target < classes)
    if ignore_index is not None:
        sample_weight = jnp.where(target == ignore_index, jnp.zeros((), dtype), sample_weight)
        valid |= target == ignore_index
    # any other target outside [0, C) has no loss (ONNX Runtime and PyTorch raise): NaN, not the clipped class's
    # loss, so a label that does not fit the classes shows in the loss instead of training toward class C - 1
    log_likelihood = jnp.where(valid, log_likelihood, jnp.full((), jnp.nan, dtype))
    losses = -log_likelihood * sample_weight
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
    """Returns (loss, log_prob); log_prob is the optional second output (computed only where a node reads it)."""
    wide = scores.astype(jnp.promote_types(scores.dtype, jnp.float32))
    loss = class_loss(wide, labels, weights, reduction=reduction, ignore_index=ignore_index, log_softmax_of=True)
    return loss.astype(scores.dtype), jax.nn.log_softmax(wide, axis=1).astype(scores.dtype)
