"""Reductions along axes: the Reduce* ops (one table of reductions, two thin adapters for where the axes come
from), ArgMax/ArgMin, the running reductions CumSum/CumProd, and TopK (the k largest or smallest).

`axes` is an attribute until ReduceSum-13 / the others' version 18, an optional input after. A reduction
over no axes at all (empty axes with `noop_with_empty_axes=1`) still applies the op's elementwise part, as the
schemas' function bodies do: ReduceSumSquare gives x*x, ReduceL1 |x|, ReduceLogSum log(x). Reductions over an
empty set of values give the identity of the reduction (0 for sums, 1 for products, the lowest value of the
type for max, -inf for the log-sums). Integer and bool inputs keep their dtype. TopK's k is read with `static()`:
it decides the output shape.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from ...dtypes import is_float
from ..axes import normalize_axis
from ..registry import op, register, versions
from ..values import Array, Value, static_int, static_ints

Axes = tuple[int, ...]
Reduction = Callable[[Array, Axes, bool], Array]


def _lowest(dtype: jnp.dtype) -> Array:
    if dtype == jnp.bool_:
        return False
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.iinfo(dtype).min
    return -jnp.inf


def _highest(dtype: jnp.dtype) -> Array:
    if dtype == jnp.bool_:
        return True
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.iinfo(dtype).max
    return jnp.inf


def _sum(x: Array, axes: Axes, keepdims: bool) -> Array:
    return jnp.sum(x, axis=axes, keepdims=keepdims, dtype=jnp.result_type(x))  # jnp would widen int32 to int64


def _mean(x: Array, axes: Axes, keepdims: bool) -> Array:
    return jnp.mean(x, axis=axes, keepdims=keepdims).astype(jnp.result_type(x))  # integer means truncate


def _max(x: Array, axes: Axes, keepdims: bool) -> Array:
    return jnp.max(x, axis=axes, keepdims=keepdims, initial=_lowest(jnp.result_type(x)))


def _min(x: Array, axes: Axes, keepdims: bool) -> Array:
    return jnp.min(x, axis=axes, keepdims=keepdims, initial=_highest(jnp.result_type(x)))


def _prod(x: Array, axes: Axes, keepdims: bool) -> Array:
    return jnp.prod(x, axis=axes, keepdims=keepdims, dtype=jnp.result_type(x))


def _l1(x: Array, axes: Axes, keepdims: bool) -> Array:
    return _sum(jnp.abs(x), axes, keepdims)


def _sum_square(x: Array, axes: Axes, keepdims: bool) -> Array:
    return _sum(x * x, axes, keepdims)


def _l2(x: Array, axes: Axes, keepdims: bool) -> Array:
    return jnp.sqrt(_sum_square(x, axes, keepdims)).astype(jnp.result_type(x))


def _log_sum(x: Array, axes: Axes, keepdims: bool) -> Array:
    return jnp.log(_sum(x, axes, keepdims)).astype(jnp.result_type(x))


def _log_sum_exp(x: Array, axes: Axes, keepdims: bool) -> Array:
    """Shifted by the maximum so large inputs do not overflow; all -inf (or no values) gives -inf."""
    dtype = jnp.result_type(x)
    wide = x if is_float(dtype) else jnp.asarray(x, jnp.float64)
    return jax.nn.logsumexp(wide, axis=axes, keepdims=keepdims).astype(dtype)


REDUCTIONS: dict[str, tuple[Reduction, int]] = {
    # name: (reduction, first since_version taking axes as an input)
    "ReduceSum": (_sum, 13),
    "ReduceMean": (_mean, 18),
    "ReduceMax": (_max, 18),
    "ReduceMin": (_min, 18),
    "ReduceProd": (_prod, 18),
    "ReduceL1": (_l1, 18),
    "ReduceL2": (_l2, 18),
    "ReduceSumSquare": (_sum_square, 18),
    "ReduceLogSum": (_log_sum, 18),
    "ReduceLogSumExp": (_log_sum_exp, 18),
}


def reduce(reduction: Reduction, data: Array, axes: list[int] | None, keepdims: int) -> Array:
    """`axes=None` reduces every axis; `axes=[]` none."""
    rank = jnp.ndim(data)
    if axes is None:
        normalized = tuple(range(rank))
    else:
        out_of_range = [a for a in axes if not -max(rank, 1) <= a < max(rank, 1)]
        if out_of_range:
            raise ValueError(f"axes {axes} out of range for an input of rank {rank}")
        normalized = tuple(sorted({a % rank for a in axes})) if rank else ()
    return reduction(data, normalized, bool(keepdims))


def _with_axes_attribute(reduction: Reduction) -> Callable:
    def impl(data: Array, *, axes: list[int] | None = None, keepdims: int = 1) -> Array:
        return reduce(reduction, data, axes or None, keepdims)  # an empty list is the default: every axis

    impl.__name__ = reduction.__name__.lstrip("_")
    return impl


def _with_axes_input(reduction: Reduction) -> Callable:
    def impl(data: Array, axes: Array | None = None, *, keepdims: int = 1, noop_with_empty_axes: int = 0) -> Array:
        listed = [] if axes is None else static_ints(axes, "axes")
        if not listed and not noop_with_empty_axes:
            return reduce(reduction, data, None, keepdims)
        return reduce(reduction, data, listed, keepdims)

    impl.__name__ = reduction.__name__.lstrip("_")
    return impl


for _name, (_reduction, _axes_input_since) in REDUCTIONS.items():
    register(_name, _with_axes_attribute(_reduction), until=_axes_input_since - 1)
    register(_name, _with_axes_input(_reduction), since=_axes_input_since)


# ---- scans ---------------------------------------------------------------------------------------------------


def _shift_in(x: Value, axis: int, fill: int, reverse: bool) -> Value:
    """Move every element one step along the scan direction, `fill` entering first: turns an inclusive scan
    into an exclusive one without division (so CumProd stays exact with zeros)."""
    size = x.shape[axis]
    pads = [(0, 0)] * x.ndim
    pads[axis] = (0, 1) if reverse else (1, 0)
    padded = jnp.pad(x, pads, constant_values=fill)
    start = 1 if reverse else 0
    return lax.slice_in_dim(padded, start, start + size, axis=axis)


def _cumulative(scan: Callable, identity: int) -> Callable:
    def cumulative(x: Value, axis: Value, *, exclusive: int = 0, reverse: int = 0) -> Value:
        x = jnp.asarray(x)
        along = normalize_axis(static_int(axis, "axis"), x.ndim)
        if exclusive:
            x = _shift_in(x, along, identity, bool(reverse))
        return scan(x, axis=along, reverse=bool(reverse))

    return cumulative


SCANS: dict[str, tuple[Callable, int]] = {"CumSum": (lax.cumsum, 0), "CumProd": (lax.cumprod, 1)}

for _name, (_scan, _identity) in SCANS.items():
    op(_name, *versions(_name))(_cumulative(_scan, _identity))


# ---- ordering ------------------------------------------------------------------------------------------------


def _arg_reduce(pick: Callable) -> Callable:
    def arg_reduce(data: Value, *, axis: int = 0, keepdims: int = 1, select_last_index: int = 0) -> Value:
        data = jnp.asarray(data)
        along = normalize_axis(axis, data.ndim)
        if select_last_index:  # the first hit in the reversed tensor is the last one in the original
            found = (data.shape[along] - 1) - pick(jnp.flip(data, along), axis=along, keepdims=bool(keepdims))
        else:
            found = pick(data, axis=along, keepdims=bool(keepdims))
        return found.astype(jnp.int64)

    return arg_reduce


ARG_REDUCTIONS: dict[str, Callable] = {"ArgMax": jnp.argmax, "ArgMin": jnp.argmin}

for _name, _pick in ARG_REDUCTIONS.items():
    op(_name, *versions(_name))(_arg_reduce(_pick))


def _order_reversed(x: Value) -> Value:
    """A key whose descending order is x's ascending order; bitwise-not cannot overflow as negation can."""
    return -x if is_float(x.dtype) else jnp.bitwise_not(x)


def _top_k(x: Value, k: int, axis: int, largest: bool) -> tuple[Value, Value]:
    x = jnp.asarray(x)
    along = normalize_axis(axis, x.ndim)
    if not 0 <= k <= x.shape[along]:
        raise ValueError(f"k = {k} is out of range for axis {along} of size {x.shape[along]}")
    # XLA's TopK puts the lower index first among equal keys, the tie-break ONNX specifies.
    _, found = lax.top_k(x if largest else _order_reversed(x), k, axis=along)
    found = found.astype(jnp.int64)
    return jnp.take_along_axis(x, found, axis=along), found


@op("TopK", *versions("TopK", since=10))
def top_k(
    x: Value, k: Value, *, axis: int = -1, largest: int = 1, sorted: int = 1  # noqa: A002 - ONNX's name
) -> tuple[Value, Value]:
    # sorted=0 leaves the order unspecified, so sorted output is conformant either way.
    return _top_k(x, static_int(k, "K"), axis, bool(largest))


@op("TopK", *versions("TopK", until=9))
def top_k_v1(x: Value, *, k: int, axis: int = -1) -> tuple[Value, Value]:
    """Opset 1 took k as an attribute and always returned the largest."""
    return _top_k(x, k, axis, largest=True)
