"""The three pure functions of a training model, as the ONNX IR spec describes it ("Training Related Information"):

    init(model, state, key)                                        -> state
    train_step(model, k, state, step, consts, k_consts, key, feeds) -> StepResult(state', step', outputs, draws)
    infer(model, state, consts, key, feeds)                         -> outputs

`model` is a `StepModel`: the frozen description of everything a step reads that is not an array argument (the
graphs, the bindings, the model-local functions, the initializers that stay static). Each function only traces
nodes through the walker; none holds or mutates anything, so each can be jitted, differentiated or composed by
the caller. `Engine` (engine.py) is the stateful shell around them: it places arrays, compiles each function once
per input signature (program.py) and keeps the state buffers between calls.

Argument groups, all pytrees of arrays: `state` (the state variables, by name), `consts` (the main graph's
traced float initializers), `k_consts` (those of training_info[k].algorithm), `feeds` (graph inputs by name; a
feed overrides the initializer of the same name, which is its default).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple

import jax
import numpy as np
import onnx

from .ir import Graph, Node, live, reads
from .lower.autocast import MixedPrecision
from .lower.build import FunctionId
from .lower.typecheck import check_outputs, input_sizes
from .lower.walker import Scope, TraceContext, run_graph, run_nodes
from .state.bindings import Algorithm
from .state.store import assign
from .train_mode import PREFIX


@dataclass(frozen=True)
class StepModel:
    """What the step functions read besides their array arguments, fixed at load time."""

    graph: Graph  # ModelProto.graph
    algorithms: tuple[Algorithm, ...]  # one per TrainingInfoProto
    functions: Mapping[FunctionId, onnx.FunctionProto]  # model-local functions, by (domain, name, overload)
    main_static: Mapping[str, np.ndarray]  # the main graph's initializers that trace as constants
    algorithm_static: tuple[Mapping[str, np.ndarray], ...]  # the same for each algorithm graph
    # Applied to each new state inside a traced step so that it keeps the layout of the state it replaces
    # (placement.py: a state split over devices stays split, and its donated buffers are reused).
    keep_layout: Callable[[Mapping[str, Any]], dict[str, Any]] = field(default=dict)
    mixed_precision: MixedPrecision | None = None  # products in a low type (lower/autocast.py); None: as declared
    remat: bool | str = False  # what Gradient recomputes of its forward pass (lower/ops/training.py)


class StepResult(NamedTuple):
    state: dict[str, Any]  # every state variable after the step
    step: Any  # the step count after the step: advanced only if the step drew random numbers
    outputs: dict[str, Any]  # the outputs of both graphs, except those update_binding assigns to state
    draws: bool  # whether the step draws random numbers (a Python bool, known once traced)


def scope(*initializers: Mapping[str, Any], feeds: Mapping[str, Any]) -> Scope:
    """Initializers first, then feeds: a fed input overrides the initializer of the same name (its default)."""
    values: dict[str, Any] = {}
    for group in initializers:
        values.update(group)
    values.update(feeds)
    return Scope(values)


def infer(model: StepModel, state: Mapping[str, Any], consts: Mapping[str, Any], key: Any,
          feeds: Mapping[str, Any]) -> dict[str, Any]:
    """ModelProto.graph on `feeds`: {output name: value}."""
    values = scope(model.main_static, consts, state, feeds=feeds)
    trace = TraceContext(key, dict(model.functions), mixed_precision=model.mixed_precision, remat=model.remat)
    run_nodes(model.graph.nodes, values, trace)
    check_outputs(model.graph, values, input_sizes([model.graph], values))
    return {o.name: values[o.name] for o in model.graph.outputs}


def train_step(model: StepModel, k: int, state: Mapping[str, Any], step: Any, consts: Mapping[str, Any],
               k_consts: Mapping[str, Any], key: Any, feeds: Mapping[str, Any]) -> StepResult:
    """ModelProto.graph followed by training_info[k].algorithm (the spec's combined graph), then the state as
    update_binding assigns it. `step` (uint32) seeds the step's random streams: one step count, one stream."""
    algorithm = model.algorithms[k]
    values = scope(model.main_static, consts, model.algorithm_static[k], k_consts, state, feeds=feeds)
    trace = TraceContext(jax.random.fold_in(key, step), dict(model.functions), training=True, step=step,
                         mixed_precision=model.mixed_precision, remat=model.remat)
    # An output bound to state is the new state itself; returning it again would cost a copy per step.
    bound = set(algorithm.update_binding.values())
    # an inference output NAME whose train-mode copy the algorithm outputs is returned as the copy (copied_outputs),
    # once: the caller adds it under the copy's name too
    copies = copied_outputs(model, k)
    run_nodes(main_nodes_read(model, k, copies) + algorithm.graph.nodes, values, trace)
    sizes = input_sizes([model.graph, algorithm.graph], values)
    check_outputs(model.graph, values, sizes, copies)  # a copied output is checked as its copy, below
    check_outputs(algorithm.graph, values, sizes)
    outputs = {o.name: values[copies.get(o.name, o.name)]
               for o in model.graph.outputs + algorithm.graph.outputs
               if o.name not in bound and o.name not in copies.values()}
    new_state = assign(state, algorithm.update_binding, {n: values[n] for n in bound},
                       f"training_info[{k}].update_binding")
    # the count only seeds random streams: a step that draws none leaves it as it is (one kernel less)
    draws = trace.draws.any
    return StepResult(model.keep_layout(new_state), step + 1 if draws else step, outputs, draws)


def main_nodes_read(model: StepModel, k: int, copies: Mapping[str, str]) -> tuple[Node, ...]:
    """The main graph's nodes a train step of training_info[k] walks (ir.live): those computing a value that its
    algorithm's nodes read (a Gradient's forward slice included: ir.reads), its update_binding assigns, or it
    returns (the outputs of both graphs, but the main graph's that it returns as their train-mode `copies`). A
    plain make_trainable's algorithm reads the whole forward pass through its loss and Gradient, so the step walks
    every node; with train_mode the eval-mode forward pass is left out, whose value nothing reads: XLA dropped it
    as dead code, but the trace walked it (a 6-layer BERT: 573 of its 1,360 node walks, 0.1-0.2 s of its 0.85-1.0 s
    lowering on 2 CPU cores)."""
    algorithm = model.algorithms[k]
    needed = {name for node in algorithm.graph.nodes for name in reads(node)}
    needed |= set(algorithm.update_binding.values()) | {o.name for o in algorithm.graph.outputs}
    needed |= {o.name for o in model.graph.outputs if o.name not in copies}
    return live(model.graph.nodes, needed)


def copied_outputs(model: StepModel, k: int) -> dict[str, str]:
    """{NAME: PREFIX + NAME} for each inference output NAME whose train-mode copy training_info[k]'s algorithm
    outputs (make_trainable's train_mode): a train step returns the copy under both names, the training pass's
    value, as a PyTorch loop's outputs in train() (the eval-mode forward pass, whose value nothing else reads, is
    not computed at all). train_step returns it under NAME alone and the engine adds the other name after the
    call: a value a jitted function returns twice is two buffers, an LM's logits copied once more a step."""
    algorithm = model.algorithms[k]
    bound = set(algorithm.update_binding.values())
    outputs = {o.name for o in algorithm.graph.outputs if o.name.startswith(PREFIX) and o.name not in bound}
    return {o.name: PREFIX + o.name for o in model.graph.outputs
            if PREFIX + o.name in outputs and o.name not in bound}


def init(model: StepModel, state: Mapping[str, Any], key: Any) -> dict[str, Any]:
    """Every TrainingInfoProto.initialization in order, each assigning its initialization_binding; training_info[k]
    draws from `key` folded with k."""
    for algorithm in model.algorithms:
        graph = algorithm.initialization
        if graph is None:
            continue
        trace = TraceContext(jax.random.fold_in(key, algorithm.index), dict(model.functions),
                             mixed_precision=model.mixed_precision, remat=model.remat)
        values = dict(zip([o.name for o in graph.outputs], run_graph(graph, [], trace)))
        check_outputs(graph, values, {})
        state = assign(state, algorithm.initialization_binding, values,
                       f"training_info[{algorithm.index}].initialization_binding")
    return model.keep_layout(state)
