"""Normalization ops: batch, instance, layer, group, RMS, local-response, Lp and mean-variance normalization.

Statistics of half-precision inputs are computed in float32 (the spec asks for it in BatchNormalization-15 and
`stash_type` asks for it in the newer ops); every output is cast back to the dtype the spec gives it.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from ...dtypes import np_dtype
from ...errors import FeedError
from ...ir import Node
from ..axes import normalize_axis
from ..layout import CHANNELS_LAST, ChannelsLast, channels_last
from ..registry import op, versions
from ..target import target_platform


def statistics_dtype(dtype, stash_type: int | None = None) -> jnp.dtype:
    """The dtype statistics are computed in: the stash type (float32 if none), never below the input's."""
    stash = jnp.float32 if stash_type is None else np_dtype(stash_type)
    return jnp.promote_types(dtype, stash)


def standardize(x, axes: Sequence[int], epsilon: float, dtype):
    """(x - mean) * inv_std over `axes` in `dtype`; returns (normalized, mean, inv_std) with kept dims."""
    x = x.astype(dtype)
    mean = jnp.mean(x, axis=tuple(axes), keepdims=True)
    centered = x - mean
    variance = jnp.mean(centered * centered, axis=tuple(axes), keepdims=True)
    inv_std = lax.rsqrt(variance + jnp.asarray(epsilon, dtype))
    return centered * inv_std, mean, inv_std


def per_channel(v, rank: int):
    """A parameter of shape (C,) (or (C, D1, ..) for non-spatial BatchNormalization) shaped to broadcast
    against an (N, C, D1, ...) input."""
    return jnp.reshape(v, v.shape + (1,) * (rank - 1 - v.ndim))


# --- BatchNormalization ---------------------------------------------------------------------------------------


def channel_minor(v):
    """A statistic of shape (C,), or (C, D1, ...) for non-spatial BatchNormalization, shaped to broadcast
    against channels-last data (N, D1, ..., C)."""
    return jnp.moveaxis(v, 0, -1)


def accumulation_dtype(dtype) -> jnp.dtype:
    """What per-channel sums over a batch accumulate in: float64 for float32 data on CPU, as PyTorch's CPU kernels
    do (its float32 scale and bias gradients were 10-60x more accurate than float32 sums), where float64 adds
    cost little; the statistics dtype elsewhere (PyTorch's CUDA kernels sum in float32 too)."""
    wide = jnp.float64 if jax.config.read("jax_enable_x64") else jnp.float32
    return jnp.promote_types(dtype, wide) if target_platform() == "cpu" else dtype


def batch_sum(v, rank: int):
    """`v` summed over the leading axes a rank-`rank` per-channel operand broadcasts along, accumulated wide."""
    return jnp.sum(v, axis=tuple(range(v.ndim - rank)), dtype=accumulation_dtype(v.dtype)).astype(v.dtype)


@jax.custom_vjp
def normalize(x, mean, inv_std, scale, bias):
    """(x - mean) * inv_std * scale + bias; the per-channel operands (all of one shape) broadcast along x's
    leading axes. Its gradients sum over the batch in the accumulation dtype; JAX's own would sum in x's."""
    return (x - mean) * (inv_std * scale) + bias


def normalize_forward(x, mean, inv_std, scale, bias):
    return normalize(x, mean, inv_std, scale, bias), (x, mean, inv_std, scale)


def normalize_backward(residuals, dy):
    x, mean, inv_std, scale = residuals
    sum_dy = batch_sum(dy, scale.ndim)
    sum_dy_centered = batch_sum(dy * (x - mean), scale.ndim)
    return dy * (inv_std * scale), -sum_dy * inv_std * scale, sum_dy_centered * scale, sum_dy_centered * inv_std, sum_dy


normalize.defvjp(normalize_forward, normalize_backward)


def batch_norm_apply(x, scale, bias, mean, var, epsilon: float):
    """x: channels-last data (lower/layout.py), where the per-channel statistics broadcast along the last axis."""
    dtype = statistics_dtype(x.dtype)
    scale, bias, mean, var = [channel_minor(v.astype(dtype)) for v in (scale, bias, mean, var)]
    y = normalize(x.astype(dtype), mean, lax.rsqrt(var + jnp.asarray(epsilon, dtype)), scale, bias)
    return y.astype(x.dtype)


def batch_norm_train(x, scale, bias, mean, var, epsilon: float, momentum: float, spatial: bool = True):
    """Normalize channels-last x with the batch's statistics; returns (Y, running_mean, running_var,
    batch_mean, batch_var), Y channels-last."""
    dtype = statistics_dtype(x.dtype)
    axes = tuple(range(x.ndim - 1)) if spatial else (0,)
    xs = x.astype(dtype)
    wide = accumulation_dtype(dtype)  # the batch's statistics accumulate as the gradients do
    batch_mean = jnp.moveaxis(jnp.mean(xs, axis=axes, dtype=wide), -1, 0)
    # population variance, as the spec says
    batch_var = jnp.moveaxis(jnp.var(xs, axis=axes, dtype=wide), -1, 0).astype(dtype)
    batch_mean = batch_mean.astype(dtype)
    y = batch_norm_apply(x, scale, bias, batch_mean, batch_var, epsilon)

    def running(old, current):
        return (old.astype(dtype) * momentum + current * (1 - momentum)).astype(old.dtype)

    return (
        y,
        running(mean, batch_mean),
        running(var, batch_var),
        batch_mean.astype(mean.dtype),
        batch_var.astype(var.dtype),
    )


# make_trainable(train_mode=True) records on its training copy of a BatchNormalization that the copy needs 2 values
# per channel or more: the running variance averages PyTorch's unbiased batch variance, times n / (n - 1), which a
# batch of one into BatchNorm1d ([1, C]) or onto a 1x1 map makes 0 / 0, the running variance NaN for good. ONNX's
# op itself takes one value per channel: only the record refuses it, in the trace, where the input's shape is known
# (a dynamic batch's too), so the refused step runs nothing and changes no state.
MIN_VALUES_PER_CHANNEL = "onnxtrain.min_values_per_channel"


def check_values_per_channel(node: Node, shape: tuple[int, ...], channels: int) -> None:
    needed, count = int(node.metadata.get(MIN_VALUES_PER_CHANNEL, 0)), math.prod(shape) // max(channels, 1)
    if count < needed:
        raise FeedError(
            f"BatchNormalization {node.name or node.outputs[0]!r} of the train step gets a {list(shape)} input, "
            f"{count} value(s) per channel: train_mode averages the unbiased batch variance (times n / "
            "(n - 1)) into the running variance, which one value per channel leaves undefined; PyTorch's train() "
            "refuses it too ('Expected more than 1 value per channel when training'). Train on batches of 2 or more "
            "(a loader's last batch of one: drop it, as DataLoader(drop_last=True) does); the step was refused "
            "before it changed any state"
        )


@op("BatchNormalization", *versions("BatchNormalization", since=14), layout=CHANNELS_LAST)
def batch_normalization(x, scale, bias, input_mean, input_var, *, epsilon, momentum, training_mode, ctx):
    data = channels_last(x)
    if training_mode:
        check_values_per_channel(ctx.node, x.shape, scale.shape[0])
        y, running_mean, running_var = batch_norm_train(data, scale, bias, input_mean, input_var, epsilon, momentum)[:3]
        return ChannelsLast(y), running_mean, running_var
    return ChannelsLast(batch_norm_apply(data, scale, bias, input_mean, input_var, epsilon))


@op("BatchNormalization", *versions("BatchNormalization", until=9), layout=CHANNELS_LAST)
def batch_normalization_legacy(
    x, scale, bias, mean, var, *, epsilon, momentum, spatial=1, is_test=None, consumed_inputs=None, ctx
):
    """Opsets 1-9: `is_test=0` (opsets 1, 6) or, without is_test (7, 9), asking for the running statistics
    selects training mode; `spatial=0` keeps one statistic per (channel, position)."""
    training = is_test == 0 if is_test is not None else any(ctx.node.outputs[1:])
    data = channels_last(x)
    if training:
        y, *statistics = batch_norm_train(data, scale, bias, mean, var, epsilon, momentum, spatial=bool(spatial))
        return (ChannelsLast(y), *statistics)
    return ChannelsLast(batch_norm_apply(data, scale, bias, mean, var, epsilon))


# --- Instance, layer, group and RMS normalization -------------------------------------------------------------


@op("InstanceNormalization", *versions("InstanceNormalization"))
def instance_normalization(x, scale, bias, *, epsilon, consumed_inputs=None):
    normalized, _, _ = standardize(x, range(2, x.ndim), epsilon, statistics_dtype(x.dtype))
    dtype = normalized.dtype
    y = normalized * per_channel(scale.astype(dtype), x.ndim) + per_channel(bias.astype(dtype), x.ndim)
    return y.astype(x.dtype)


@op("LayerNormalization", *versions("LayerNormalization"))
def layer_normalization(x, scale, bias=None, *, axis, epsilon, stash_type):
    first = normalize_axis(axis, x.ndim)
    stash = np_dtype(stash_type)
    normalized, mean, inv_std = standardize(x, range(first, x.ndim), epsilon, statistics_dtype(x.dtype, stash_type))
    y = normalized.astype(x.dtype) * scale
    if bias is not None:
        y = y + bias
    return y.astype(x.dtype), mean.astype(stash), inv_std.astype(stash)


@op("GroupNormalization", *versions("GroupNormalization", since=21))
def group_normalization(x, scale, bias, *, num_groups, epsilon, stash_type=1):
    """scale and bias are per channel (opset 21)."""
    n, channels = x.shape[:2]
    if channels % num_groups:
        raise ValueError(f"num_groups={num_groups} does not divide the {channels} channels")
    grouped = jnp.reshape(x, (n, num_groups, -1))
    normalized, _, _ = standardize(grouped, (2,), epsilon, statistics_dtype(x.dtype, stash_type))
    normalized = jnp.reshape(normalized, x.shape).astype(x.dtype)
    return normalized * per_channel(scale.astype(x.dtype), x.ndim) + per_channel(bias.astype(x.dtype), x.ndim)


@op("GroupNormalization", *versions("GroupNormalization", until=18))
def group_normalization_18(x, scale, bias, *, num_groups, epsilon):
    """Opset 18 gives one scale and bias per group: spread each over its group's channels."""
    per_group = x.shape[1] // num_groups
    return group_normalization(
        x, jnp.repeat(scale, per_group), jnp.repeat(bias, per_group), num_groups=num_groups, epsilon=epsilon
    )


@op("RMSNormalization", *versions("RMSNormalization"))
def rms_normalization(x, scale, *, axis, epsilon, stash_type):
    first = normalize_axis(axis, x.ndim)
    xs = x.astype(statistics_dtype(x.dtype, stash_type))
    mean_square = jnp.mean(xs * xs, axis=tuple(range(first, x.ndim)), keepdims=True)
    normalized = (xs * lax.rsqrt(mean_square + jnp.asarray(epsilon, xs.dtype))).astype(x.dtype)
    return (normalized * scale).astype(scale.dtype)


# --- Local response, Lp and mean-variance normalization -------------------------------------------------------


@op("LRN", *versions("LRN"))
def lrn(x, *, size, alpha, beta, bias):
    dtype = statistics_dtype(x.dtype)
    xs = x.astype(dtype)
    window = [1] * x.ndim
    window[1] = size
    padding = [(0, 0)] * x.ndim
    padding[1] = ((size - 1) // 2, size // 2)  # floor((size-1)/2) channels before c, ceil((size-1)/2) after
    square_sum = lax.reduce_window(xs * xs, jnp.asarray(0, dtype), lax.add, window, (1,) * x.ndim, padding)
    return (xs / (bias + alpha / size * square_sum) ** beta).astype(x.dtype)


@op("LpNormalization", *versions("LpNormalization"))
def lp_normalization(x, *, axis, p):
    if p not in (1, 2):
        raise ValueError(f"p must be 1 or 2, got {p}")
    dtype = statistics_dtype(x.dtype)
    xs = x.astype(dtype)
    axis = normalize_axis(axis, x.ndim)
    if p == 1:
        norm = jnp.sum(jnp.abs(xs), axis=axis, keepdims=True)
    else:
        square_sum = jnp.sum(xs * xs, axis=axis, keepdims=True)
        # sqrt at 0 has an infinite derivative; feed it 1 there so gradients of all-zero slices stay finite
        norm = jnp.where(square_sum == 0, 0, jnp.sqrt(jnp.where(square_sum == 0, 1, square_sum)))
    zero = norm == 0
    return jnp.where(zero, 0, xs / jnp.where(zero, 1, norm)).astype(x.dtype)


@op("MeanVarianceNormalization", *versions("MeanVarianceNormalization"))
def mean_variance_normalization(x, *, axes):
    dtype = statistics_dtype(x.dtype)
    axes = tuple(normalize_axis(a, x.ndim) for a in axes)
    xs = x.astype(dtype)
    centered = xs - jnp.mean(xs, axis=axes, keepdims=True)
    std = jnp.sqrt(jnp.mean(centered * centered, axis=axes, keepdims=True))
    return (centered / (std + jnp.asarray(1e-9, dtype))).astype(x.dtype)  # the schema's function adds 1e-9

