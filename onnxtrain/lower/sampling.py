"""Sampling at fractional positions: the taps (neighbour index, weight, inside) of each axis and one gather that
sums their combinations. Shared by GridSample and DeformConv."""

from __future__ import annotations

import itertools
import math
from typing import Sequence

import jax.numpy as jnp

def linear_taps(coords, size: int):
    """The two neighbours of fractional positions `coords` on an axis of `size`: [(index, weight, inside)]."""
    low = jnp.floor(coords)
    frac = coords - low
    low = low.astype(jnp.int32)
    return [(index, weight, (index >= 0) & (index < size)) for index, weight in ((low, 1 - frac), (low + 1, frac))]


def gather_taps(x, axis_taps: Sequence[Sequence[tuple]], spatial_shape: Sequence[int]):
    """Sum over every combination of per-axis taps of weight x value.

    x: (*B, C, prod(spatial_shape)); a tap is (index, weight, inside), each (*B, Q) or None for weight 1 and
    always inside. Returns (*B, C, Q). A tap outside the input contributes zero; its index is clamped so the
    gather stays in bounds.
    """
    strides = [math.prod(spatial_shape[i + 1:]) for i in range(len(spatial_shape))]
    total = None
    for combo in itertools.product(*axis_taps):
        flat, weight, inside = 0, None, None
        for (index, w, ok), size, stride in zip(combo, spatial_shape, strides):
            flat = flat + jnp.clip(index, 0, size - 1) * stride
            if w is not None:
                weight = w if weight is None else weight * w
            if ok is not None:
                inside = ok if inside is None else inside & ok
        values = jnp.take_along_axis(x, jnp.expand_dims(flat, -2), axis=-1)
        if weight is not None:
            values = values * jnp.expand_dims(weight, -2).astype(values.dtype)
        if inside is not None:
            values = jnp.where(jnp.expand_dims(inside, -2), values, jnp.zeros((), values.dtype))
        total = values if total is None else total + values
    return total
