"""What the lowering relies on and onnx.checker would catch, checked even when the checker is skipped (check=False):
every string field is text, every value a node reads or a graph returns is defined before it is used, and defined
once (the checker does not look across ModelProto.graph and the training graphs, which see its values, nor inside
the training graphs at all), model-local functions call each other neither in a cycle nor past onnx.checker's
depth, and a model with training graphs declares an IR version that has them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import onnx
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from .errors import ModelLoadError

TEXT_OR_MESSAGE = (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_MESSAGE)


def check_text_fields(message: Message, where: str = "the model") -> None:
    """protobuf hands back a string field holding invalid UTF-8 (legal in proto2) as bytes, which every name lookup
    would then trip over. Only string and message fields are read: reading a bytes field copies it (a tensor's
    raw_data: 1.3 s of a 2.7 GB model's load, through `ListFields`)."""
    for descriptor in message.DESCRIPTOR.fields:
        if descriptor.type not in TEXT_OR_MESSAGE:
            continue
        if descriptor.is_repeated:
            items = list(getattr(message, descriptor.name))
        elif message.HasField(descriptor.name):
            items = [getattr(message, descriptor.name)]
        else:
            continue
        if descriptor.type == FieldDescriptor.TYPE_MESSAGE:
            for i, item in enumerate(items):
                check_text_fields(item, f"{where}.{descriptor.name}" + (f"[{i}]" if descriptor.is_repeated else ""))
        elif descriptor.type == FieldDescriptor.TYPE_STRING and any(not isinstance(i, str) for i in items):
            raise ModelLoadError(f"{where}.{descriptor.name} is not valid UTF-8")


# The IR version that introduced TrainingInfoProto (onnx.proto: "IR VERSION 7 ... Add message TrainingInfoProto")
TRAINING_IR_VERSION = 7


def graph_defines(graph: onnx.GraphProto) -> set[str]:
    """The names a graph's inputs and initializers define. An initializer named twice (dense or sparse), or an
    input declared twice, would leave the lowering to read one of the two, silently (the checker refuses both)."""
    owner = f"graph {graph.name!r}"
    initializers = [t.name for t in graph.initializer] + [s.values.name for s in graph.sparse_initializer]
    inputs = [i.name for i in graph.input]
    for names, what in ((initializers, "initializer"), (inputs, "input")):
        twice = sorted(n for n, count in Counter(names).items() if count > 1)
        if twice:
            raise ModelLoadError(f"{owner} has more than one {what} named {twice[0]!r}; each name is defined once")
    return set(inputs) | set(initializers)


def check_nodes(nodes: Iterable[onnx.NodeProto], defined: set[str], owner: str) -> set[str]:
    """Each node reads only names defined before it (ONNX's topological order; subgraphs see the enclosing scope
    as it stands at their node); returns the names defined after the last node."""
    defined = set(defined)
    for node in nodes:
        label = f"node {node.name or node.op_type!r} of {owner}"
        for name in node.input:
            if name and name not in defined:
                raise ModelLoadError(
                    f"{label} reads {name!r}, which is not an input, an initializer or an output of an earlier node"
                )
        for attr in node.attribute:
            for subgraph in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                check_graph(subgraph, defined)
        for name in node.output:
            if name in defined:  # the lowering would read one of its two values, silently
                raise ModelLoadError(
                    f"{label} defines {name!r}, which an input, an initializer, an earlier node or an enclosing "
                    f"graph defines already (a name is assigned once: ONNX's single static assignment)"
                )
            if name:
                defined.add(name)
    return defined


def check_graph(graph: onnx.GraphProto, outer: set[str]) -> set[str]:
    owner = f"graph {graph.name!r}"
    defined = check_nodes(graph.node, outer | graph_defines(graph), owner)
    for output in graph.output:
        if output.name not in defined:
            raise ModelLoadError(f"{owner} returns {output.name!r}, which nothing in it or around it defines")
    return defined


def check_value_scopes(model: onnx.ModelProto) -> None:
    """Training graphs see the main graph's values (a train step runs it first)."""
    main = check_graph(model.graph, set())
    for info in model.training_info:
        check_graph(info.initialization, main)
        check_graph(info.algorithm, main)
    for function in model.functions:
        owner = f"function {function.name!r}"
        defined = check_nodes(function.node, set(function.input), owner)
        for output in function.output:
            if output not in defined:
                raise ModelLoadError(f"{owner} returns {output!r}, which none of its inputs or nodes defines")


def check_functions_defined_once(model: onnx.ModelProto) -> None:
    """onnx.proto: "The (domain, name, overload) tuple must be unique across the function protos in this list": a
    node would otherwise call whichever of the two a table kept last, silently."""
    ids = Counter((f.domain, f.name, f.overload) for f in model.functions)
    twice = sorted(i for i, count in ids.items() if count > 1)
    if twice:
        domain, name, overload = twice[0]
        overloaded = f", overload {overload!r}" if overload else ""
        raise ModelLoadError(
            f"the model defines local function {name!r} (domain {domain!r}{overloaded}) more than once "
            f"(the (domain, name, overload) tuple must be unique across ModelProto.functions)"
        )


# onnx.checker's bound on a chain of model-local function calls ("Function call chain depth exceeds limit (100)"):
# the engine expands each call when traced, several Python frames deep, and a chain of 200 had failed there as a
# RecursionError (one of 2000 already at load, with check=False)
MAX_CALL_DEPTH = 100


def called_functions(nodes: Iterable[onnx.NodeProto]) -> set[tuple[str, str, str]]:
    """The (domain, name, overload) each node calls, subgraphs' nodes included (walked without recursion)."""
    found, pending = set(), list(nodes)
    while pending:
        node = pending.pop()
        found.add((node.domain, node.op_type, node.overload))
        for attr in node.attribute:
            for graph in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                pending.extend(graph.node)
    return found


def check_function_calls(model: onnx.ModelProto) -> None:
    """Model-local functions call each other neither in a cycle (onnx.checker: "Model-local functions must not be
    recursive"; its expansion would never end) nor more than MAX_CALL_DEPTH deep. A depth-first walk kept on a
    stack, not in Python's, which a chain of functions would exhaust."""
    ids = {(f.domain, f.name, f.overload) for f in model.functions}
    calls = {(f.domain, f.name, f.overload): sorted(called_functions(f.node) & ids) for f in model.functions}
    depth: dict[tuple[str, str, str], int] = {}  # the longest chain of calls a function starts (1: it calls none)
    for root in calls:
        stack, path = [iter(calls[root])], [root]
        while stack:
            callee = next(stack[-1], None)
            if callee in path:
                cycle = " -> ".join(f"{domain}::{name}" for domain, name, _ in path[path.index(callee):] + [callee])
                raise ModelLoadError(f"model-local functions call each other in a cycle ({cycle}); a function may "
                                     "not call itself, directly or through others")
            if callee is not None and callee not in depth:
                stack.append(iter(calls[callee]))
                path.append(callee)
            elif callee is None:
                key = path.pop()
                stack.pop()
                depth[key] = 1 + max((depth[c] for c in calls[key]), default=0)
                if depth[key] > MAX_CALL_DEPTH:
                    raise ModelLoadError(f"model-local function {key[1]!r} (domain {key[0]!r}) starts a chain of "
                                         f"{depth[key]} nested function calls, more than {MAX_CALL_DEPTH} "
                                         "(onnx.checker's bound)")


def check_ir_version(model: onnx.ModelProto) -> None:
    """A model of an IR version before training_info existed cannot mean its training graphs (the checker lets
    them pass)."""
    if model.training_info and model.ir_version < TRAINING_IR_VERSION:
        raise ModelLoadError(
            f"the model has training_info but declares ir_version {model.ir_version}; TrainingInfoProto exists "
            f"from IR version {TRAINING_IR_VERSION} (set ir_version to {TRAINING_IR_VERSION} or later)"
        )


def check_well_formed(model: onnx.ModelProto) -> None:
    check_ir_version(model)
    check_text_fields(model)
    check_functions_defined_once(model)
    check_function_calls(model)
    check_value_scopes(model)
