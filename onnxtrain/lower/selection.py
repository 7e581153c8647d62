"""Row selections taken before the row-wise ops that make the rows: a Gather or Slice along non-last axes of a
value computed by matrix products, elementwise ops, normalizations or reductions over the last axes, and
reshapes that keep the rows, is computed from the selected rows of their inputs, back as far as only those ops
read the values.

A language model's head multiplies every position's hidden state by a vocabulary-sized weight, and a model that
keeps some positions only (`logits[:, -1]`: next-token prediction, last-token classification; BERT's pooler
reading the first token) throws the rest away. XLA does not move a selection before a product, so the whole
head and both its gradients ran: GPT-2's at batch 2 x 128 positions is three products of 20 GFLOP each, a
quarter of its train step on the CPU. Each row of these ops' results reads only the same row of their
row-carrying inputs, so selecting those rows first gives the same numbers (each row the same computation) for a
fraction of the work, and autodiff of the smaller computation gives the gradients. Back through the last
transformer layer, the selection stops where a value is also read by a node outside the selected computation
(the keys and values of an attention read every position): that value is computed whole and selected.

Rows are counted over the selection's leading axes (up to its last selected one): `count` rows in row-major
order, of which it takes `index`. Any value whose leading axes hold `count` rows (a reshape from [batch,
positions, width] to [batch * positions, width] keeps them) is carried as [taken rows, *trailing axes] while
computed on rows; the ops' axis attributes are counted from the end for that.

The graph's own nodes still run as written, so any reader the walker does not see (a subgraph, a graph output)
gets the whole values; when the selection was their only reader, XLA drops them as dead code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import jax.numpy as jnp
import numpy as np

from ..ir import Node, producer, readers
from .axes import wrap_indices
from .layout import ELEMENTWISE, Reordered
from .values import Value, is_static

Run = Callable[[Node, list, int], Any]  # call a node (with these inputs, at this position among its siblings)
Taken = Callable[[np.ndarray], Any]  # a selection applied to row numbers (None: an invalid one)


def _gather(node: Node, args: Sequence[Value]) -> tuple[list[int], Taken] | None:
    if not is_static(*args[1:]):
        return None
    axis, indices = int(node.attributes.get("axis", 0)), np.asarray(args[1])

    def take(rows: np.ndarray) -> np.ndarray | None:
        if indices.dtype.kind not in "iu":
            return None  # the node's own lowering names the error
        return np.take(rows, wrap_indices(indices, rows.shape[axis]), axis=axis)

    return [axis], take


def _slice(node: Node, args: Sequence[Value]) -> tuple[list[int], Taken] | None:
    if not is_static(*args[1:]):
        return None
    if node.since_version == 1:
        starts, ends = node.attributes.get("starts", []), node.attributes.get("ends", [])
        axes, steps = node.attributes.get("axes"), None
    else:
        starts, ends = args[1], args[2]
        axes, steps = (args[i] if len(args) > i else None for i in (3, 4))
    starts, ends = [int(v) for v in np.ravel(starts)], [int(v) for v in np.ravel(ends)]
    axes = list(range(len(starts))) if axes is None else [int(v) for v in np.ravel(axes)]
    steps = [1] * len(starts) if steps is None else [int(v) for v in np.ravel(steps)]
    if not len(starts) == len(ends) == len(axes) == len(steps) or 0 in steps:
        return None

    def take(rows: np.ndarray) -> np.ndarray | None:
        index = [slice(None)] * rows.ndim
        for axis, start, end, step in zip(axes, starts, ends, steps):  # ONNX's clamping is Python's slicing
            index[axis] = slice(start, end, step)
        return rows[tuple(index)]

    return axes, take


def _gather_nd(node: Node, args: Sequence[Value]) -> tuple[list[int], Taken] | None:
    """Whole rows of the leading axes (batch_dims 0), at indices that may be computed (a classifier's last
    non-padding token: `logits[arange(batch), lengths - 1]`): the row numbers are then traced too."""
    indices = args[1]
    depth = int(np.shape(indices)[-1]) if np.ndim(indices) else 0
    if int(node.attributes.get("batch_dims", 0)) != 0 or depth < 1:
        return None
    xp = np if is_static(indices) else jnp

    def take(rows: np.ndarray) -> Any:
        at = wrap_indices(indices, np.array(rows.shape[:depth]))
        return xp.asarray(rows)[tuple(at[..., j] for j in range(depth))]

    return list(range(depth)), take


# selection op -> the axes of its data input it selects along, and the selection as NumPy indexing (ONNX's rules
# for negative indices and out-of-range slice bounds are NumPy's), applied to the row numbers
SELECTIONS: dict[str, Callable[[Node, Sequence[Value]], tuple[list[int], Taken] | None]] = {
    "Gather": _gather,
    "Slice": _slice,
    "GatherND": _gather_nd,
}
# row-wise ops besides those registered as elementwise (registry.register's flag): op -> its inputs that carry
# rows (None: every input, broadcasting as elementwise operands do); the others are used as they are
ROW_WISE: dict[str, tuple[int, ...] | None] = {
    "Cast": None, "Identity": None, "Where": None,
    "MatMul": (0,), "Gemm": (0, 2),  # with a matrix W; Gemm's C where it has a row per row of A
    "LayerNormalization": (0,), "Softmax": (0,), "LogSoftmax": (0,),  # over trailing axes: their `axis`
    "ReduceMean": (0,), "ReduceSum": (0,), "ReduceMax": (0,), "ReduceMin": (0,),  # over trailing axes
    "Reshape": (0,),  # keeping the rows: the rows' trailing axes take the result's shape
}
NORMALIZED_FROM = {"LayerNormalization": -1, "Softmax": -1, "LogSoftmax": -1}  # the `axis` default of today's ops
REDUCTIONS = ("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin")


@dataclass(frozen=True)
class Selection:
    """`index`: the rows a Gather or Slice takes out of the `count` rows of its data's leading axes; `shape`: the
    shape of what it selects."""

    count: int
    index: Any  # NumPy, or traced where the node's indices are
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Step:
    """A producer in the region: run on rows, with `node`'s axis attributes counted from the end."""

    node: Node
    position: int  # among the siblings
    rows: tuple[int, ...]  # its inputs given as rows
    inputs: dict[int, Any] = field(default_factory=dict)  # inputs replaced (reduction axes counted from the end)
    reshape: tuple[int, ...] | None = None  # a Reshape's: the rows' trailing shape (the node itself is not run)


def traced_array(value: Value) -> bool:
    return hasattr(value, "ndim") and not isinstance(value, Reordered) and not is_static(value)


def leading_axes(shape: Sequence[int], count: int) -> int | None:
    """The fewest leading axes of `shape` that hold `count` rows, or None."""
    for p in range(1, len(shape) + 1):
        if math.prod(shape[:p]) == count:
            return p
    return None


def selection_of(node: Node, args: Sequence[Value]) -> Selection | None:
    """What `node` selects, when it is a Gather or Slice with static indices or a GatherND, along non-last axes of
    a traced value, and takes at most half its rows (a language model's shifted logits, `[:, :-1]`, are left whole)."""
    select = SELECTIONS.get(node.op_type) if not node.domain else None
    if select is None or not args or not traced_array(args[0]):
        return None
    shape = tuple(args[0].shape)
    found = select(node, args)
    if found is None:
        return None
    axes, take = found
    if not axes or not all(-len(shape) <= a < len(shape) for a in axes) or \
            len({a % len(shape) for a in axes}) != len(axes):
        return None
    last = max(a % len(shape) for a in axes)
    if last >= len(shape) - 1:  # the last axis is a product's or a normalization's own
        return None
    trailing = len(shape) - last - 1
    count = math.prod(shape[: last + 1])
    taken = take(np.arange(count, dtype=np.int64).reshape(shape[: last + 1] + (1,) * trailing))
    if taken is None or taken.size > count // 2:  # most rows: gathering the values costs about what is saved
        return None
    return Selection(count, taken.reshape(-1), taken.shape[: taken.ndim - trailing] + shape[last + 1:])


def row_wise(node: Node) -> bool:
    """Whether `node`'s op is one of the row-wise ones (whether its inputs make it so, step_of says)."""
    if node.domain or node.impl is None or not node.outputs[0] or any(node.outputs[1:]):
        return False
    return node.impl.layout == ELEMENTWISE or node.op_type in ROW_WISE


def step_of(node: Node, position: int, selection: Selection, read: Callable[[str], Value]) -> Step | None:
    """How `node` computes its result's selected rows from rows of its inputs; None when it cannot."""
    if not row_wise(node):
        return None
    elementwise = node.op_type not in ROW_WISE or ROW_WISE[node.op_type] is None
    try:  # a value `read` does not give (beyond a sealed scope) stops the selection
        out = read(node.outputs[0])
        inputs = [read(n) if n else None for n in node.inputs]
    except KeyError:
        return None
    p = leading_axes(out.shape, selection.count) if traced_array(out) else None
    if p is None:
        return None
    shape, rank, op = tuple(out.shape), out.ndim, node.op_type
    if op == "Reshape":
        return Step(node, position, (0,), reshape=shape[p:]) if leading_axes(inputs[0].shape, selection.count) \
            else None
    if (op == "MatMul" and (np.ndim(inputs[1]) != 2 or p >= rank)) or \
            (op == "Gemm" and (p != 1 or node.attributes.get("transA", 0))):
        return None
    attributes, replaced = node.attributes, {}
    if op in NORMALIZED_FROM:
        axis = int(attributes.get("axis", NORMALIZED_FROM[op])) % rank
        if axis < p:
            return None
        attributes = {**attributes, "axis": axis - rank}
    if op in REDUCTIONS:
        axes, rank_in = reduced_axes(node, inputs), inputs[0].ndim
        if not axes or min(a % rank_in for a in axes) < p:
            return None
        from_end = [a % rank_in - rank_in for a in axes]
        if "axes" in attributes:
            attributes = {**attributes, "axes": from_end}
        else:
            replaced[1] = np.array(from_end, np.int64)
    carriers = range(len(inputs)) if elementwise else ROW_WISE[op]
    rows = []
    for i, value in enumerate(inputs):
        if value is None or i in replaced:
            continue
        vshape = tuple(np.shape(value))
        if i in carriers and vshape[:p] == shape[:p] and (len(vshape) == rank or not elementwise):
            rows.append(i)
        elif elementwise and len(vshape) > rank - p:  # an operand reaching the rows broadcasts over them only
            if any(d != 1 for d in vshape[: len(vshape) - (rank - p)]):  # as ones: dropped to its trailing axes
                return None
            replaced[i] = (np if is_static(value) else jnp).reshape(value, vshape[len(vshape) - (rank - p):])
        elif not elementwise and i == 0:  # the rows of a product or a normalization
            return None
    if not rows:
        return None
    changed = replace(node, attributes=attributes) if attributes is not node.attributes else node
    return Step(changed, position, tuple(rows), replaced)


def reduced_axes(node: Node, inputs: Sequence[Value]) -> list[int] | None:
    """A reduction's axes when known at trace time (an attribute before opset 18, ReduceSum's 13; else input 1)."""
    if "axes" in node.attributes:
        return list(node.attributes["axes"] or [])
    if len(inputs) > 1 and inputs[1] is not None and is_static(inputs[1]):
        return [int(a) for a in np.ravel(inputs[1])]
    return None


@dataclass(frozen=True)
class Plan:
    """The values to compute on the selected rows, with their producers; every other row-carrying input of those
    producers is selected where it stands."""

    selection: Selection
    start: str
    region: dict[str, Step]


def plan(node: Node, args: Sequence[Value], read: Callable[[str], Value], siblings: Sequence[Node],
         position: int) -> Plan | None:
    """How to compute `node` (input values `args`; `read` gives any value of its scope) from the rows it selects,
    when it selects rows of a row-wise op's result that nothing else among `siblings` reads; None otherwise."""
    if node.op_type not in SELECTIONS or node.domain or not args or not traced_array(args[0]):
        return None
    start = node.inputs[0]
    first = producer(siblings, position, start)
    if first is None or not row_wise(siblings[first]):
        return None
    selection = selection_of(node, args)
    if selection is None or step_of(siblings[first], first, selection, read) is None:
        return None
    made = {o: i for i in range(position) for o in siblings[i].outputs if o}
    reading = {name: set(at) for name, at in readers(siblings).items()}  # subgraphs' reads included
    if reading[start] != {position}:
        return None
    # grow: every row-wise producer reachable through row-carrying inputs
    region: dict[str, Step] = {}
    pending = [start]
    while pending:
        name = pending.pop()
        if name in region or name not in made:
            continue
        step = step_of(siblings[made[name]], made[name], selection, read)
        if step is not None:
            region[name] = step
            pending.extend(step.node.inputs[i] for i in step.rows)
    # shrink: a value read by a node outside the region is computed whole anyway, so it is selected where it
    # stands (and what only it led to drops out)
    while True:
        inside = {position} | {step.position for step in region.values()}
        kept = {n for n in region if n == start or reading[n] <= inside}
        reachable, pending = set(), [start]
        while pending:
            name = pending.pop()
            if name in kept and name not in reachable:
                reachable.add(name)
                pending.extend(region[name].node.inputs[i] for i in region[name].rows)
        if reachable == set(region):
            return Plan(selection, start, region)
        region = {n: region[n] for n in reachable}


def computed(found: Plan, read: Callable[[str], Value], run: Run) -> Value:
    """The selection's result, computed on rows as `found` plans (`read` gives a value as the model sees it)."""
    selection, done = found.selection, {}

    def rows(name: str) -> Value:
        if name not in done:
            step = found.region.get(name)
            if step is None:  # selected where it stands
                value = read(name)
                p = leading_axes(np.shape(value), selection.count)
                xp = np if is_static(value) and is_static(selection.index) else jnp
                flat = xp.reshape(value, (selection.count, *np.shape(value)[p:]))
                done[name] = xp.take(flat, selection.index, axis=0)
            elif step.reshape is not None:
                done[name] = jnp.reshape(rows(step.node.inputs[0]), (selection.index.size, *step.reshape))
            else:
                inputs = [rows(n) if i in step.rows else step.inputs[i] if i in step.inputs else read(n) if n else None
                          for i, n in enumerate(step.node.inputs)]
                result = run(step.node, inputs, step.position)
                done[name] = result[0] if isinstance(result, tuple) else result
        return done[name]

    return jnp.reshape(rows(found.start), selection.shape)
