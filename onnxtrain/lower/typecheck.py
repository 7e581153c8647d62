"""A node's inputs against its schema's type parameters, and an If's branches against its outputs, checked as
the walker reaches the node.

JAX promotes mixed dtypes silently (an int64 X times float weights gives floats), so a model that every ONNX
runtime refuses (ONNX Runtime: "Type parameter (T) of Optype (Gemm) bound to different types") would run and
return numbers. The schema says which inputs share one type parameter, so must have one type.
An If whose cond is known at trace time runs one branch only, so branches that disagree went unnoticed.
A graph's outputs against their declared types, checked when the graph is traced: the value returned is what the
graph computes, so a declaration that differs (double declared, float computed; a dim_param of another size than
the inputs gave it) is a model error, never a reading the engine picks.
"""

from __future__ import annotations

import functools
from typing import Container, Mapping, Sequence

import numpy as np
import onnx
import onnx.defs

from ..dtypes import onnx_type, type_name
from ..errors import NodeError
from ..ir import Graph, Node, ValueInfo
from .layout import ChannelsLast
from .registry import schema_for
from .values import Value


@functools.cache
def constraints(domain: str, op_type: str, opset: int) -> tuple[tuple[str, bool, bool], ...]:
    """Per formal input: (type parameter, whether the inputs it stands for share one type, whether it is
    variadic); only parameters with a choice of types; empty without a schema."""
    schema = schema_for(domain, op_type, opset)
    if schema is None:
        return ()
    params = {c.type_param_str for c in schema.type_constraints if len(c.allowed_type_strs) > 1}
    variadic = onnx.defs.OpSchema.FormalParameterOption.Variadic
    return tuple((f.type_str if f.type_str in params else "", f.is_homogeneous, f.option == variadic)
                 for f in schema.inputs)


def type_string(value: Value) -> str | None:
    """"tensor(float)" for a tensor value, None for what is not one (a sequence, an absent input)."""
    data = value.data if isinstance(value, ChannelsLast) else value
    dtype = getattr(data, "dtype", None)
    if dtype is None or isinstance(value, list):
        return None
    return f"tensor({onnx.TensorProto.DataType.Name(onnx_type(np.dtype(dtype))).lower()})"


# ops whose graph attributes each produce exactly the node's outputs, with the same element types
BRANCHES = {("", "If"): ("then_branch", "else_branch")}


def check_node(node: "Node", args: Sequence[Value]) -> None:
    check_branches(node)
    check_input_types(node, args)


def check_branches(node: "Node") -> None:
    names = BRANCHES.get((node.domain, node.op_type), ())
    branches = [(name, node.attributes[name]) for name in names if name in node.attributes]
    for name, graph in branches:
        if len(graph.outputs) != len(node.outputs):
            raise NodeError(f"{node.label}: {name} has {len(graph.outputs)} outputs, the node {len(node.outputs)}")
    for k, infos in enumerate(zip(*(graph.outputs for _, graph in branches))):
        types = {info.elem_type for info in infos if info.elem_type}  # 0/None: not declared
        if len(types) > 1:
            described = ", ".join(f"{name} {info.name!r} is {onnx.TensorProto.DataType.Name(info.elem_type).lower()}"
                                  for (name, _), info in zip(branches, infos) if info.elem_type)
            raise NodeError(f"{node.label}: output {k} differs in element type between the branches ({described})")


def check_input_types(node: "Node", args: Sequence[Value]) -> None:
    """Inputs bound to one type parameter have one type (Gemm's A, B and C are all T)."""
    formals = constraints(node.domain, node.op_type, node.opset)
    bound: dict[str, tuple[str, int]] = {}  # type parameter -> (type, first input binding it)
    for i, (name, value) in enumerate(zip(node.inputs, args)):
        if i >= len(formals) and not (formals and formals[-1][2]):
            break  # more inputs than the schema has: the lowering reports it
        param, homogeneous, _ = formals[min(i, len(formals) - 1)]  # a variadic last input repeats
        actual = type_string(value)
        if not param or actual is None or (i >= len(formals) - 1 and formals[-1][2] and not homogeneous):
            continue
        first = bound.setdefault(param, (actual, i))
        if first[0] != actual:
            raise NodeError(f"{node.label}: input {i} ({name!r}) is {actual} but input {first[1]} "
                            f"({node.inputs[first[1]]!r}) is {first[0]}; the schema gives both type {param}")


# A dim_param's size in one run, and what gave it ("input 'X' dimension 0")
Sizes = dict[str, tuple[int, str]]


def bind_dim_param(sizes: Sizes, name: str, size: int, what: str, axis: int) -> str | None:
    """Binds dim_param `name`, met at dimension `axis` of `what`, to `size` in `sizes`: the first size a name meets
    wins (IR.md: one size across the model). Returns the conflict where an earlier binding differs ("dimension 1
    ('N') is 4, but input 'X' dimension 0 gave 'N' = 2"), for the caller to raise as its own error (feeds.py: a
    FeedError per call; check_declared: a NodeError at trace), else None."""
    given, where = sizes.setdefault(name, (size, f"{what} dimension {axis}"))
    if given == size:
        return None
    return f"dimension {axis} ({name!r}) is {size}, but {where} gave {name!r} = {given}"


def input_sizes(graphs: Sequence[Graph], values: Mapping[str, Value]) -> Sizes:
    """The size each dim_param of the graphs' inputs has in this run (the feeds agree: feeds.py checked them)."""
    sizes: Sizes = {}
    for graph in graphs:
        for info in graph.inputs:
            shape = getattr(values[info.name], "shape", None)
            if info.shape is None or shape is None or isinstance(values[info.name], list):
                continue
            for axis, (want, got) in enumerate(zip(info.shape, shape)):
                if isinstance(want, str):  # a conflict is not this check's: the first size wins, as in feeds.py
                    bind_dim_param(sizes, want, got, f"input {info.name!r}", axis)
    return sizes


def check_outputs(graph: Graph, values: Mapping[str, Value], sizes: Sizes, skip: Container[str] = ()) -> None:
    """Each output of `graph` (ModelProto.graph, an initialization or algorithm graph) as traced against its
    ValueInfo: the element type where declared (not 0), each dimension declared as a number, and each dim_param
    the size the inputs (`sizes`, input_sizes) or an earlier output gave it: IR.md, "A dimension variable "N"
    represents the same value across the entire graph in a model". An absent dimension matches any size. `skip`:
    outputs the trace did not compute (a train step's copied outputs, checked as their copies, the algorithm's)."""
    for info in graph.outputs:
        if info.name in skip:
            continue
        check_declared(info, values[info.name], f"output {info.name!r} of graph {graph.name!r}", sizes)


def check_declared(info: ValueInfo, value: Value, what: str, sizes: Sizes | None = None) -> None:
    """`value` as the model sees it (a Scope's, channels first); `sizes`: the dim_params bound so far, which
    this value's add to. None for a nested graph's output (walker.Subgraph): a dim_param matches any size there,
    and a rank declared without any number is the exporter's guess (below)."""
    dtype, shape = getattr(value, "dtype", None), getattr(value, "shape", None)
    if isinstance(value, list) or dtype is None or shape is None or info.elem_type is None:
        return  # a sequence, an absent optional, a declaration that is not a tensor's
    computed = onnx_type(np.dtype(dtype))
    if info.elem_type and computed != info.elem_type:
        raise NodeError(f"{what} is declared {type_name(info.elem_type)} but computes {type_name(computed)}")
    declared = info.shape
    if sizes is None and declared is not None and len(declared) != len(shape) and not any(
            isinstance(d, int) for d in declared):
        # a nested graph's rank with no size fixed is the exporter's guess, which ONNX Runtime runs past (it warns):
        # TorchScript's scatter_reduce declares its If's else_branch (Identity of the rank-3 result) with the
        # then_branch's rank-1 placeholder ['Reshape/Reshape_1_output_0_dim_0']. A declared number still binds.
        declared = None
    if declared is not None and (len(declared) != len(shape) or any(
            isinstance(d, int) and d != n for d, n in zip(declared, shape))):
        shown = [d if d is not None else "?" for d in declared]
        raise NodeError(f"{what} is declared of shape {shown} but computes {list(shape)}")
    for axis, (want, got) in enumerate(zip(declared or (), shape)):
        if isinstance(want, str) and sizes is not None and (conflict := bind_dim_param(sizes, want, got, what, axis)):
            raise NodeError(f"{what}: {conflict}: a dim_param names one size across the model, so the declaration "
                            "is wrong (an export's dynamic_axes naming an output dimension after an input's that it "
                            "does not follow, say); re-export naming it apart, or leave it unnamed")
