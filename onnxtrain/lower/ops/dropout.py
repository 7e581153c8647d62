"""Dropout: the identity at inference; in training mode a Bernoulli keep-mask scaled by 1 / (1 - ratio).

Opsets 12+ take `ratio` and `training_mode` as inputs, so either may be traced: training mode then selects
between the two results at run time instead of forcing a recompilation. Without a `training_mode` input (and in
opsets before 12, which have none) the run decides: `train_step` drops, `infer` does not.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..registry import op, versions
from ..values import is_static


def drop(x, ratio, key):
    """(x * mask / (1 - ratio), mask) with mask ~ Bernoulli(1 - ratio); ratio may be traced."""
    keep = 1 - jnp.asarray(ratio, jnp.promote_types(x.dtype, jnp.float32))
    mask = jax.random.uniform(key, x.shape, keep.dtype) < keep
    # ratio == 1 keeps nothing; the guarded divisor keeps the (unused) scale finite
    scale = jnp.where(keep > 0, 1 / jnp.where(keep > 0, keep, 1), 0).astype(x.dtype)
    return jnp.where(mask, x * scale, jnp.zeros((), x.dtype)), mask


def identity(x):
    return x, jnp.ones(x.shape, jnp.bool_)


def dropout_if(training, x, ratio, key):
    """Dropout when `training` (a bool, or a traced bool scalar) holds; identity otherwise."""
    if is_static(training):
        return drop(x, ratio, key) if bool(training) else identity(x)
    dropped, mask = drop(x, ratio, key)
    training = jnp.reshape(training, ())
    return jnp.where(training, dropped, x), jnp.where(training, mask, True)


@op("Dropout", *versions("Dropout", since=12))
def dropout(data, ratio=None, training_mode=None, *, seed=None, ctx):
    ratio = 0.5 if ratio is None else ratio  # also when skipped as "" before a given training_mode
    training = ctx.trace.training if training_mode is None else training_mode
    if is_static(training, ratio) and (not bool(training) or float(ratio) == 0):
        return identity(data)
    return dropout_if(training, data, ratio, ctx.rng(seed))


@op("Dropout", *versions("Dropout", until=10))
def dropout_legacy(data, *, ratio, is_test=0, consumed_inputs=None, ctx):
    """Opsets 1-10: `ratio` is an attribute, `is_test` (1, 6) forces inference; the mask is `data`'s dtype
    before opset 10."""
    training = ctx.trace.training and not is_test and ratio > 0
    output, mask = dropout_if(training, data, ratio, ctx.rng())
    if ctx.node.since_version < 10:
        mask = mask.astype(data.dtype)
    return output, mask
