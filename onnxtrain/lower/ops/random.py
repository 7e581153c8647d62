"""Random ops, deterministic from a key: a node's `seed` attribute wins; otherwise the key derives from the
engine's seed, the node (its output names) and the training step (docs/architecture.md)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ...dtypes import np_dtype
from ..walker import NodeContext
from ..registry import op, versions


def sample(kind: str, key, shape, dtype, a: float, b: float):
    """Normal(mean=a, scale=b) or Uniform[low=a, high=b), drawn in float32 or wider and cast."""
    wide = jnp.float64 if dtype == jnp.float64 else jnp.float32
    if kind == "normal":
        return (a + b * jax.random.normal(key, shape, wide)).astype(dtype)
    return jax.random.uniform(key, shape, wide, a, b).astype(dtype)


def _like_dtype(input, dtype: int | None):
    return input.dtype if dtype is None else np_dtype(dtype)


@op("RandomNormal", *versions("RandomNormal"))
def random_normal(*, shape, dtype=1, mean=0.0, scale=1.0, seed=None, ctx: NodeContext):
    return sample("normal", ctx.rng(seed), tuple(shape), np_dtype(dtype), mean, scale)


@op("RandomUniform", *versions("RandomUniform"))
def random_uniform(*, shape, dtype=1, low=0.0, high=1.0, seed=None, ctx: NodeContext):
    return sample("uniform", ctx.rng(seed), tuple(shape), np_dtype(dtype), low, high)


@op("RandomNormalLike", *versions("RandomNormalLike"))
def random_normal_like(input, *, dtype=None, mean=0.0, scale=1.0, seed=None, ctx: NodeContext):
    return sample("normal", ctx.rng(seed), input.shape, _like_dtype(input, dtype), mean, scale)


@op("RandomUniformLike", *versions("RandomUniformLike"))
def random_uniform_like(input, *, dtype=None, low=0.0, high=1.0, seed=None, ctx: NodeContext):
    return sample("uniform", ctx.rng(seed), input.shape, _like_dtype(input, dtype), low, high)


@op("Bernoulli", *versions("Bernoulli"))
def bernoulli(input, *, dtype=None, seed=None, ctx: NodeContext):
    draws = jax.random.uniform(ctx.rng(seed), input.shape, jnp.float32)
    return (draws < input).astype(_like_dtype(input, dtype))


@op("Multinomial", *versions("Multinomial"))
def multinomial(input, *, dtype=6, sample_size=1, seed=None, ctx: NodeContext):
    """`input` holds unnormalized log-probabilities [batch, classes]; draws [batch, sample_size]."""
    batch = input.shape[0]
    draws = jax.random.categorical(ctx.rng(seed), input, axis=-1, shape=(sample_size, batch))
    return draws.T.astype(np_dtype(dtype))
