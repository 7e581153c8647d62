"""Channels-last activations between the ops that can keep them that way.

ONNX images are channels-first (N, C, *spatial); XLA's CPU convolutions and pools are fastest channels-last.
A convolution or pool therefore hands its result on as a `ChannelsLast` value, and the walker passes it
unconverted to the next op when that op is

- `elementwise` (Relu, Add, Clip, PRelu, ...): it runs on the channels-last data, its other operands permuted to
  match (broadcasting commutes with the permutation), and its result stays channels-last; or
- `channels_last` (Conv, the pools, BatchNormalization): it reads its first input channels-last directly.

Every other consumer (Flatten, Reshape, a graph output, a state assignment, a subgraph) sees the ordinary
channels-first array. Without this, a Relu between a convolution and a pool sat in channels-first layout and the
gradient paid two transposes of every activation (a small CNN's train step: 1.2x the hand-written JAX step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

ELEMENTWISE = "elementwise"
CHANNELS_LAST = "channels_last"


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ChannelsLast:
    """A channels-first tensor stored as (N, *spatial, C). `shape`, `ndim` and `dtype` describe the tensor the
    model sees, so an op's checks read the same either way."""

    data: Any

    @property
    def shape(self) -> tuple[int, ...]:
        s = self.data.shape
        return (s[0], s[-1], *s[1:-1])

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def dtype(self) -> Any:
        return self.data.dtype


def channels_last(x: Any) -> Any:
    """(N, *spatial, C) data of a ChannelsLast or a channels-first array."""
    return x.data if isinstance(x, ChannelsLast) else jnp.moveaxis(x, 1, -1)


def channels_first(x: Any) -> Any:
    """The value as the model sees it: a ChannelsLast transposed back, anything else unchanged."""
    return jnp.moveaxis(x.data, -1, 1) if isinstance(x, ChannelsLast) else x


def channels_first_results(results: Any) -> Any:
    if isinstance(results, tuple):
        return tuple(channels_first(r) for r in results)
    return channels_first(results)


def _permuted_operand(value: Any, rank: int) -> Any:
    """A plain operand of an elementwise op with a ChannelsLast one of `rank`: padded to that rank, as
    broadcasting would, and permuted the same way; None when it cannot take part (a sequence, a larger rank)."""
    if value is None or isinstance(value, (int, float, bool)):
        return value
    if isinstance(value, ChannelsLast):
        return value.data if value.ndim == rank else None
    ndim = np.ndim(value) if hasattr(value, "shape") else -1
    if ndim < 0 or ndim > rank:
        return None
    if ndim == 0:
        return value
    xp = np if isinstance(value, (np.ndarray, np.generic)) else jnp  # a static operand stays static
    padded = xp.reshape(value, (1,) * (rank - ndim) + tuple(np.shape(value)))
    return xp.moveaxis(padded, 1, -1)


def call(fn: Any, layout: str, args: Sequence[Any], attrs: dict[str, Any]) -> Any:
    """Call an op's lowering with its inputs in the layout it accepts (see the module docstring)."""
    if layout == ELEMENTWISE:
        ranks = {a.ndim for a in args if isinstance(a, ChannelsLast)}
        if len(ranks) == 1:
            rank = ranks.pop()
            operands = [_permuted_operand(a, rank) for a in args]
            if all(o is not None or a is None for o, a in zip(operands, args)):
                return ChannelsLast(fn(*operands, **attrs))  # broadcasting keeps the largest rank: `rank`
    elif layout == CHANNELS_LAST and args:
        return fn(args[0], *[channels_first(a) for a in args[1:]], **attrs)
    return fn(*[channels_first(a) for a in args], **attrs)
