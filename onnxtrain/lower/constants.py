"""Float constants enter a compiled program as arguments, not as literals compiled into it.

A float tensor that a graph computes from constants alone (a `Constant` node, a `ConstantOfShape` of a constant
shape, arithmetic on those) is static while tracing, like every value known at trace time, and a traced op that
read it used to compile it into the executable. Two reasons not to: XLA-CPU in jaxlib 0.10.2 miscompiles
a convolution whose filter is a splat constant when its result is reduced (a Conv over `ConstantOfShape`
weights then GlobalAveragePool returned NaN or garbage: docs/known-upstream-bugs.md), and a weight compiled in
makes the executable, and its persistent-cache entry, as large as the weight. So such values are computed once
at load (`load_time_constants`), placed on the devices like the float initializers, passed to each program as
one more argument, and a traced op receives the argument instead of the literal (`with_hoisted`). The value
stays static in the walker's scope: ops that read it at trace time (shape arithmetic, `static()`) see NumPy
as before.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import numpy as np

from ..dtypes import is_float
from ..errors import OnnxTrainError
from .values import Value, is_static

if TYPE_CHECKING:
    from ..model import Graph, Node

# Fewer elements stay literals: scalars, Resize scales/roi and the like, which ops read at trace time and XLA
# folds best as literals. The smallest filter seen to trigger the XLA-CPU bug above has 64 elements.
MIN_ELEMENTS = 17

_HOISTED: ContextVar[Mapping[str, Any]] = ContextVar("onnxtrain_hoisted_constants", default={})


def hoistable(value: Value) -> bool:
    return (isinstance(value, np.ndarray) and is_float(value.dtype) and value.size >= MIN_ELEMENTS)


def foldable(node: "Node") -> bool:
    """Nodes evaluated at load: plain lowerings. Random ops, Gradient and control flow (which take the node's
    context or subgraphs) and function bodies are left to the trace."""
    from ..model import Graph

    graphs = any(isinstance(v, Graph) or (isinstance(v, list) and v and isinstance(v[0], Graph))
                 for v in node.attributes.values())
    return node.impl is not None and not node.impl.wants_ctx and not graphs


def fold(nodes: Sequence["Node"], known: Mapping[str, Value]) -> dict[str, Value]:
    """`known` plus every value `nodes` compute from it alone, as the trace would compute them."""
    from .walker import Scope, TraceContext, run_node

    scope = Scope(dict(known))
    for position, node in enumerate(nodes):
        inputs = [name for name in node.inputs if name]
        if not (foldable(node) and all(name in scope.values and is_static(scope.values[name]) for name in inputs)):
            continue
        try:
            run_node(node, scope, TraceContext(key=None), nodes, position)
        except OnnxTrainError:
            continue  # the trace runs the node again and reports the error where it always has
    return scope.values


def load_time_constants(graphs: Sequence["Graph"], statics: Sequence[Mapping[str, Value]]) -> list[dict[str, np.ndarray]]:
    """The hoistable values each graph computes from constants alone: the main graph (first) from its static
    initializers, each algorithm graph from its own and the main graph's values."""
    main = fold(graphs[0].nodes, statics[0])
    found = [{n: v for n, v in main.items() if n not in statics[0] and hoistable(v)}]
    for graph, static in zip(graphs[1:], statics[1:]):
        given = {**main, **static}
        found.append({n: v for n, v in fold(graph.nodes, given).items() if n not in given and hoistable(v)})
    return found


@contextmanager
def hoisting(arguments: Mapping[str, Any]) -> Iterator[None]:
    """While a program traces: `arguments` (value name -> the program's traced argument) replace the literals."""
    token = _HOISTED.set(arguments)
    try:
        yield
    finally:
        _HOISTED.reset(token)


def with_hoisted(node: "Node", args: list[Value]) -> list[Value]:
    """`args` of a traced call with each hoisted constant replaced by the program's argument holding it (the same
    list when there is none)."""
    arguments = _HOISTED.get()
    if not arguments:
        return args
    replaced = list(args)
    for i, (name, value) in enumerate(zip(node.inputs, args)):
        argument = arguments.get(name)
        # the shape/dtype check guards a subgraph or function body that reuses an outer name
        if argument is not None and hoistable(value) and argument.shape == value.shape and argument.dtype == value.dtype:
            replaced[i] = argument
    return replaced if any(a is not b for a, b in zip(replaced, args)) else args
