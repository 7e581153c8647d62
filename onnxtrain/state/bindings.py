"""Parse and validate `TrainingInfoProto`s against the rules of the ONNX IR spec ("Training Related Information").

Each rule violation raises BindingError naming the TrainingInfoProto, the binding, the key or value, and the rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import onnx

from ..errors import BindingError, StateError
from ..ir import Graph
from ..lower.build import Resolver, build_graph


@dataclass(frozen=True)
class Algorithm:
    """One TrainingInfoProto: its graphs and bindings (state variable name -> graph output name)."""

    index: int
    initialization: Graph | None
    initialization_binding: dict[str, str]
    graph: Graph  # TrainingInfoProto.algorithm
    update_binding: dict[str, str]


# One check per rule. Each quotes the sentence it enforces: from onnx.proto's comments on TrainingInfoProto, or from
# the IR spec ("Training Related Information") where it says so.


def binding_map(entries, where: str) -> dict[str, str]:
    """A binding's entries as a map. "To tell that "y" should be assigned to "x", the field "update_binding" may
    contain a key-value pair": a key given twice would assign one variable twice."""
    result: dict[str, str] = {}
    for entry in entries:
        if entry.key in result:
            raise BindingError(f"{where}: key {entry.key!r} appears twice (keys MUST be unique)")
        result[entry.key] = entry.value
    return result


def check_one_definition_per_name(where: str, algorithm: Graph, main_names: set[str]) -> None:
    """"This combined graph must satisfy the normal ONNX conditions": an algorithm initializer may not define a
    name ModelProto.graph already defines."""
    for name in algorithm.initializers:
        if name in main_names:
            raise BindingError(
                f"{where}.algorithm: initializer {name!r} is already defined by ModelProto.graph (the training "
                f"graph concatenates both, and it \"must satisfy the normal ONNX conditions\": one definition "
                f"per name)"
            )


def check_keys_are_initializers(where: str, kind: str, binding: dict[str, str], owners: set[str]) -> None:
    """"The keys must appear in names of "ModelProto.graph.initializer" or "TrainingInfoProto.algorithm.
    initializer"" (update_binding; initialization_binding binds "to some initializers in" the same two lists)."""
    for key in binding:
        if key not in owners:
            raise BindingError(
                f"{where}.{kind}: key {key!r} is not an initializer of ModelProto.graph or of this "
                f"TrainingInfoProto's algorithm (each key MUST name such an initializer)"
            )


def check_initialization_present(where: str, init_binding: dict[str, str], initialization: Graph | None) -> None:
    """IR spec: "A TrainingInfoProto.initialization MAY be omitted (only if there are no
    initialization_bindings)"."""
    if init_binding and initialization is None:
        raise BindingError(
            f"{where}: has initialization_binding but no initialization graph "
            f"(initialization MAY be omitted only if there are no initialization_bindings)"
        )


def check_initialization(where: str, init_binding: dict[str, str], initialization: Graph) -> None:
    """"Initialization graph has no input and can have multiple outputs", and initialization_binding binds "from
    the outputs of "initialization"": each value must be one of them."""
    if initialization.inputs:
        raise BindingError(
            f"{where}.initialization: takes inputs {[i.name for i in initialization.inputs]}, "
            f"but an initialization graph has no input"
        )
    init_outputs = {o.name for o in initialization.outputs}
    for key, value in init_binding.items():
        if value not in init_outputs:
            raise BindingError(
                f"{where}.initialization_binding: value {value!r} (for {key!r}) is not an output of "
                f"the initialization graph"
            )


def check_update_values(where: str, update_binding: dict[str, str], outputs: set[str]) -> None:
    """"The values must be output names of "algorithm" or "ModelProto.graph.output"."""
    for key, value in update_binding.items():
        if value not in outputs:
            raise BindingError(
                f"{where}.update_binding: value {value!r} (for {key!r}) is not an output of the algorithm "
                f"graph or of ModelProto.graph"
            )


def check_updated_once(where: str, index: int, update_binding: dict[str, str], updated_by: dict[str, int]) -> None:
    """"We have only unique keys in all "update_binding"s so that two variables may not have the same name. This
    ensures that one variable is assigned up to once." Records this TrainingInfoProto's keys in `updated_by`."""
    for key in update_binding:
        if key in updated_by:
            raise BindingError(
                f"{where}.update_binding: key {key!r} is already updated by training_info[{updated_by[key]}] "
                f"(update_binding keys MUST be unique across all TrainingInfoProtos)"
            )
        updated_by[key] = index


def parse_training_info(model: onnx.ModelProto, main: Graph, resolver: Resolver) -> list[Algorithm]:
    """Every TrainingInfoProto of `model`, checked rule by rule (BindingError naming the first broken one)."""
    algorithms = []
    updated_by: dict[str, int] = {}
    main_names = defined_names(main)
    for index, info in enumerate(model.training_info):
        where = f"training_info[{index}]"
        algorithm = build_graph(info.algorithm, resolver)
        check_one_definition_per_name(where, algorithm, main_names)
        has_init = info.HasField("initialization") and (
            len(info.initialization.node) or len(info.initialization.output)
        )
        initialization = build_graph(info.initialization, resolver) if has_init else None
        init_binding = binding_map(info.initialization_binding, f"{where}.initialization_binding")
        update_binding = binding_map(info.update_binding, f"{where}.update_binding")
        owners = set(main.initializers) | set(algorithm.initializers)
        check_keys_are_initializers(where, "initialization_binding", init_binding, owners)
        check_keys_are_initializers(where, "update_binding", update_binding, owners)
        check_initialization_present(where, init_binding, initialization)
        if initialization is not None:
            check_initialization(where, init_binding, initialization)
        check_update_values(where, update_binding, {o.name for o in algorithm.outputs + main.outputs})
        check_updated_once(where, index, update_binding, updated_by)
        algorithms.append(Algorithm(index, initialization, init_binding, algorithm, update_binding))
    return algorithms


def defined_names(graph: Graph) -> set[str]:
    """The names a graph defines: its inputs, initializers and node outputs."""
    names = {i.name for i in graph.inputs} | set(graph.initializers)
    return names | {name for node in graph.nodes for name in node.outputs if name}


def owner_graphs(model: onnx.ModelProto) -> dict[int | None, onnx.GraphProto]:
    """The graphs that can own state, keyed as `state_owner` keys them: None for ModelProto.graph, k for
    training_info[k].algorithm."""
    return {None: model.graph, **{k: info.algorithm for k, info in enumerate(model.training_info)}}


def binding_owners(model: onnx.ModelProto) -> dict[str, int | None]:
    """Every state variable of `model` (a binding key of one of its TrainingInfoProtos) -> where its initializer
    lives: None for ModelProto.graph, where it has one, else k for training_info[k].algorithm (the last
    TrainingInfoProto that binds it: a key bound by several is one variable). The one rule for the engine, the
    export and the checkpoint reader, read from the proto. A key neither graph holds is left out: `load` refuses
    it (check_keys_are_initializers), and a checkpoint read without it lacks that variable."""
    main = initializer_names(model.graph)
    owners: dict[str, int | None] = {}
    for index, info in enumerate(model.training_info):
        held = main | initializer_names(info.algorithm)
        for entry in (*info.initialization_binding, *info.update_binding):
            if entry.key in held:
                owners[entry.key] = None if entry.key in main else index
    return owners


def initializer_names(graph: onnx.GraphProto) -> set[str]:
    """The names `graph`'s initializers define, sparse ones included (as build_graph builds them)."""
    return {t.name for t in graph.initializer} | {s.values.name for s in graph.sparse_initializer}


def state_owners(model: onnx.ModelProto, graphs: Mapping[int | None, Graph]) -> dict[str, int | None]:
    """`binding_owners(model)`, for the graphs built from it (keyed as owner_graphs keys the protos), refusing a
    state variable they cannot hold."""
    owners = binding_owners(model)
    for key, owner in owners.items():
        if graphs[owner].initializers[key].dtype.kind in "OUS":  # else JAX's TypeError when the state goes there
            raise StateError(f"state variable {key!r} is a string tensor: the state lives on the device, "
                             "which holds numbers only")
    return owners
