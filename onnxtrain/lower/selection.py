"""Row selections taken before the row-wise ops that make the rows: a Gather or Slice along non-last axes of a
MatMul's, an elementwise op's or a last-axis normalization's result is computed from the selected rows of its
inputs, back as far as only those ops read the values.

A language model's head multiplies every position's hidden state by a vocabulary-sized weight, and a model that
keeps some positions only (`logits[:, -1]`: next-token prediction, last-token classification; BERT's pooler
reading the first token) throws the rest away. XLA does not move a selection before a product, so the whole
head and both its gradients ran: GPT-2's at batch 2 x 128 positions is three products of 20 GFLOP each, a
quarter of its train step on the CPU. Each row of these ops' results reads only the same row of their
row-carrying inputs, so selecting those rows first gives the same numbers (each row the same computation) for a
fraction of the work, and autodiff of the smaller computation gives the gradients. Back through the last
transformer layer, the selection stops where a value is also read by a node outside the selected computation
(the keys and values of an attention read every position): that value is computed whole and selected.

The graph's own nodes still run as written, so any reader the walker does not see (a subgraph, a graph output)
gets the whole values; when the selection was their only reader, XLA drops them as dead code.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..ir import Node
from .layout import ELEMENTWISE, Reordered
from .values import Value, is_static


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
# row-wise ops that are not registered as elementwise (registry.register's flag), each with the inputs that
# carry rows (None: every input, broadcasting as elementwise operands do)
ROW_WISE: dict[str, tuple[int, ...] | None] = {
    "Cast": None, "Identity": None, "Where": None,
    "MatMul": (0,),  # with a matrix W: W's own axis is the last
    "LayerNormalization": (0,), "Softmax": (0,), "LogSoftmax": (0,),  # over the last axes: their `axis` attribute
}
NORMALIZED_FROM = {"LayerNormalization": -1, "Softmax": -1, "LogSoftmax": -1}  # the `axis` default of today's ops


@dataclass(frozen=True)
class Selection:
    """The rows to take: `node` (a Gather or Slice, its inputs `args`) along `axes` of a rank-`rank` value."""

    node: Node
    args: tuple[Value, ...]
    axes: tuple[int, ...]  # non-negative, all before the last axis
    rank: int
    keeps_rank: bool  # a Gather of scalar or multi-dimensional indices changes the rank of what it selects


@dataclass(frozen=True)
class Producer:
    node: Node
    position: int  # among the siblings
    rows: tuple[int, ...]  # its inputs that carry the selected rows


@dataclass(frozen=True)
class Plan:
    """The values to compute on the selected rows, with their producers; every other row-carrying input of those
    producers is selected where it stands (by the selection node, at `position`)."""

    selection: Selection
    position: int
    region: dict[str, Producer]


def selection_of(node: Node, args: Sequence[Value]) -> Selection | None:
    select_axes = SELECTIONS.get(node.op_type) if not node.domain else None
    if select_axes is None or not args or not traced_array(args[0]):
        return None
    rank = args[0].ndim
    axes = select_axes(node, args)
    if axes is None or not all(-rank <= a < rank for a in axes):
        return None
    axes = sorted({a % rank for a in axes})
    if not axes or axes[-1] >= rank - 1:  # the last axis is a product's or a normalization's own
        return None
    keeps_rank = node.op_type != "Gather" or np.ndim(args[1]) == 1
    return Selection(node, tuple(args), tuple(axes), rank, keeps_rank)


def traced_array(value: Value) -> bool:
    return hasattr(value, "ndim") and not isinstance(value, Reordered) and not is_static(value)


def carried(value: Value, selection: Selection, shape: Sequence[int]) -> bool | None:
    """Whether an input of a row-wise op carries the selected rows (True), broadcasts over them unchanged (False:
    it lies within the axes after the selected ones), or neither (None: the op cannot be computed on rows)."""
    rank = np.ndim(value)
    if rank == selection.rank and all(np.shape(value)[a] == shape[a] for a in selection.axes):
        return True
    if rank <= selection.rank - 1 - selection.axes[-1]:
        return False
    return None


def row_inputs(node: Node, selection: Selection, read: Callable[[str], Value]) -> tuple[int, ...] | None:
    """The inputs of `node` that carry the selected rows when its output can be computed from them alone;
    None when it cannot."""
    if node.domain or sum(1 for o in node.outputs if o) != 1 or not node.outputs[0] or node.impl is None:
        return None
    elementwise = node.impl.layout == ELEMENTWISE or (node.op_type in ROW_WISE and ROW_WISE[node.op_type] is None)
    if not elementwise and node.op_type not in ROW_WISE:
        return None
    output = read(node.outputs[0])
    if not traced_array(output) or output.ndim != selection.rank:
        return None
    if node.op_type == "MatMul" and np.ndim(read(node.inputs[1])) != 2:
        return None
    if node.op_type in NORMALIZED_FROM:
        axis = int(node.attributes.get("axis", NORMALIZED_FROM[node.op_type]))
        if axis % selection.rank <= selection.axes[-1] or (axis >= 0 and not selection.keeps_rank):
            return None
    carriers = range(len(node.inputs)) if elementwise else ROW_WISE[node.op_type]
    rows = []
    for i, name in enumerate(node.inputs):
        if not name:
            continue
        kind = carried(read(name), selection, output.shape) if i in carriers else False
        if kind is None or (kind and not traced_array(read(name))):
            return None
        if kind:
            rows.append(i)
    return tuple(rows) or None


def plan(node: Node, args: Sequence[Value], read: Callable[[str], Value], siblings: Sequence[Node],
         position: int) -> Plan | None:
    """How to compute `node` (input values `args`; `read` gives any value of its scope) from the rows it selects,
    when it selects rows of a row-wise op's result that nothing else among `siblings` reads; None otherwise."""
    selection = selection_of(node, args)
    if selection is None:
        return None
    made = {o: i for i in range(position) for o in siblings[i].outputs if o}
    start = node.inputs[0]
    if start not in made or row_inputs(siblings[made[start]], selection, read) is None:
        return None
    readers: dict[str, set[int]] = defaultdict(set)
    for i, sibling in enumerate(siblings):
        for name in sibling.inputs:
            readers[name].add(i)
    if readers[start] != {position}:
        return None
    # grow: every row-wise producer reachable through row-carrying inputs
    region: dict[str, Producer] = {}
    pending = [start]
    while pending:
        name = pending.pop()
        if name in region or name not in made:
            continue
        producer = siblings[made[name]]
        rows = row_inputs(producer, selection, read)
        if rows is not None:
            region[name] = Producer(producer, made[name], rows)
            pending.extend(producer.inputs[i] for i in rows)
    # shrink: a value read by a node outside the region is computed whole anyway, so it is selected where it
    # stands (and what only it led to drops out)
    while True:
        inside = {position} | {p.position for p in region.values()}
        kept = {n for n in region if n == start or readers[n] <= inside}
        reachable, pending = set(), [start]
        while pending:
            name = pending.pop()
            if name in kept and name not in reachable:
                reachable.add(name)
                producer = region[name]
                pending.extend(producer.node.inputs[i] for i in producer.rows)
        if reachable == set(region):
            return Plan(selection, position, region)
        region = {n: region[n] for n in reachable}
