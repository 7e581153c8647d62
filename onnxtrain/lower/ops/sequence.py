"""Sequences (Python lists of tensors) and optionals (None when empty, else the value itself).

A sequence's length is always known at trace time, so every op that changes it needs its positions static;
only SequenceAt can pick a traced position, and only among elements of one shape and dtype.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from ...errors import NodeError
from ..walker import NodeContext, Subgraph
from ..registry import op, versions
from ..values import Value, folded, is_static, needs_static, signature, static, static_ints


def position_in(seq: list, position: Value, what: str, extra: int = 0) -> int:
    """A static position as a non-negative index; valid positions are [-n, n - 1 + extra]."""
    n = len(seq)
    index = static_ints(position, what)[0]
    if not -n <= index <= n - 1 + extra:
        raise NodeError(f"{what} {index} is out of range for a sequence of {n} tensors")
    return index + n if index < 0 else index


def as_sequence(value: Value, what: str) -> list:
    if not isinstance(value, list):
        raise NodeError(f"{what} must be a sequence, got {'an empty optional' if value is None else 'a tensor'}")
    return value


@op("SequenceConstruct", *versions("SequenceConstruct"))
def sequence_construct(*inputs: Value) -> list:
    return list(inputs)


@op("SequenceEmpty", *versions("SequenceEmpty"))
def sequence_empty(*, dtype: int = 1) -> list:
    return []  # an empty list carries no element type; the first insertion decides it


@op("SequenceLength", *versions("SequenceLength"))
def sequence_length(input_sequence: Value) -> np.ndarray:
    return np.array(len(as_sequence(input_sequence, "input_sequence")), dtype=np.int64)


@op("SequenceAt", *versions("SequenceAt"))
def sequence_at(input_sequence: Value, position: Value, *, ctx: NodeContext) -> Value:
    seq = as_sequence(input_sequence, "input_sequence")
    if is_static(position):
        return seq[position_in(seq, position, "position")]
    if not seq or len({signature(v) for v in seq}) > 1:
        raise needs_static(ctx, 1, "position", "the sequence's tensors differ in shape or dtype")
    index = jnp.reshape(position, ()).astype(jnp.int64)
    index = jnp.where(index < 0, index + len(seq), index)
    return lax.dynamic_index_in_dim(jnp.stack(seq), index, 0, keepdims=False)


@op("SequenceInsert", *versions("SequenceInsert"))
def sequence_insert(input_sequence: Value, tensor: Value, position: Value = None) -> list:
    seq = list(as_sequence(input_sequence, "input_sequence"))
    if seq and np.dtype(seq[0].dtype) != np.dtype(tensor.dtype):
        raise NodeError(f"tensor has dtype {np.dtype(tensor.dtype)}, the sequence holds {np.dtype(seq[0].dtype)}")
    index = len(seq) if position is None else position_in(seq, position, "position", extra=1)
    seq.insert(index, tensor)
    return seq


@op("SequenceErase", *versions("SequenceErase"))
def sequence_erase(input_sequence: Value, position: Value = None) -> list:
    seq = list(as_sequence(input_sequence, "input_sequence"))
    if not seq:
        raise NodeError("cannot erase from an empty sequence")
    del seq[len(seq) - 1 if position is None else position_in(seq, position, "position")]
    return seq


@op("ConcatFromSequence", *versions("ConcatFromSequence"))
def concat_from_sequence(input_sequence: Value, *, axis: int, new_axis: int = 0) -> Value:
    seq = as_sequence(input_sequence, "input_sequence")
    if not seq:
        raise NodeError("cannot concatenate an empty sequence")
    if new_axis:
        return folded(lambda *v: jnp.stack(v, axis=axis), *seq)
    return folded(lambda *v: jnp.concatenate(v, axis=axis), *seq)


@op("SplitToSequence", *versions("SplitToSequence"))
def split_to_sequence(input: Value, split: Value = None, *, axis: int = 0, keepdims: int = 1) -> list:
    axis = axis % np.ndim(input)
    size = np.shape(input)[axis]
    if split is None:
        lengths = [1] * size
    else:
        given = static(split, "split")
        if given.ndim == 0:
            chunk = int(given)
            if chunk <= 0:
                raise NodeError(f"split must be positive, got {chunk}")
            lengths = [chunk] * (size // chunk) + ([size % chunk] if size % chunk else [])
        else:
            lengths = [int(n) for n in given]
            if sum(lengths) != size:
                raise NodeError(f"split {lengths} does not sum to dimension {axis} of size {size}")
    squeeze = split is None and not keepdims  # keepdims only applies when no split is given
    bounds = np.cumsum([0, *lengths]).tolist()

    def piece(v: Value, lo: int, hi: int) -> Value:
        part = lax.slice_in_dim(v, lo, hi, axis=axis)
        return jnp.squeeze(part, axis) if squeeze else part

    return [folded(piece, input, lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]


@op("SequenceMap", *versions("SequenceMap"))
def sequence_map(input_sequence: Value, *additional_inputs: Value, body: Subgraph) -> tuple:
    seq = as_sequence(input_sequence, "input_sequence")
    for k, extra in enumerate(additional_inputs):
        if isinstance(extra, list) and len(extra) != len(seq):
            raise NodeError(f"additional input {k} has {len(extra)} elements, input_sequence {len(seq)}")
    results: list[list] = [[] for _ in body.output_names]
    for i, element in enumerate(seq):
        args = [extra[i] if isinstance(extra, list) else extra for extra in additional_inputs]
        for column, value in zip(results, body(element, *args)):
            column.append(value)
    return tuple(results)


# -------------------------------------------------------------------------------------------- Optionals


@op("Optional", *versions("Optional"))
def optional(input: Value = None, *, type: object = None) -> Value:
    return input


@op("OptionalHasElement", *versions("OptionalHasElement"))
def optional_has_element(input: Value = None) -> np.ndarray:
    return np.array(input is not None)


@op("OptionalGetElement", *versions("OptionalGetElement"))
def optional_get_element(input: Value = None) -> Value:
    if input is None:
        raise NodeError("the optional is empty")
    return input
