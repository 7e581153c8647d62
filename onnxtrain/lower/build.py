"""Building the frozen graph views (ir.py) from their protos, and binding each node to what runs it.

Every node is bound here, once, to its implementation: a registered lowering (registry.py) for the schema version
the model's opset selects, or else a function body (a model-local FunctionProto, or the schema's own function)
expanded at trace time. Nodes nothing can run are collected and reported together. The engine builds a model's
graphs at load, and the walker builds a function body's nodes when it expands one; so this module imports only
the registry and leaf modules, never the op groups (importing those registers the ops, which import the walker).
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence, TypeVar

import numpy as np
import onnx
from google.protobuf.message import Message

from .. import tensor_data
from ..big_models import PROTOBUF_LIMIT
from ..dtypes import type_name
from ..errors import ModelLoadError, UnsupportedOpError
from ..external_data import ExternalValues
from ..ir import METADATA_PREFIX, Graph, Node, ValueInfo
from ..tensor_data import DenseBudget, decode_utf8, holds_no_data, known_type, tensor_value, zeros_of
from ..well_formed import check_well_formed
from .registry import canonical_domain, lookup, schema_for

M = TypeVar("M", bound=Message)

# A model-local function's id: (domain, name, overload). IR version 10 added `overload` to FunctionProto and
# NodeProto: functions of one name may differ by it, and a node calls the one its own `overload` names.
FunctionId = tuple[str, str, str]


# (domain, op_type) -> the attribute naming what such a node calls, which an error names with it: PyTorch's
# ATen fallback (operator_export_type=ONNX_ATEN_FALLBACK) writes every operator it has no ONNX form for as one
# org.pytorch.aten::ATen node, told apart only by `operator`
CALLEE_ATTRIBUTE = {("org.pytorch.aten", "ATen"): "operator"}


def function_id(proto: onnx.FunctionProto | onnx.NodeProto) -> FunctionId:
    name = proto.name if isinstance(proto, onnx.FunctionProto) else proto.op_type
    return proto.domain, name, proto.overload


def new_sparse_budget() -> DenseBudget:
    """A budget of MAX_SPARSE_DENSE_BYTES (read when called): one a model's load binds with, one each trace."""
    return DenseBudget(MAX_SPARSE_DENSE_BYTES)


@dataclass
class Resolver:
    """What binding a node needs: the opsets in force and the model-local functions; collects what is missing."""

    opsets: dict[str, int]
    functions: dict[FunctionId, onnx.FunctionProto]
    missing: list[tuple[str, str, int]] = field(default_factory=list)
    checked: set[FunctionId] = field(default_factory=set)  # local functions whose bodies were bound
    # initializers the model holds without their bytes because they are all zero (export.without_zero_state)
    zero_initializers: frozenset[str] = frozenset()
    # reads the initializers the model keeps in external data (model.read_model's `keep`)
    external: ExternalValues | None = None
    # binds a function body's nodes (with_opsets), the only ones whose attributes may refer to a caller's
    in_function: bool = False
    # what the dense forms of the sparse tensors bound so far take, shared with function bodies' resolvers
    sparse_budget: DenseBudget = field(default_factory=new_sparse_budget)

    def initializer_value(self, tensor: onnx.TensorProto) -> np.ndarray:
        label = f"initializer {tensor.name!r}"
        if tensor.name in self.zero_initializers and holds_no_data(tensor):
            return zeros_of(tensor)
        return tensor_value(tensor, label) if self.external is None else self.external.value(tensor, label)

    def with_opsets(self, opset_import, owner: str = "a function") -> "Resolver":
        return Resolver(opset_versions(opset_import, owner), self.functions, self.missing, self.checked,
                        in_function=True, sparse_budget=self.sparse_budget)


@functools.cache
def newest_opsets() -> dict[str, int]:
    """The newest version of each domain onnx.defs knows: a model importing a later one was written for operator
    semantics this engine cannot know."""
    newest = {"": onnx.defs.onnx_opset_version()}
    for schema in onnx.defs.get_all_schemas_with_history():
        domain = canonical_domain(schema.domain)
        newest[domain] = max(newest.get(domain, 0), schema.since_version)
    return newest


def opset_versions(opset_import, owner: str) -> dict[str, int]:
    """{domain: version} of an opset_import list, each version checked against what onnx.defs knows."""
    versions = {}
    for entry in opset_import:
        domain = canonical_domain(entry.domain)
        name = domain or "ai.onnx"
        newest = newest_opsets().get(domain)
        if entry.version < 1:
            raise ModelLoadError(f"{owner} imports opset {name} version {entry.version}; versions start at 1")
        if newest is not None and entry.version > newest:
            raise ModelLoadError(
                f"{owner} imports opset {name} version {entry.version}, newer than the newest onnx "
                f"{onnx.__version__} knows ({newest})"
            )
        # which version the nodes mean would be a guess ("" and "ai.onnx" are one domain); one version listed twice
        # is no guess (skl2onnx lists ("", 22) twice for LinearClassifier, which onnx.checker and ORT accept)
        if versions.get(domain, entry.version) != entry.version:
            raise ModelLoadError(f"{owner} imports opset {name} twice (versions {versions[domain]} and "
                                 f"{entry.version})")
        versions[domain] = entry.version
    return versions


def value_info(vi: onnx.ValueInfoProto) -> ValueInfo:
    tensor = vi.type.tensor_type if vi.type.HasField("tensor_type") else None
    elem_type = tensor.elem_type if tensor is not None else None
    if elem_type:  # 0 leaves the type unknown, which ONNX allows
        known_type(elem_type, f"value {vi.name!r}")
    shape = None
    if tensor is not None and tensor.HasField("shape"):
        shape = tuple(
            d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim
        )
        if any(isinstance(d, int) and d < 0 for d in shape):
            raise ModelLoadError(f"value {vi.name!r} has a negative dimension in its shape {list(shape)}")
    return ValueInfo(vi.name, elem_type, shape, detached(vi.type))


# The most bytes the dense forms of a model's sparse tensors take together (DenseBudget), read when a model's
# binding starts: what all of a model's dense tensors in the proto can take (each one's bound is the same).
MAX_SPARSE_DENSE_BYTES = PROTOBUF_LIMIT


def sparse_to_dense(sparse: onnx.SparseTensorProto, label: str, resolver: Resolver) -> np.ndarray:
    return tensor_data.sparse_to_dense(sparse, label, PROTOBUF_LIMIT, resolver.sparse_budget)


# AttributeProto's value field of each type (onnx.proto: `type` "MUST be set and match the f|i|s|t|... field in
# use"; "Exactly ONE of the following fields must be present")
VALUE_FIELDS = {
    onnx.AttributeProto.FLOAT: "f", onnx.AttributeProto.INT: "i", onnx.AttributeProto.STRING: "s",
    onnx.AttributeProto.TENSOR: "t", onnx.AttributeProto.GRAPH: "g",
    onnx.AttributeProto.SPARSE_TENSOR: "sparse_tensor", onnx.AttributeProto.TYPE_PROTO: "tp",
    onnx.AttributeProto.FLOATS: "floats", onnx.AttributeProto.INTS: "ints", onnx.AttributeProto.STRINGS: "strings",
    onnx.AttributeProto.TENSORS: "tensors", onnx.AttributeProto.GRAPHS: "graphs",
    onnx.AttributeProto.SPARSE_TENSORS: "sparse_tensors", onnx.AttributeProto.TYPE_PROTOS: "type_protos",
}
SINGULAR_FIELDS = frozenset({"f", "i", "s", "t", "g", "sparse_tensor", "tp"})


def check_value_field(attr: onnx.AttributeProto, what: str) -> None:
    """The attribute holds its value in its type's field and in no other: decoding the type's field alone would
    read a default (0, []) where the producer wrote a value elsewhere. An empty list sets no field, as the
    type's own field unset reads its default (proto3 writers omit a default), both allowed."""
    others = [name for name in VALUE_FIELDS.values() if name != VALUE_FIELDS[attr.type]
              and (attr.HasField(name) if name in SINGULAR_FIELDS else len(getattr(attr, name)))]
    if others:
        kind = onnx.AttributeProto.AttributeType.Name(attr.type)
        raise ModelLoadError(f"{what} is of type {kind} but sets field {others[0]!r}, not {VALUE_FIELDS[attr.type]!r}")


def decode_attribute(attr: onnx.AttributeProto, resolver: Resolver, owner: str = "") -> Any:
    kind = onnx.AttributeProto
    what = f"attribute {attr.name!r}{owner}"
    decoders = {
        kind.FLOAT: lambda: float(attr.f),
        kind.INT: lambda: int(attr.i),
        kind.STRING: lambda: decode_utf8(attr.s, what),
        kind.TENSOR: lambda: tensor_value(attr.t, what),
        kind.SPARSE_TENSOR: lambda: sparse_to_dense(attr.sparse_tensor, what, resolver),
        kind.GRAPH: lambda: build_graph(attr.g, resolver),
        kind.TYPE_PROTO: lambda: attr.tp,
        kind.FLOATS: lambda: [float(f) for f in attr.floats],
        kind.INTS: lambda: [int(i) for i in attr.ints],
        kind.STRINGS: lambda: [decode_utf8(s, what) for s in attr.strings],
        kind.TENSORS: lambda: [tensor_value(t, what) for t in attr.tensors],
        kind.GRAPHS: lambda: [build_graph(g, resolver) for g in attr.graphs],
        kind.SPARSE_TENSORS: lambda: [sparse_to_dense(t, what, resolver) for t in attr.sparse_tensors],
        kind.TYPE_PROTOS: lambda: list(attr.type_protos),
    }
    if attr.type not in decoders:
        raise ModelLoadError(f"{what} has unknown type {attr.type}")
    check_value_field(attr, what)
    return decoders[attr.type]()


def substitute_attribute_refs(
    attributes, caller_attributes: dict[str, onnx.AttributeProto] | None
) -> list[onnx.AttributeProto]:
    """Inside a function body, `ref_attr_name` attributes take the caller's value (dropped if it has none). With a
    caller, so do those of the nodes of the attributes' subgraphs, at any depth (an If's branches, a Loop's body):
    onnx.proto allows a reference in a subgraph of a function body, naming the function's attribute, and
    build_graph binds a subgraph's nodes without a caller, so they had dropped it (a Cast's `to`: a TypeError when
    traced). Without a caller (a body bound once at load) the subgraphs keep theirs: their nodes' checks then know
    them to be set by each call (check_referenced_attributes checks a call's values through the same walk)."""
    holder = onnx.NodeProto(attribute=attributes)  # a copy: the model's own protos are left as they are
    for node in nodes_within([holder]) if caller_attributes is not None else [holder]:
        for attr in [a for a in node.attribute if a.ref_attr_name]:
            value = (caller_attributes or {}).get(attr.ref_attr_name)
            if value is None:
                node.attribute.remove(attr)
            else:
                name = attr.name
                attr.CopyFrom(value)
                attr.name = name
    return list(holder.attribute)


def nodes_within(nodes: Iterable[onnx.NodeProto]) -> Iterator[onnx.NodeProto]:
    """Each node, then the nodes of its subgraphs (an If's branches, a Loop's or Scan's body), at any depth."""
    for node in nodes:
        yield node
        for attr in node.attribute:
            for graph in [attr.g] if attr.HasField("g") else attr.graphs:
                yield from nodes_within(graph.node)


def detached(message: M) -> M:
    """A copy of a sub-message of the model that does not share its memory: protobuf (upb) keeps a whole
    message alive while any of its sub-messages is referenced, so a view holding one would keep every weight's
    bytes of the model it was built from (load(path) drops the proto's state bytes once they are on the device)."""
    copy = type(message)()
    copy.CopyFrom(message)
    return copy


def build_node(
    proto: onnx.NodeProto, resolver: Resolver, caller_attributes: dict[str, onnx.AttributeProto] | None = None
) -> Node:
    domain = canonical_domain(proto.domain)
    label = f"node {proto.name or proto.op_type!r}"
    owner = f" of {label}"
    referring = next((a for a in proto.attribute if a.ref_attr_name), None)
    if referring is not None and not resolver.in_function:  # it would be dropped: the schema's default, a guess
        raise ModelLoadError(f"attribute {referring.name!r}{owner} refers to attribute {referring.ref_attr_name!r} "
                             "of a calling function (ref_attr_name), but the node is not in a function body")
    raw = tuple(substitute_attribute_refs(proto.attribute, caller_attributes))
    check_attributes_once(raw, owner)
    attributes = {a.name: decode_attribute(a, resolver, owner) for a in raw}
    opset = resolver.opsets.get(domain)
    function = resolver.functions.get(function_id(proto))
    impl, since_version = None, None
    if function is not None:
        check_call_inputs(proto, function, label)
        check_function_body(function_id(proto), resolver)
        # a reference a body bound without its caller drops has a value each call of that body gives (the walk
        # from the outermost call passes it on): the function's default does not apply there
        unknown = {a.name for a in proto.attribute if a.ref_attr_name} if caller_attributes is None else set()
        check_referenced_attributes(call_attributes(function, raw), unknown, function, resolver, label)
    else:
        schema = schema_for(domain, proto.op_type, opset) if opset is not None else None
        if schema is not None:
            since_version = schema.since_version
            impl = lookup(domain, proto.op_type, since_version)
            check_input_count(proto, schema, label)
            check_attributes_declared(raw, schema, proto.op_type, owner)
            check_required_attributes(proto, schema, attributes, caller_attributes is None, owner)
            check_data_type_attributes(raw, schema, proto.op_type, owner)
            for name, spec in schema.attributes.items():
                if name not in attributes and spec.default_value.type != onnx.AttributeProto.UNDEFINED:
                    attributes[name] = decode_attribute(spec.default_value, resolver)
        if impl is None and not schema_has_body(schema, opset):
            callee = attributes.get(CALLEE_ATTRIBUTE.get((domain, proto.op_type), ""))
            op_type = proto.op_type if callee is None else f"{proto.op_type}({callee!r})"
            resolver.missing.append((domain, op_type, opset if opset is not None else -1))
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
        metadata={p.key: p.value for p in proto.metadata_props if p.key.startswith(METADATA_PREFIX)},
    )


# Attributes the lowering drops (registry.register), so their absence changes nothing: BatchNormalization-1
# requires `consumed_inputs`, an in-place hint
DROPPED_ATTRIBUTES = {"consumed_inputs"}


def check_required_attributes(proto: onnx.NodeProto, schema: onnx.defs.OpSchema, attributes: dict[str, Any],
                              unbound: bool, owner: str) -> None:
    """A required attribute is set (what onnx.checker says; check=False skips it): the lowering's keyword default
    would guess it (Concat-4+'s axis had been 1) and a missing keyword argument came out as a TypeError when
    traced. `unbound`: a function body checked without its caller, whose references are set by each call."""
    referenced = {a.name for a in proto.attribute if a.ref_attr_name} if unbound else set()
    missing = [name for name, spec in schema.attributes.items()
               if spec.required and name not in attributes.keys() | referenced | DROPPED_ATTRIBUTES]
    if missing:
        raise ModelLoadError(f"attribute {missing[0]!r}{owner} is required by {proto.op_type}-"
                             f"{schema.since_version} but not set")


def check_attributes_once(attributes: Sequence[onnx.AttributeProto], owner: str) -> None:
    """Each attribute is given once (what onnx.checker says of ModelProto.graph, not looking inside the training
    graphs): of two, the lowering had silently read the last."""
    names = Counter(a.name for a in attributes)
    twice = sorted(name for name, count in names.items() if count > 1)
    if twice:
        raise ModelLoadError(f"attribute {twice[0]!r}{owner} is given {names[twice[0]]} times; an attribute is set "
                             "once")


def check_attributes_declared(attributes: Sequence[onnx.AttributeProto], schema: onnx.defs.OpSchema, op_type: str,
                              owner: str) -> None:
    """Each attribute is one the schema declares, of the type it declares (what onnx.checker says of
    ModelProto.graph, not looking inside the training graphs): the lowering had received an unknown keyword (a
    TypeError) or a STRING axis (JAX's error on a named axis) when traced, not at load."""
    version = f"{op_type}-{schema.since_version}"
    for attr in attributes:
        spec = schema.attributes.get(attr.name)
        if spec is None:
            raise ModelLoadError(f"attribute {attr.name!r}{owner} is not one {version} has "
                                 f"(it has {sorted(schema.attributes)})")
        if attr.type != spec.type:
            kind = onnx.AttributeProto.AttributeType
            raise ModelLoadError(f"attribute {attr.name!r}{owner} is of type {kind.Name(attr.type)}, but {version} "
                                 f"takes {kind.Name(int(spec.type))}")


# op_type -> {attribute whose INT value is a TensorProto data type: the output whose type it is (its allowed
# types the schema's constraint), None where no output has it: a precision (LayerNormalization's stash_type, whose
# Mean output the schema types float or bfloat16, is double in a float64 model: test_layer_norm_float64_is_exact)}.
# onnx.checker does not look at such values, and the lowering had met an unknown one as a KeyError when first traced
# (a training graph's: at the first step). All in the default domain; their since_version differs, never the
# meaning of the attribute.
DATA_TYPE_ATTRIBUTES: dict[str, dict[str, int | None]] = {
    "Cast": {"to": 0}, "BitCast": {"to": 0}, "EyeLike": {"dtype": 0}, "Bernoulli": {"dtype": 0},
    "Multinomial": {"dtype": 0}, "RandomNormal": {"dtype": 0}, "RandomUniform": {"dtype": 0},
    "RandomNormalLike": {"dtype": 0}, "RandomUniformLike": {"dtype": 0}, "SequenceEmpty": {"dtype": 0},
    "HannWindow": {"output_datatype": 0}, "HammingWindow": {"output_datatype": 0},
    "BlackmanWindow": {"output_datatype": 0}, "MelWeightMatrix": {"output_datatype": 0},
    "QuantizeLinear": {"output_dtype": 0}, "DequantizeLinear": {"output_dtype": 0},
    "LayerNormalization": {"stash_type": None}, "GroupNormalization": {"stash_type": None},
    "RMSNormalization": {"stash_type": None}, "Range": {"stash_type": None},
}


def check_data_type_attributes(attributes: Sequence[onnx.AttributeProto], schema: onnx.defs.OpSchema, op_type: str,
                               owner: str) -> None:
    """Each attribute naming a data type (DATA_TYPE_ATTRIBUTES) names one of TensorProto's, of the types its output
    may have. The schema's default passes as it is (QuantizeLinear's output_dtype 0: "not supplied")."""
    checked = DATA_TYPE_ATTRIBUTES.get(op_type, {}) if schema.domain == "" else {}
    version = f"{op_type}-{schema.since_version}"
    for attr in attributes:
        spec = schema.attributes.get(attr.name)
        defaulted = spec.default_value.type != onnx.AttributeProto.UNDEFINED and attr.i == spec.default_value.i
        if attr.name not in checked or attr.type != onnx.AttributeProto.INT or defaulted:
            continue  # Cast-1's `to` is a type's name (a STRING), which its lowering reads
        what = f"attribute {attr.name!r}{owner}"
        if attr.i not in tensor_data.KNOWN_TYPES:
            raise ModelLoadError(f"{what} is {attr.i}, which is not a TensorProto data type")
        output = checked[attr.name]
        if output is None:
            continue
        param = schema.outputs[output].type_str
        allowed = next(c.allowed_type_strs for c in schema.type_constraints if c.type_param_str == param)
        if not any(f"tensor({type_name(attr.i)})" in t for t in allowed):  # SequenceEmpty's: seq(tensor(...))
            raise ModelLoadError(f"{what} is {onnx.TensorProto.DataType.Name(attr.i)}, which {version}'s output "
                                 f"{schema.outputs[output].name!r} cannot have (it takes {sorted(allowed)})")


def call_attributes(function: onnx.FunctionProto,
                    given: Sequence[onnx.AttributeProto]) -> dict[str, onnx.AttributeProto]:
    """The attributes a call of `function` gives its body's references (ref_attr_name): the function's defaults
    (attribute_proto), the call's own over them."""
    return {a.name: a for a in function.attribute_proto} | {a.name: a for a in given}


def check_referenced_attributes(attributes: dict[str, onnx.AttributeProto], unknown: set[str],
                                function: onnx.FunctionProto, resolver: Resolver, call: str) -> None:
    """The attributes of `function`'s body that refer to the call's (`attributes`: given or defaulted), checked
    with the values this call gives them: a data-type one (DATA_TYPE_ATTRIBUTES) must name a type, and a required
    one must get a value. The body is bound once without a caller (check_function_body), where a reference has no
    value, so a bad or missing one (Cast's `to` <- t, called with t=99 or without t) had been met when first
    traced, not at load. `unknown`: the call's attributes that refer to its own caller's, bound by each call of
    the body it is in (the walk from the outermost call checks them). A call in the body that passes references
    on has its function's body checked so too."""
    opsets = opset_versions(function.opset_import, f"function {function.name!r}")
    known = {name: a for name, a in attributes.items() if name not in unknown}
    for proto in nodes_within(function.node):  # a reference in a subgraph names the function's attribute too
        references = [a for a in proto.attribute if a.ref_attr_name and a.ref_attr_name not in unknown]
        if not references:  # its literal values were checked when the body was bound
            continue
        node = f"node {proto.name or proto.op_type!r} of function {function.name!r} called by {call}"
        callee = resolver.functions.get(function_id(proto))
        if callee is not None:
            given = substitute_attribute_refs(proto.attribute, known)
            passed_on = {a.name for a in proto.attribute if a.ref_attr_name in unknown}
            check_referenced_attributes(call_attributes(callee, given), passed_on, callee, resolver, node)
            continue
        domain = canonical_domain(proto.domain)
        schema = schema_for(domain, proto.op_type, opsets[domain]) if domain in opsets else None
        if schema is None:  # reported as missing when the body was bound
            continue
        for reference in references:
            bound = substitute_attribute_refs([reference], known)
            owner = f" of {node} (it refers to the function's attribute {reference.ref_attr_name!r})"
            spec = schema.attributes.get(reference.name)
            if not bound and spec is not None and spec.required:
                raise ModelLoadError(f"attribute {reference.name!r}{owner} is required by {proto.op_type}-"
                                     f"{schema.since_version}, but the call does not set it and the function has "
                                     "no default for it")
            check_attributes_declared(bound, schema, proto.op_type, owner)
            check_data_type_attributes(bound, schema, proto.op_type, owner)


def check_input_count(proto: onnx.NodeProto, schema: onnx.defs.OpSchema, label: str) -> None:
    """The node has as many inputs as its schema takes, and each required one named (what onnx.checker says;
    check=False skips it): the lowering would be called with too few or too many arguments, a TypeError."""
    count, least, most = len(proto.input), schema.min_input, schema.max_input
    version = f"{proto.op_type}-{schema.since_version}"
    if not least <= count <= most:
        takes = f"at least {least}" if most >= 2**31 - 1 else f"{least}" if least == most else f"{least} to {most}"
        raise ModelLoadError(f"{label} has {count} inputs, but {version} takes {takes}")
    missing = missing_required(schema, [bool(name) for name in proto.input])
    if missing:
        raise ModelLoadError(f"input {missing[0]} ({schema.inputs[missing[0]].name!r}) of {label} is required by "
                             f"{version} but left empty")


def missing_required(schema: onnx.defs.OpSchema, given: Sequence[bool]) -> list[int]:
    """The positions of the schema's required (Single) inputs among the node's that `given` (one flag each) says
    are not given: a name left empty at load (check_input_count), no value at trace (walker.check_required_present)."""
    single = onnx.defs.OpSchema.FormalParameterOption.Single
    return [i for i, (present, formal) in enumerate(zip(given, schema.inputs))
            if not present and formal.option == single]


def check_call_inputs(proto: onnx.NodeProto, function: onnx.FunctionProto, label: str) -> None:
    """A call passes at most the inputs its function declares (fewer: the rest are absent, as optional inputs
    are); an extra input was dropped silently."""
    if len(proto.input) > len(function.input):
        raise ModelLoadError(f"{label} passes {len(proto.input)} inputs to local function "
                             f"{function.name!r}, which declares {len(function.input)}")


def schema_has_body(schema: onnx.defs.OpSchema | None, opset: int | None) -> bool:
    if schema is None or opset is None:
        return False
    versions = list(schema.function_opset_versions) + list(schema.context_dependent_function_opset_versions)
    return any(v <= opset for v in versions) or schema.has_function or schema.has_context_dependent_function


def build_graph(proto: onnx.GraphProto, resolver: Resolver) -> Graph:
    initializers = {t.name: resolver.initializer_value(t) for t in proto.initializer}
    for sparse in proto.sparse_initializer:
        label = f"sparse initializer {sparse.values.name!r}"
        initializers[sparse.values.name] = sparse_to_dense(sparse, label, resolver)
    return Graph(
        name=proto.name,
        inputs=tuple(value_info(v) for v in proto.input),
        outputs=tuple(value_info(v) for v in proto.output),
        initializers=initializers,
        nodes=tuple(build_node(n, resolver) for n in proto.node),
    )


def check_function_body(key: FunctionId, resolver: Resolver) -> None:
    """Bind a called model-local function's nodes once, so their unsupported ops are reported at load."""
    if key in resolver.checked:
        return
    resolver.checked.add(key)
    function = resolver.functions[key]
    inner = resolver.with_opsets(function.opset_import, f"function {function.name!r}")
    for node in function.node:
        build_node(node, inner, caller_attributes=None)


def model_resolver(model: onnx.ModelProto, zero_initializers: frozenset[str] = frozenset(),
                   external: ExternalValues | None = None) -> Resolver:
    """The opsets and functions nodes bind with, once the model is known to be well formed (well_formed.py)."""
    check_well_formed(model)
    functions = {function_id(f): detached(f) for f in model.functions}
    return Resolver(opset_versions(model.opset_import, "the model"), functions,
                    zero_initializers=zero_initializers, external=external)


def raise_if_missing(resolver: Resolver) -> None:
    if resolver.missing:
        raise UnsupportedOpError(resolver.missing)
