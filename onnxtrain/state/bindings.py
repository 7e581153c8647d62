"""Parse and validate `TrainingInfoProto`s against the rules of the ONNX IR spec ("Training Related Information").

Each rule violation raises BindingError naming the TrainingInfoProto, the binding, the key or value, and the rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from ..errors import BindingError
from ..model import Graph, Resolver, build_graph


@dataclass(frozen=True)
class Algorithm:
    """One TrainingInfoProto: its graphs and bindings (state variable name -> graph output name)."""

    index: int
    initialization: Graph | None
    initialization_binding: dict[str, str]
    algorithm: Graph
    update_binding: dict[str, str]


def binding_map(entries, where: str) -> dict[str, str]:
    result: dict[str, str] = {}
    for entry in entries:
        if entry.key in result:
            raise BindingError(f"{where}: key {entry.key!r} appears twice (keys MUST be unique)")
        result[entry.key] = entry.value
    return result


def parse_training_info(model: onnx.ModelProto, main: Graph, resolver: Resolver) -> list[Algorithm]:
    algorithms = []
    updated_by: dict[str, int] = {}
    main_outputs = {o.name for o in main.outputs}
    main_names = defined_names(main)
    for index, info in enumerate(model.training_info):
        where = f"training_info[{index}]"
        algorithm = build_graph(info.algorithm, resolver)
        for name in algorithm.initializers:
            if name in main_names:
                raise BindingError(
                    f"{where}.algorithm: initializer {name!r} is already defined by ModelProto.graph (the training "
                    f"graph concatenates both, and it \"must satisfy the normal ONNX conditions\": one definition "
                    f"per name)"
                )
        has_init = info.HasField("initialization") and (
            len(info.initialization.node) or len(info.initialization.output)
        )
        initialization = build_graph(info.initialization, resolver) if has_init else None
        init_binding = binding_map(info.initialization_binding, f"{where}.initialization_binding")
        update_binding = binding_map(info.update_binding, f"{where}.update_binding")
        owners = set(main.initializers) | set(algorithm.initializers)
        for kind, binding in (("initialization_binding", init_binding), ("update_binding", update_binding)):
            for key in binding:
                if key not in owners:
                    raise BindingError(
                        f"{where}.{kind}: key {key!r} is not an initializer of ModelProto.graph or of this "
                        f"TrainingInfoProto's algorithm (each key MUST name such an initializer)"
                    )
        if init_binding and initialization is None:
            raise BindingError(
                f"{where}: has initialization_binding but no initialization graph "
                f"(initialization MAY be omitted only if there are no initialization_bindings)"
            )
        if initialization is not None:
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
        algorithm_outputs = {o.name for o in algorithm.outputs} | main_outputs
        for key, value in update_binding.items():
            if value not in algorithm_outputs:
                raise BindingError(
                    f"{where}.update_binding: value {value!r} (for {key!r}) is not an output of the algorithm "
                    f"graph or of ModelProto.graph"
                )
            if key in updated_by:
                raise BindingError(
                    f"{where}.update_binding: key {key!r} is already updated by training_info[{updated_by[key]}] "
                    f"(update_binding keys MUST be unique across all TrainingInfoProtos)"
                )
            updated_by[key] = index
        algorithms.append(Algorithm(index, initialization, init_binding, algorithm, update_binding))
    return algorithms


def defined_names(graph: Graph) -> set[str]:
    """The names a graph defines: its inputs, initializers and node outputs."""
    names = {i.name for i in graph.inputs} | set(graph.initializers)
    return names | {name for node in graph.nodes for name in node.outputs if name}


def state_owners(main: Graph, algorithms: list[Algorithm]) -> dict[str, int | None]:
    """Every state variable -> where its initializer lives: None for ModelProto.graph, k for training_info[k]."""
    owners: dict[str, int | None] = {}
    for algorithm in algorithms:
        for key in list(algorithm.initialization_binding) + list(algorithm.update_binding):
            owners[key] = None if key in main.initializers else algorithm.index
    return owners
