"""A node's inputs against its schema's type parameters, and an If's branches against its outputs, checked as
the walker reaches the node.

JAX promotes mixed dtypes silently (an int64 X times float weights gives floats), so a model that every ONNX
runtime refuses (ONNX Runtime: "Type parameter (T) of Optype (Gemm) bound to different types") would run and
return numbers. The schema says which inputs share one type parameter, so must have one type.
An If whose cond is known at trace time runs one branch only, so branches that disagree went unnoticed.
"""

from __future__ import annotations

import functools
from typing import Sequence

import numpy as np
import onnx
import onnx.defs

from ..dtypes import onnx_type
from ..errors import NodeError
from ..ir import Node
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
