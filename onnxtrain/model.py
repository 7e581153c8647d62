"""Reading and validating a ModelProto into a small frozen view the lowering walks.

Every node is bound here, once, to its implementation: a registered lowering for the schema version the model's
opset selects, or else a function body (a model-local FunctionProto, or the schema's own function) expanded at
trace time. Nodes nothing can run are collected and reported together.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import numpy_helper

from . import lower  # noqa: F401  (registers every op)
from .big_models import check_large_model, exceeds_protobuf_limit
from .errors import ExternalDataError, ModelLoadError, UnsupportedOpError
from .lower.registry import OpImpl, canonical_domain, lookup, schema_for

ModelSource = str | os.PathLike | bytes | onnx.ModelProto


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


@dataclass
class Resolver:
    """What binding a node needs: the opsets in force and the model-local functions; collects what is missing."""

    opsets: dict[str, int]
    functions: dict[tuple[str, str], onnx.FunctionProto]
    missing: list[tuple[str, str, int]] = field(default_factory=list)
    checked: set[tuple[str, str]] = field(default_factory=set)  # local functions whose bodies were bound

    def with_opsets(self, opset_import) -> "Resolver":
        opsets = {canonical_domain(o.domain): o.version for o in opset_import}
        return Resolver(opsets, self.functions, self.missing, self.checked)


def value_info(vi: onnx.ValueInfoProto) -> ValueInfo:
    tensor = vi.type.tensor_type if vi.type.HasField("tensor_type") else None
    elem_type = tensor.elem_type if tensor is not None else None
    shape = None
    if tensor is not None and tensor.HasField("shape"):
        shape = tuple(
            d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim
        )
    return ValueInfo(vi.name, elem_type, shape, vi.type)


def tensor_value(tensor: onnx.TensorProto) -> np.ndarray:
    return numpy_helper.to_array(tensor)


def sparse_to_dense(sparse: onnx.SparseTensorProto) -> np.ndarray:
    """A SparseTensorProto as a dense array (indices are flat positions, or one coordinate row per value)."""
    values = tensor_value(sparse.values)
    indices = tensor_value(sparse.indices).astype(np.int64)
    dims = tuple(sparse.dims)
    dense = np.zeros(int(np.prod(dims)), values.dtype)
    flat = indices if indices.ndim == 1 else np.ravel_multi_index(tuple(indices.T), dims)
    dense[flat] = values
    return dense.reshape(dims)


def decode_attribute(attr: onnx.AttributeProto, resolver: Resolver) -> Any:
    kind = onnx.AttributeProto
    decoders = {
        kind.FLOAT: lambda: float(attr.f),
        kind.INT: lambda: int(attr.i),
        kind.STRING: lambda: attr.s.decode("utf-8"),
        kind.TENSOR: lambda: tensor_value(attr.t),
        kind.SPARSE_TENSOR: lambda: sparse_to_dense(attr.sparse_tensor),
        kind.GRAPH: lambda: build_graph(attr.g, resolver),
        kind.TYPE_PROTO: lambda: attr.tp,
        kind.FLOATS: lambda: [float(f) for f in attr.floats],
        kind.INTS: lambda: [int(i) for i in attr.ints],
        kind.STRINGS: lambda: [s.decode("utf-8") for s in attr.strings],
        kind.TENSORS: lambda: [tensor_value(t) for t in attr.tensors],
        kind.GRAPHS: lambda: [build_graph(g, resolver) for g in attr.graphs],
        kind.SPARSE_TENSORS: lambda: [sparse_to_dense(t) for t in attr.sparse_tensors],
        kind.TYPE_PROTOS: lambda: list(attr.type_protos),
    }
    if attr.type not in decoders:
        raise ModelLoadError(f"attribute {attr.name!r} has unknown type {attr.type}")
    return decoders[attr.type]()


def substitute_attribute_refs(
    attributes, caller_attributes: dict[str, onnx.AttributeProto] | None
) -> list[onnx.AttributeProto]:
    """Inside a function body, `ref_attr_name` attributes take the caller's value (dropped if it has none)."""
    result = []
    for attr in attributes:
        if attr.ref_attr_name:
            if caller_attributes is None or attr.ref_attr_name not in caller_attributes:
                continue
            bound = onnx.AttributeProto()
            bound.CopyFrom(caller_attributes[attr.ref_attr_name])
            bound.name = attr.name
            result.append(bound)
        else:
            result.append(attr)
    return result


def build_node(
    proto: onnx.NodeProto, resolver: Resolver, caller_attributes: dict[str, onnx.AttributeProto] | None = None
) -> Node:
    domain = canonical_domain(proto.domain)
    raw = tuple(substitute_attribute_refs(proto.attribute, caller_attributes))
    attributes = {a.name: decode_attribute(a, resolver) for a in raw}
    opset = resolver.opsets.get(domain)
    function = resolver.functions.get((proto.domain, proto.op_type))
    impl, since_version = None, None
    if function is not None:
        check_function_body((proto.domain, proto.op_type), resolver)
    else:
        schema = schema_for(domain, proto.op_type, opset) if opset is not None else None
        if schema is not None:
            since_version = schema.since_version
            impl = lookup(domain, proto.op_type, since_version)
            for name, spec in schema.attributes.items():
                if name not in attributes and spec.default_value.type != onnx.AttributeProto.UNDEFINED:
                    attributes[name] = decode_attribute(spec.default_value, resolver)
        if impl is None and not schema_has_body(schema, opset):
            resolver.missing.append((domain, proto.op_type, opset if opset is not None else -1))
    return Node(
        op_type=proto.op_type,
        domain=domain,
        name=proto.name,
        inputs=tuple(proto.input),
        outputs=tuple(proto.output),
        attributes=attributes,
        raw_attributes=raw,
        opset=opset if opset is not None else -1,
        since_version=since_version,
        impl=impl,
        function=function,
    )


def schema_has_body(schema: onnx.defs.OpSchema | None, opset: int | None) -> bool:
    if schema is None or opset is None:
        return False
    versions = list(schema.function_opset_versions) + list(schema.context_dependent_function_opset_versions)
    return any(v <= opset for v in versions) or schema.has_function or schema.has_context_dependent_function


def build_graph(proto: onnx.GraphProto, resolver: Resolver) -> Graph:
    initializers = {t.name: tensor_value(t) for t in proto.initializer}
    for sparse in proto.sparse_initializer:
        initializers[sparse.values.name] = sparse_to_dense(sparse)
    return Graph(
        name=proto.name,
        inputs=tuple(value_info(v) for v in proto.input),
        outputs=tuple(value_info(v) for v in proto.output),
        initializers=initializers,
        nodes=tuple(build_node(n, resolver) for n in proto.node),
    )


def check_function_body(key: tuple[str, str], resolver: Resolver) -> None:
    """Bind a called model-local function's nodes once, so their unsupported ops are reported at load."""
    if key in resolver.checked:
        return
    resolver.checked.add(key)
    function = resolver.functions[key]
    inner = resolver.with_opsets(function.opset_import)
    for node in function.node:
        build_node(node, inner, caller_attributes=None)


def read_model(source: ModelSource) -> tuple[onnx.ModelProto, Path | None]:
    """Parse `source` and resolve external data; returns the proto and the folder it was read from."""
    if isinstance(source, onnx.ModelProto):
        return source, None
    folder = None
    if isinstance(source, (bytes, bytearray)):
        data, what = bytes(source), "the given bytes"
    else:
        path = Path(source)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ModelLoadError(f"cannot read model file {str(path)!r}: {exc.strerror}") from exc
        folder, what = path.resolve().parent, f"file {str(path)!r}"
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise ModelLoadError(f"{what} is not an ONNX model (protobuf parse failed: {exc})") from exc
    if model.ir_version <= 0 or not model.HasField("graph"):
        raise ModelLoadError(f"{what} is not an ONNX model (no ir_version or graph)")
    if folder is not None:
        load_external_data(model, folder)
    return model, folder


def external_tensors(model: onnx.ModelProto):
    from onnx.external_data_helper import _get_all_tensors, _get_attribute_tensors_from_graph
    from onnx.external_data_helper import _get_initializer_tensors_from_graph, uses_external_data

    # onnx's walk skips training_info, whose initializers (optimizer state) export also moves to external data
    training = [g for info in model.training_info for g in (info.initialization, info.algorithm)]
    tensors = [*_get_all_tensors(model)]
    for graph in training:
        tensors += [*_get_initializer_tensors_from_graph(graph), *_get_attribute_tensors_from_graph(graph)]
    return [t for t in tensors if uses_external_data(t)]


def load_external_data(model: onnx.ModelProto, folder: Path) -> None:
    from onnx.external_data_helper import ExternalDataInfo, load_external_data_for_tensor

    for tensor in external_tensors(model):
        location = ExternalDataInfo(tensor).location
        target = (folder / location).resolve()
        if os.path.isabs(location) or not target.is_relative_to(folder):
            raise ExternalDataError(
                f"tensor {tensor.name!r}: external data location {location!r} is outside the model's folder"
            )
        if not target.is_file():
            raise ExternalDataError(f"tensor {tensor.name!r}: external data file {location!r} not found")
        load_external_data_for_tensor(tensor, str(folder))
        tensor.data_location = onnx.TensorProto.DEFAULT
        del tensor.external_data[:]


def check_model(model: onnx.ModelProto) -> None:
    try:
        if exceeds_protobuf_limit(model):  # the in-memory checker serializes the model: impossible past 2 GiB
            check_large_model(model)
        else:
            onnx.checker.check_model(model)
    except (onnx.checker.ValidationError, ValueError) as exc:
        raise ModelLoadError(f"onnx.checker rejected the model: {exc}") from exc


def model_resolver(model: onnx.ModelProto) -> Resolver:
    opsets = {canonical_domain(o.domain): o.version for o in model.opset_import}
    functions = {(f.domain, f.name): f for f in model.functions}
    return Resolver(opsets, functions)


def raise_if_missing(resolver: Resolver) -> None:
    if resolver.missing:
        raise UnsupportedOpError(resolver.missing)
