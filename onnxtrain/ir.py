"""The frozen view of an ONNX graph the lowering walks: Graph, Node, ValueInfo.

It imports nothing of onnxtrain at run time, so every module that builds these views (lower/build.py) or uses
them (the walker, the engine, the state bindings) may import it without making an import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np
import onnx

# the prefix of onnxtrain's own metadata_props keys (a Node keeps those of its node's)
METADATA_PREFIX = "onnxtrain."

if TYPE_CHECKING:  # annotation only: the registry's package imports every op, which import this module
    from .lower.registry import OpImpl


@dataclass(frozen=True)
class ValueInfo:
    """A graph input or output: its name, ONNX element type (None if not a tensor) and shape (None if unknown)."""

    name: str
    elem_type: int | None
    shape: tuple[int | str | None, ...] | None
    type_proto: onnx.TypeProto


@dataclass(frozen=True)
class Node:
    op_type: str
    domain: str
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attributes: dict[str, Any]  # decoded, schema defaults filled in; subgraphs are Graphs
    raw_attributes: tuple[onnx.AttributeProto, ...]  # as written (function expansion needs the protos)
    opset: int  # the opset imported for this node's domain where it stands
    since_version: int | None  # of the schema the opset selects; None for a model-local function
    impl: OpImpl | None  # a registered lowering, or None when `function` is set or the schema has a body
    function: onnx.FunctionProto | None = None  # a model-local function this node calls
    # its metadata_props under onnxtrain's own keys (METADATA_PREFIX): records make_trainable leaves for a lowering
    # (optional metadata, which other runtimes ignore; lower/ops/normalization.py reads one)
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        name = f" {self.name!r}" if self.name else ""
        domain = f"{self.domain}::" if self.domain else ""
        return f"{domain}{self.op_type}{name}"


@dataclass(frozen=True)
class Graph:
    name: str
    inputs: tuple[ValueInfo, ...]
    outputs: tuple[ValueInfo, ...]
    initializers: dict[str, np.ndarray]
    nodes: tuple[Node, ...]


# Values a node reads through attributes, by name, beside its inputs: the training domain's Gradient
# differentiates `y` with respect to `xs` (and `zs`) by tracing again the nodes between them, so it needs y's
# whole forward slice, which no input of its names (its inputs are the values of xs and zs alone)
NAMED_READS = {("ai.onnx.preview.training", "Gradient"): ("xs", "y", "zs")}


def reads(node: Node) -> set[str]:
    """Every value name a node reads: its inputs, the outer-scope names its subgraphs read (a dependency through
    an If/Loop body counts), and the names NAMED_READS lists among its attributes."""
    names = {n for n in node.inputs if n} | free_names(node)
    for attribute in NAMED_READS.get((node.domain, node.op_type), ()):
        value = node.attributes.get(attribute, ())
        names.update(n for n in ([value] if isinstance(value, str) else value) if n)
    return names


def free_names(node: Node) -> set[str]:
    """Outer-scope names a node's subgraphs read."""
    names: set[str] = set()
    for value in node.attributes.values():
        for graph in value if isinstance(value, list) else [value]:
            if isinstance(graph, Graph):
                defined = {i.name for i in graph.inputs} | set(graph.initializers)
                for inner in graph.nodes:
                    names.update(reads(inner) - defined)
                    defined.update(inner.outputs)
    return names


def readers(nodes: Sequence[Node], positions: Iterable[int] | None = None) -> dict[str, list[int]]:
    """Value name -> the positions (among `positions`, default all) of the nodes reading it (`reads`); each
    position once."""
    found: dict[str, list[int]] = {}
    for i in range(len(nodes)) if positions is None else positions:
        for name in reads(nodes[i]):
            found.setdefault(name, []).append(i)
    return found


def live(nodes: Sequence[Node], needed: Iterable[str]) -> tuple[Node, ...]:
    """The nodes that compute a value of `needed`, or a value such a node reads (`reads`), in their order: what a
    trace that reads `needed` alone must walk."""
    wanted, kept = set(needed), []
    for node in reversed(nodes):
        if not wanted.isdisjoint(node.outputs):
            kept.append(node)
            wanted |= reads(node)
    return tuple(reversed(kept))


def producer(nodes: Sequence[Node], before: int, name: str) -> int | None:
    """The position of the last node before `before` that outputs `name` (None: a graph input, an initializer or
    an outer-scope value)."""
    return next((i for i in range(before - 1, -1, -1) if name in nodes[i].outputs), None)
