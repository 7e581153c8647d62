"""Values a graph computes from constants alone, computed once at load by running the trace's own lowerings on
NumPy (the hoisting that feeds them to compiled programs is in constants.py)."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from ..errors import OnnxTrainError, ValueTooLargeError
from ..ir import Graph, Node
from .constants import hoistable
from .values import Value, is_static
from .walker import Scope, TraceContext, run_node


def foldable(node: "Node") -> bool:
    """Nodes evaluated at load: plain lowerings. Random ops, Gradient and control flow (which take the node's
    context or subgraphs) and function bodies are left to the trace."""
    graphs = any(isinstance(v, Graph) or (isinstance(v, list) and v and isinstance(v[0], Graph))
                 for v in node.attributes.values())
    return node.impl is not None and not node.impl.wants_ctx and not graphs


def fold(nodes: Sequence["Node"], known: Mapping[str, Value]) -> dict[str, Value]:
    """`known` plus every value `nodes` compute from it alone, as the trace would compute them."""
    scope = Scope(dict(known))
    for position, node in enumerate(nodes):
        inputs = [name for name in node.inputs if name]
        if not (foldable(node) and all(name in scope.values and is_static(scope.values[name]) for name in inputs)):
            continue
        try:
            run_node(node, scope, TraceContext(key=None), nodes, position)
        except ValueTooLargeError:
            raise  # a constant no host holds: refused at load, not computed again by each trace
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
