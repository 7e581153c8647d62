"""Row selections taken before the product that makes them: Gather or Slice of MatMul(X, W) as MatMul of the
selection of X, when only non-last axes are selected and W is a matrix.

A language model's head multiplies every position's hidden state by a vocabulary-sized weight, and a model that
keeps some positions only (`logits[:, -1]`: next-token prediction, last-token classification) throws the rest
away. XLA does not move a selection before a product, so the whole product and both its gradients ran: GPT-2's
head at batch 2 x 128 positions is three products of 20 GFLOP each, a quarter of its train step on the CPU.
Each row of the product reads the same row of X and all of W, so selecting X's rows first gives the same numbers
(each row's sum in the same terms) for a fraction of the work; the gradients follow (autodiff of the smaller
product). The graph's MatMul still runs as written, so anything else reading its result gets it; when the
selection was its only reader, XLA drops it as dead code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..ir import Node
from .values import Value, is_static


@dataclass(frozen=True)
class Reordering:
    """How to compute `node` (a selection of `product`'s result) as `product` of the selection of its input."""

    product: Node
    position: int  # of `product` among the siblings


def _gather_axes(node: Node, args: Sequence[Value]) -> list[int] | None:
    return [int(node.attributes.get("axis", 0))]


def _slice_axes(node: Node, args: Sequence[Value]) -> list[int] | None:
    if node.since_version == 1:
        starts, axes = node.attributes.get("starts", []), node.attributes.get("axes")
        return list(axes) if axes is not None else list(range(len(starts)))
    axes = args[3] if len(args) > 3 else None
    if axes is None:
        return list(range(int(np.shape(args[1])[0]))) if is_static(args[1]) and np.ndim(args[1]) == 1 else None
    return [int(a) for a in np.ravel(axes)] if is_static(axes) else None


# selection op -> the axes of its data input it selects along (None: not known at trace time)
SELECTIONS: dict[str, Callable[[Node, Sequence[Value]], list[int] | None]] = {
    "Gather": _gather_axes,
    "Slice": _slice_axes,
}


def reordering(node: Node, args: Sequence[Value], read: Callable[[str], Value],
               siblings: Sequence[Node], position: int) -> Reordering | None:
    """The reordering of `node` (its input values `args`, `read` giving any other value of its scope) when it
    selects rows of a MatMul's result that nothing else among `siblings` reads; None otherwise."""
    select_axes = SELECTIONS.get(node.op_type) if not node.domain else None
    if select_axes is None or not args or is_static(args[0]) or not hasattr(args[0], "ndim"):
        return None
    name = node.inputs[0]
    found = next(((i, n) for i in range(position - 1, -1, -1) if name in (n := siblings[i]).outputs), None)
    if found is None:
        return None
    where, product = found
    if product.op_type != "MatMul" or product.domain or product.impl is None or len(product.inputs) != 2:
        return None
    if sum(name in sibling.inputs for sibling in siblings) != 1:
        return None
    x, w = read(product.inputs[0]), read(product.inputs[1])
    rank = np.ndim(x)
    if rank < 2 or np.ndim(w) != 2 or is_static(x):
        return None
    axes = select_axes(node, args)
    if axes is None or not all(-rank <= a < rank and a % rank < rank - 1 for a in axes):  # the last is W's
        return None
    return Reordering(product, where)

