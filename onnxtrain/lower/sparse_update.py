"""Plain SGD of an embedding table updates the rows its lookups read, not the whole table.

A weight the forward pass reads only through one Gather along its first axis (a word embedding) has a gradient
that is zero outside the rows looked up. Autodiff builds it whole, a scatter-add of the rows' gradients into a
table of zeros, and SGD's update `W - lr * dW` then reads and writes every row: BERT-base's 94 MB word embedding
took 43 ms of its 780 ms train step on the CPU (zero fill and update), for 256 rows looked up. So the Gradient
node also hands on, per such weight, the looked-up indices and the rows' gradients (`SparseRows`), and where the
algorithm updates the weight as `Sub(W, Mul(lr, dW))` with nothing else reading dW, the walker writes only the
rows looked up (`sgd_rows`); XLA then drops the whole-table gradient as dead code.
A padding row zeroed in that gradient (make_trainable's ScatterND of a zero row) keeps it rows (`zeroed_rows`).

Each updated row gets the same value as before: the rows' gradients are summed per distinct index in the order
the whole-table scatter-add sums them, then scaled and subtracted as the graph says, and a row not looked up
stays as it is, which `W - lr * 0` is for a finite, non-negative rate. For any other rate (a negative zero's
sign, an infinite or NaN rate) the whole-table update runs instead, inside a conditional.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..ir import Node, producer, readers
from .values import Value, is_static


@dataclass(frozen=True)
class SparseRows:
    """The gradient of `base` (the value the Gradient node differentiated) as the gradients `rows` of the rows at
    `indices` (flat, counted from the start): whole, a scatter-add of `rows` into zeros."""

    base: Any
    indices: Any  # [N] integer
    rows: Any  # [N, *base.shape[1:]]

    def whole(self) -> Any:
        """As autodiff builds it: out-of-range lookups (filled, not read) add nothing."""
        return jnp.zeros_like(self.base).at[self.indices].add(self.rows, mode="drop")


@jax.custom_jvp
def tapped(value: Any, tap: Any) -> Any:
    """`value`, whose derivative also flows to `tap` (a zero-valued input of the same shape): the cotangent of
    `tap` is the cotangent of `value`, i.e. the gradient of a lookup's rows."""
    return value


@tapped.defjvp
def _tapped_jvp(primals: tuple, tangents: tuple) -> tuple:
    return primals[0], tangents[0] + tangents[1]


def lookups(nodes: Sequence[Node], positions: Sequence[int], xs: Sequence[str]) -> dict[str, int]:
    """Of `xs`, those read at `positions` by exactly one node, a Gather along the first axis reading it as the
    table (not the indices, nor from a subgraph, whose part of the gradient would not be rows): name -> that
    node's position."""
    reading = readers(nodes, positions)
    found = {}
    for x in xs:
        at = reading.get(x, [])
        if len(at) == 1:
            node = nodes[at[0]]
            if (node.op_type == "Gather" and not node.domain and node.inputs[0] == x and x not in node.inputs[1:]
                    and int(node.attributes.get("axis", 0)) == 0):
                found[x] = at[0]
    return found


def sgd_rows(node: Node, args: Sequence[Value], sparse: dict[str, SparseRows], read: Callable[[str], Value],
             siblings: Sequence[Node], position: int) -> Any:
    """`Sub(W, Mul(lr, dW))` (either order of Mul's operands) on the rows dW has, when dW is a lookup's
    `SparseRows` of this W and nothing else reads dW or the step; None otherwise."""
    if node.op_type != "Sub" or node.domain or len(args) != 2 or not sparse:
        return None
    step = node.inputs[1]
    made = producer(siblings, position, step)
    if made is None or siblings[made].op_type != "Mul" or siblings[made].domain:
        return None
    mul = siblings[made]
    gradient = next((n for n in mul.inputs if n in sparse), None)
    if gradient is None or sparse[gradient].base is not args[0] or list(mul.inputs).count(gradient) != 1:
        return None
    rate = read(next(n for n in mul.inputs if n != gradient))
    if np.ndim(rate) != 0 or np.result_type(rate) != np.result_type(args[0]):
        return None
    reading = readers(siblings)
    if reading.get(gradient) != [made] or reading.get(step) != [position]:  # this Mul and this Sub alone
        return None
    return update_rows(args[0], sparse[gradient], rate)


def zeroed_rows(node: Node, args: Sequence[Value], sparse: dict[str, SparseRows]) -> SparseRows | None:
    """The rows of `ScatterND(dW, rows, zeros)` (make_trainable's padding rows, optimizers.zero_parts) where dW is
    a lookup's SparseRows: those rows' gradients zeroed, so SGD still updates only the rows looked up; None for
    any other node."""
    if (node.op_type != "ScatterND" or node.domain or len(args) != 3 or node.inputs[0] not in sparse
            or node.attributes.get("reduction", "none") != "none" or not is_static(args[1], args[2])):
        return None
    rows, zeros = np.asarray(args[1]), np.asarray(args[2])
    grad = sparse[node.inputs[0]]
    if rows.ndim != 2 or rows.shape[1] != 1 or np.any(zeros) or zeros.shape[1:] != grad.rows.shape[1:]:
        return None
    zeroed = jnp.isin(grad.indices, rows.ravel() % grad.base.shape[0])
    return SparseRows(grad.base, grad.indices,
                      jnp.where(zeroed.reshape(-1, *[1] * (grad.rows.ndim - 1)), 0, grad.rows))


def first_occurrences(indices: Any) -> Any:
    """For each lookup, the position of the first lookup of the same index: the slot its gradient is summed in,
    so each index's gradients add up in the order of the lookups, as the whole-table scatter-add adds them."""
    count = indices.shape[0]
    order = jnp.argsort(indices, stable=True)
    ordered = indices[order]
    starts = jnp.concatenate([jnp.ones(1, bool), ordered[1:] != ordered[:-1]])
    group_start = jax.lax.cummax(jnp.where(starts, jnp.arange(count), 0), axis=0)
    return jnp.zeros(count, order.dtype).at[order].set(order[group_start])


def update_rows(table: Any, grad: SparseRows, rate: Any) -> Any:
    """`table - rate * dW` with dW given as rows (see the module's docstring for why the values are the same)."""
    indices = grad.indices
    count = indices.shape[0]
    first = first_occurrences(indices)
    sums = jnp.zeros_like(grad.rows).at[first].add(grad.rows)
    rate = jnp.asarray(rate)

    def rows_only(table: Any) -> Any:
        looked_up = table.at[indices].get(mode="fill", fill_value=0)
        return table.at[indices].set(looked_up - rate * sums[first], mode="drop")

    def whole(table: Any) -> Any:
        return table - rate * grad.whole()

    exact = jnp.isfinite(rate) & ~jnp.signbit(rate)
    return jax.lax.cond(exact, rows_only, whole, table) if count else whole(table)
