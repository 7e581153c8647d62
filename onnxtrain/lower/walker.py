"""Walk a graph's nodes in order over a scope of static/traced values; subgraphs see their outer scopes."""

from __future__ import annotations

import dataclasses
import math
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import jax
import numpy as np
import onnx

from ..dtypes import onnx_type
from ..errors import NodeError, OnnxTrainError, StaticValueRequired, ValueTooLargeError
from ..ir import Graph, Node
from ..tensor_data import MAX_VALUE_BYTES, DenseBudget
from . import layout
from .autocast import MixedPrecision, autocasting
from .build import (FunctionId, Resolver, build_node, call_attributes, missing_required, new_sparse_budget,
                    raise_if_missing)
from .layout import channels_first, channels_first_results
from .constants import hoisting, with_hoisted
from .registry import schema_for
from .selection import computed, plan
from .sparse_update import SparseRows, sgd_rows, zeroed_rows
from .typecheck import check_declared, check_node
from .values import Value, host_sized, is_static, static_evaluation, to_static


class Scope:
    """name -> value, falling back to the enclosing graph's scope (ONNX outer-scope name resolution)."""

    def __init__(self, values: dict[str, Value] | None = None, parent: "Scope | None" = None, sealed: bool = False):
        self.values: dict[str, Value] = dict(values or {})
        self.parent = parent
        # a function JAX must not see close over traced values (a custom_vjp's): the enclosing scopes' traced
        # values reach it only as its inputs, which are in this scope
        self.sealed = sealed

    def __getitem__(self, name: str) -> Value:
        """The value as the model sees it (a channels-last activation transposed back)."""
        return channels_first(self.raw(name))

    def raw(self, name: str) -> Value:
        """The value as stored: possibly a layout.ChannelsLast."""
        scope: Scope | None = self
        while scope is not None:
            if name in scope.values:
                return scope.values[name]
            scope = scope.parent
        raise KeyError(name)

    def visible(self, name: str) -> Value:
        """The value as stored, when a node of this scope could read it without its being an input of a sealed
        scope between: a trace-time choice (lower/selection.py) may read values no node of its own reads."""
        scope: Scope | None = self
        sealed = False
        while scope is not None:
            if name in scope.values and not (sealed and not is_static(scope.values[name])):
                return scope.values[name]
            sealed = sealed or scope.sealed
            scope = scope.parent
        raise KeyError(name)

    def __contains__(self, name: str) -> bool:
        try:
            self.raw(name)
        except KeyError:
            return False
        return True

    def __setitem__(self, name: str, value: Value) -> None:
        self.values[name] = value


@dataclass
class Draws:
    """Whether a trace drew random numbers: one per trace, shared by the TraceContext copies subgraph bodies make."""

    any: bool = False


@dataclass
class TraceContext:
    """What every node of one trace shares: the random key and the model-local functions."""

    key: Any  # a jax PRNG key (traced), the root of every random op's stream
    functions: dict[FunctionId, onnx.FunctionProto] = field(default_factory=dict)
    training: bool = False  # True inside train_step: Dropout without a training_mode input drops
    step: Any = None  # the train step count (traced) inside train_step, else None
    iterations: tuple = ()  # the (traced) iteration of each enclosing loop, outermost first
    in_function: bool = False  # inside a function body, where an input the call left out has no value
    draws: Draws = field(default_factory=Draws)
    mixed_precision: MixedPrecision | None = None  # load's option: the products' compute type (lower/autocast.py)
    remat: bool | str = False  # load's option: what Gradient recomputes of its forward slice (ops/training.py)
    # a Gradient output (value name) that is a lookup table's gradient -> its rows (lower/sparse_update.py)
    sparse_gradients: dict[str, SparseRows] = field(default_factory=dict)
    # what the dense forms of the sparse tensors of the function bodies expanded in this trace take together (each
    # expansion holds its own until compiled): a body's resolver with a budget of its own bounded each call alone
    sparse_budget: DenseBudget = field(default_factory=new_sparse_budget)


@dataclass
class NodeContext:
    """Handed to implementations that declare `ctx`: the node, its scope, and its place among its siblings."""

    node: "Node"
    scope: Scope
    trace: TraceContext
    siblings: Sequence["Node"]
    position: int

    def rng(self, seed: float | None = None):
        """A PRNG key for this node: its own `seed` attribute wins (advanced by the step count in a train step and
        by the iteration of each enclosing loop, as a seeded generator advances between calls), else the run's
        key folded with the node."""
        self.trace.draws.any = True
        if seed is not None:
            key = jax.random.key(int(seed))
            steps = () if self.trace.step is None else (self.trace.step,)
            for position in (*steps, *self.trace.iterations):
                key = jax.random.fold_in(key, position)
            return key
        tag = zlib.crc32("\0".join(self.node.outputs).encode()) & 0x7FFFFFFF
        return jax.random.fold_in(self.trace.key, tag)


class Subgraph:
    """A graph attribute bound to the scope it appears in: call it with its inputs, get its outputs, each what
    the graph declares (`owner` names the node and attribute in the error)."""

    def __init__(self, graph: "Graph", scope: Scope, trace: TraceContext, owner: str = "a subgraph"):
        self.graph = graph
        self.scope = scope
        self.trace = trace
        self.owner = owner

    @property
    def output_names(self) -> list[str]:
        return [o.name for o in self.graph.outputs]

    def __call__(self, *args: Value, iteration: Value = None) -> list[Value]:
        """Run the body; a loop passes its `iteration` so random ops draw fresh numbers on every iteration."""
        trace = self.trace
        if iteration is not None:
            trace = dataclasses.replace(trace, key=jax.random.fold_in(trace.key, iteration),
                                        iterations=(*trace.iterations, iteration))
        results = run_graph(self.graph, list(args), trace, outer=self.scope)
        for info, value in zip(self.graph.outputs, results):
            check_declared(info, value, f"{self.owner}: output {info.name!r} of graph {self.graph.name!r}")
        return results


def run_graph(graph: "Graph", args: Sequence[Value], trace: TraceContext, outer: Scope | None = None) -> list[Value]:
    scope = Scope(dict(graph.initializers), outer)
    for info, value in zip(graph.inputs, args):
        scope[info.name] = value
    run_nodes(graph.nodes, scope, trace)
    return [read_value(scope, o.name, f"output of graph {graph.name!r}") for o in graph.outputs]


def read_value(scope: Scope, name: str, what: str, raw: bool = False) -> Value:
    try:
        return scope.raw(name) if raw else scope[name]
    except KeyError:
        raise NodeError(f"{what}: value {name!r} is not defined before it is used") from None


def run_nodes(nodes: Sequence["Node"], scope: Scope, trace: TraceContext) -> None:
    with autocasting(trace.mixed_precision):  # the product lowerings read it without the node's context
        for position, node in enumerate(nodes):
            run_node(node, scope, trace, nodes, position)


def run_node(node: "Node", scope: Scope, trace: TraceContext, siblings: Sequence["Node"], position: int) -> None:
    args = [read_value(scope, name, f"input of {node.label}", raw=True) if name else None for name in node.inputs]
    try:
        results = call_reordered(node, args, scope, trace, siblings, position)
    except StaticValueRequired as exc:
        if exc.node is not None:
            raise
        raise StaticValueRequired(exc.what, value_name_of(node, exc.what), node.label, exc.reason) from None
    except ValueTooLargeError as exc:
        if exc.node is not None:
            raise
        raise ValueTooLargeError(exc.description, node.label) from None
    except OnnxTrainError:
        raise
    except MemoryError as exc:  # under the bound of host memory, more than is free of it
        raise ValueTooLargeError(f"its result does not fit in host memory ({exc})", node.label) from None
    except Exception as exc:
        raise NodeError(f"{node.label}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(results, tuple):  # a list is one value (an ONNX sequence); a tuple is several outputs
        results = (results,)
    check_sizes(node, results)
    wanted = [i for i, name in enumerate(node.outputs) if name]
    if wanted and wanted[-1] >= len(results):
        raise NodeError(f"{node.label}: produced {len(results)} outputs, the model asks for {len(node.outputs)}")
    for i in wanted:
        scope[node.outputs[i]] = results[i]


def call_reordered(
    node: "Node", args: list[Value], scope: Scope, trace: TraceContext, siblings: Sequence["Node"], position: int
) -> Any:
    """The node's results; a selection of rows computed from the rows of the values it selects from
    (lower/selection.py), and SGD's update of a lookup table on the rows looked up (lower/sparse_update.py),
    where they can be."""

    def run(other: "Node", inputs: list, at: int) -> Any:
        return call_node(other, inputs, scope, trace, siblings, at)

    found = plan(node, args, scope.visible, siblings, position)
    if found is not None:
        return computed(found, lambda name: channels_first(scope.visible(name)), run)
    rows = sgd_rows(node, args, trace.sparse_gradients, scope.visible, siblings, position)
    if rows is not None:
        return rows
    zeroed = zeroed_rows(node, args, trace.sparse_gradients)
    if zeroed is not None:  # a padding row's gradient zeroed: still rows (before the call, which pops args)
        trace.sparse_gradients[node.outputs[0]] = zeroed
    return call_node(node, args, scope, trace, siblings, position)


def check_required_present(node: "Node", args: Sequence[Value]) -> None:
    """A required input of a function body's node has a value: it may name an input the call left out (build.py
    allows fewer, as absent optional inputs), which the lowering would receive as None (a TypeError). Only there:
    elsewhere a name left empty is refused at load (build.check_input_count), and None is an empty optional's value."""
    schema = schema_for(node.domain, node.op_type, node.opset)
    if schema is None:
        return
    missing = missing_required(schema, [value is not None for value in args])
    if missing:
        i = missing[0]
        raise NodeError(f"{node.label}: input {i} ({schema.inputs[i].name!r}) of {node.op_type}-"
                        f"{schema.since_version} is required, but {node.inputs[i]!r} has no value (an input the "
                        "function call did not pass)")


def value_name_of(node: "Node", formal_input: str) -> str | None:
    schema = schema_for(node.domain, node.op_type, node.opset)
    if schema is None:
        return None
    for i, formal in enumerate(schema.inputs):
        if formal.name == formal_input and i < len(node.inputs):
            return node.inputs[i]
    return None


def call_node(
    node: "Node", args: list[Value], scope: Scope, trace: TraceContext, siblings: Sequence["Node"], position: int
) -> Any:
    check_node(node, args)
    if trace.in_function:
        check_required_present(node, args)
    if node.impl is None:
        return call_function(node, [channels_first(a) for a in args], trace)
    def bound(graph: Graph, attribute: str) -> Subgraph:
        return Subgraph(graph, scope, trace, f"{node.label} ({attribute})")

    attrs = {
        name: ([bound(g, name) for g in v] if is_graph_list(v) else bound(v, name))
        if isinstance(v, Graph) or is_graph_list(v)
        else v
        for name, v in node.attributes.items()
    }
    if node.impl.wants_ctx:
        attrs["ctx"] = NodeContext(node, scope, trace, siblings, position)
    while args and args[-1] is None:  # absent trailing optional inputs take the implementation's defaults
        args.pop()
    if is_static(*args) and any(holds_huge_number(a) for a in args):  # built on the host: its size checked first
        for name, shape, dtype in result_arrays(node, abstract_results(node, args, attrs)):
            host_sized(shape, dtype, f"output {name!r}")
    if not is_static(*args):
        hoisted = with_hoisted(node, args)
        if hoisted is not args:
            try:
                return layout.call(node.impl.fn, node.impl.layout, hoisted, attrs)
            except StaticValueRequired:
                pass  # the op reads that constant at trace time: it stays a literal
        return layout.call(node.impl.fn, node.impl.layout, args, attrs)
    with static_evaluation():
        return to_static(layout.channels_first_results(node.impl.fn(*args, **attrs)))


def result_arrays(node: "Node", results: Sequence[Value]) -> Iterator[tuple[str, tuple[int, ...], np.dtype]]:
    """(output name, shape, dtype) of each array among a node's results (a sequence's elements each)."""
    for name, value in zip(node.outputs, results):
        for tensor in value if isinstance(value, list) else [value]:
            shape, dtype = getattr(tensor, "shape", None), getattr(tensor, "dtype", None)
            if shape is not None and dtype is not None:
                yield name, tuple(int(d) for d in shape), np.dtype(dtype)


def check_sizes(node: "Node", results: Sequence[Value]) -> None:
    """ValueTooLargeError for a result larger than MAX_VALUE_BYTES. Tracing only builds shapes, so a traced node is
    checked on its results; a static one runs eagerly on the host (XLA compiles it at once), so it is checked
    against host memory on `abstract_results`, before it runs (call_node)."""
    for name, shape, dtype in result_arrays(node, results):
        size = dtype.itemsize * math.prod(shape)
        if size > MAX_VALUE_BYTES:
            raise ValueTooLargeError(f"output {name!r} would be {dtype.name}{list(shape)}, {size:.3g} bytes: more "
                                     "than any device holds (the limit is 2**48 bytes)", node.label)


def holds_huge_number(value: Value) -> bool:
    """A small static numeric input (a shape, sizes, repeats, a range limit: at most 64 numbers) with an element,
    or a product of them (a shape's size), too large for a real tensor, so that the result may be huge."""
    if isinstance(value, list):
        return any(holds_huge_number(v) for v in value)
    if not isinstance(value, np.ndarray) or value.dtype.kind not in "iuf" or not 0 < value.size <= 64:
        return False
    magnitudes = np.abs(value.astype(np.float64))
    return bool(np.max(magnitudes) >= 2**31 or np.prod(np.maximum(magnitudes, 1)) >= 2**31)


def abstract_results(node: "Node", args: list[Value], attrs: dict[str, Any]) -> tuple:
    """The node's results as shapes and dtypes, traced (its inputs stay NumPy: static() reads them) but not run.
    Nothing for an op that fails to trace so: the real call reports its error."""
    try:
        results = jax.eval_shape(lambda: channels_first_results(node.impl.fn(*args, **attrs)))
    except Exception:  # noqa: BLE001 - the real call reports any error of the op itself
        return ()
    return results if isinstance(results, tuple) else (results,)


def is_graph_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], Graph)


def call_function(node: "Node", args: list[Value], trace: TraceContext) -> tuple[Value, ...]:
    """Run a node by expanding a function body: a model-local FunctionProto or the op schema's own."""
    if node.function is not None:
        function = node.function
        caller_attributes = call_attributes(function, node.raw_attributes)
    else:
        defaults = schema_default_attributes(node)
        function = schema_function(node, args, defaults)
        caller_attributes = defaults | {a.name: a for a in node.raw_attributes}
    resolver = Resolver({}, trace.functions, sparse_budget=trace.sparse_budget).with_opsets(function.opset_import)
    body = [build_node(n, resolver, caller_attributes) for n in function.node]
    raise_if_missing(resolver)
    scope = Scope({name: value for name, value in zip(function.input, args)})
    for name in function.input[len(args):]:
        scope[name] = None
    scope.values.setdefault("", None)
    with hoisting({}):  # a body's value names are its own: none of them is a program argument
        run_nodes(body, scope, dataclasses.replace(trace, in_function=True))
    return tuple(read_value(scope, name, f"output of function {function.name!r}") for name in function.output)


def schema_default_attributes(node: "Node") -> dict[str, onnx.AttributeProto]:
    schema = schema_for(node.domain, node.op_type, node.opset)
    return {
        name: spec.default_value
        for name, spec in schema.attributes.items()
        if spec.default_value.type != onnx.AttributeProto.UNDEFINED
    }


def schema_function(
    node: "Node", args: list[Value], defaults: dict[str, onnx.AttributeProto]
) -> onnx.FunctionProto:
    schema = schema_for(node.domain, node.op_type, node.opset)
    proto = onnx.FunctionProto()
    plain = [v for v in schema.function_opset_versions if v <= node.opset]
    contextual = [v for v in schema.context_dependent_function_opset_versions if v <= node.opset]
    if plain:
        proto.ParseFromString(schema.get_function_with_opset_version(max(plain)))
        return proto
    if not contextual and schema.has_function:
        proto.CopyFrom(schema.function_body)
        return proto
    node_proto = onnx.helper.make_node(node.op_type, node.inputs, node.outputs, name=node.name, domain=node.domain)
    node_proto.attribute.extend(node.raw_attributes)
    present = {a.name for a in node.raw_attributes}
    node_proto.attribute.extend(a for name, a in defaults.items() if name not in present)
    types = [type_proto_of(v).SerializeToString() for v in args]
    version = max(contextual) if contextual else schema.since_version
    proto.ParseFromString(
        schema.get_context_dependent_function_with_opset_version(version, node_proto.SerializeToString(), types)
    )
    return proto


def type_proto_of(value: Value) -> onnx.TypeProto:
    if value is None:
        return onnx.TypeProto()
    if isinstance(value, list):
        inner = type_proto_of(value[0]) if value else onnx.helper.make_tensor_type_proto(onnx.TensorProto.FLOAT, None)
        return onnx.helper.make_sequence_type_proto(inner)
    return onnx.helper.make_tensor_type_proto(onnx_type(np.dtype(value.dtype)), list(np.shape(value)))
