"""Channels-last activations between the ops that can keep them that way.

ONNX images are channels-first (N, C, *spatial); XLA's CPU convolutions and pools are fastest channels-last.
A convolution or pool therefore hands its result on as a `ChannelsLast` value, and the walker passes it
unconverted to the next op when that op is

- `elementwise` (Relu, Add, Clip, PRelu, ...): it runs on the channels-last data, its other operands permuted to
  match (broadcasting commutes with the permutation), and its result stays channels-last; or
- `channels_last` (Conv, the pools, BatchNormalization): it reads its first input channels-last directly.

Every other consumer (Flatten, Reshape, a graph output, a state assignment, a subgraph) sees the ordinary
channels-first array. Without this, a Relu between a convolution and a pool sat in channels-first layout and the
gradient paid two transposes of every activation (benchmarks/README.md, "How the design's choices measured").

Weights take the same idea once, at load: a constant kernel (O, I, *kernel) that only convolutions read is held
as a `KernelLast` (*kernel, I, O), the order XLA-CPU's convolutions read, instead of being transposed on every
call (`kernel_only_weights` says which).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

ELEMENTWISE = "elementwise"
CHANNELS_LAST = "channels_last"


# Spatial positions start + step * i (i < count) on each spatial axis: (starts, steps, counts).
Grid = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


class Reordered:
    """A tensor stored with its axes in another order than ONNX's: `data` is what is stored; `shape` (each
    subclass's permutation of the stored shape), `ndim` and `dtype` describe the tensor the model sees, so an
    op's checks read the same either way. A pytree of the one array."""

    def __init__(self, data: Any):
        self.data = data

    def tree_flatten(self) -> tuple[tuple[Any], None]:
        return (self.data,), None

    @classmethod
    def tree_unflatten(cls, _: None, children: tuple[Any]) -> "Reordered":
        return cls(children[0])

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def dtype(self) -> Any:
        return self.data.dtype


@jax.tree_util.register_pytree_node_class
class ChannelsLast(Reordered):
    """A channels-first tensor stored as (N, *spatial, C).

    `at(grid)`, when the producer gives one, computes the data at a strided grid of positions from the
    producer's own inputs: a tiled pool reads a shallow convolution (and the elementwise ops after it) at each
    window offset that way, which XLA-CPU compiles to faster code than the same pool over the convolution's
    output.
    It is a trace-time helper only: it does not survive flattening (jax.vjp's auxiliary values, for one)."""

    def __init__(self, data: Any, at: Callable[[Grid], Any] | None = None):
        super().__init__(data)
        self.at = at

    def sample(self, grid: Grid) -> Any:
        """The data at `grid`: from the producer where it can, else a strided slice."""
        return self.at(grid) if self.at is not None else strided(self.data, grid)

    @property
    def shape(self) -> tuple[int, ...]:
        s = self.data.shape
        return (s[0], s[-1], *s[1:-1])


@jax.tree_util.register_pytree_node_class
class KernelLast(Reordered):
    """A convolution kernel (O, I, *kernel) stored as (*kernel, I, O). XLA-CPU copied an ONNX-ordered kernel
    into this order on every call, its 3x3 axes moving innermost: ResNet-18's inference (batch 2) spent ~40 %
    of its time in those copies."""

    @classmethod
    def of(cls, kernel: np.ndarray) -> "KernelLast":
        return cls(np.ascontiguousarray(np.transpose(kernel, kernel_last_axes(kernel.ndim))))

    @property
    def shape(self) -> tuple[int, ...]:
        s = self.data.shape
        return (s[-1], s[-2], *s[:-2])

    def astype(self, dtype: Any) -> "KernelLast":
        return KernelLast(self.data.astype(dtype))

    def as_onnx(self) -> Any:
        """The kernel in ONNX's (O, I, *kernel) order."""
        rank = self.data.ndim
        return jnp.transpose(self.data, (rank - 1, rank - 2, *range(rank - 2)))


def kernel_last_axes(ndim: int) -> tuple[int, ...]:
    """The permutation taking a kernel from ONNX's (O, I, *kernel) to (*kernel, I, O)."""
    return (*range(2, ndim), 1, 0)


def kernel_last(w: Any) -> Any:
    """The (*kernel, I, O) data of a KernelLast, or of an ONNX-ordered kernel (transposed)."""
    return w.data if isinstance(w, KernelLast) else jnp.transpose(w, kernel_last_axes(w.ndim))


def kernel_only_weights(main: Sequence[Any], others: Sequence[Any], names: set[str]) -> set[str]:
    """Those of `names` that every reference reads as a convolution kernel: `main` (the inference graph's nodes)
    reads them only as Conv's W, and no node of `others` (the algorithm graphs' nodes) or of any subgraph names
    them, as an input or in an attribute (Gradient's xs). Only such a weight can be a KernelLast: every other
    op reads ONNX's order."""
    kernels = {n for node in main if node.op_type == "Conv" and not node.domain
               for i, n in enumerate(node.inputs) if i == 1 and n in names}
    elsewhere: set[str] = set()

    def visit(node: Any, top_conv: bool) -> None:
        for i, name in enumerate(node.inputs):
            if not (top_conv and i == 1):
                elsewhere.add(name)
        for value in node.attributes.values():
            for item in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(item, str):
                    elsewhere.add(item)
                elif hasattr(item, "nodes"):  # a subgraph
                    for inner in item.nodes:
                        visit(inner, False)

    for node in main:
        visit(node, node.op_type == "Conv" and not node.domain)
    for node in others:
        visit(node, False)
    return kernels - elsewhere


def strided(data: Any, grid: Grid) -> Any:
    """Channels-last data (N, *spatial, C) at `grid`; a spatial axis of size 1 broadcasts (stays as it is)."""
    starts, steps, counts = grid
    spatial = data.shape[1:-1]
    start = [0, *[0 if n == 1 else s for n, s in zip(spatial, starts)], 0]
    step = [1, *[1 if n == 1 else s for n, s in zip(spatial, steps)], 1]
    ends = [1 if n == 1 else s + (c - 1) * t + 1 for n, s, t, c in zip(spatial, starts, steps, counts)]
    limit = [data.shape[0], *ends, data.shape[-1]]
    return lax.slice(data, start, limit, step)


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


def _sampled(fn: Any, attrs: dict[str, Any], args: Sequence[Any], operands: Sequence[Any]) -> Any:
    """An elementwise result's `at`: the op applied to its operands at the grid, when one of them has an `at`."""
    if not any(isinstance(a, ChannelsLast) and a.at is not None for a in args):
        return None

    def at(grid: Grid) -> Any:
        sampled = [a.sample(grid) if isinstance(a, ChannelsLast) else o if o is None or jnp.ndim(o) == 0
                   else strided(o, grid)
                   for a, o in zip(args, operands)]
        return fn(*sampled, **attrs)

    return at


def call(fn: Any, layout: str, args: Sequence[Any], attrs: dict[str, Any]) -> Any:
    """Call an op's lowering with its inputs in the layout it accepts (see the module docstring)."""
    if layout == ELEMENTWISE:
        ranks = {a.ndim for a in args if isinstance(a, ChannelsLast)}
        if len(ranks) == 1:
            rank = ranks.pop()
            operands = [_permuted_operand(a, rank) for a in args]
            if all(o is not None or a is None for o, a in zip(operands, args)):
                # broadcasting keeps the largest rank: `rank`
                return ChannelsLast(fn(*operands, **attrs), _sampled(fn, attrs, args, operands))
    elif layout == CHANNELS_LAST and args:
        return fn(args[0], *[channels_first(a) for a in args[1:]], **attrs)
    return fn(*[channels_first(a) for a in args], **attrs)
