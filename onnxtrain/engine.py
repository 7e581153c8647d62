"""The stateful object: holds the state as device buffers and calls the compiled pure functions."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

import jax
import numpy as np
import onnx

from .dtypes import is_float
from .feeds import check_feeds
from .lower.graph import Runtime, Scope, run_nodes
from .model import Graph, ModelSource, build_graph, check_model, model_resolver, raise_if_missing, read_model
from .program import Program


def split_initializers(graph: Graph, traced_names: set[str]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(static, traced): float weights and state are traced so they are not baked into the executable."""
    static, traced = {}, {}
    for name, value in graph.initializers.items():
        (traced if name in traced_names or is_float(value.dtype) else static)[name] = value
    return static, traced


class Engine:
    """An ONNX model lowered to JAX. `infer(feeds)` runs the main graph with the current state."""

    def __init__(self, model: onnx.ModelProto, seed: int = 0, check: bool = True):
        if check:
            check_model(model)
        self.model = model
        resolver = model_resolver(model)
        self.graph = build_graph(model.graph, resolver)
        raise_if_missing(resolver)
        self.functions = resolver.functions
        self.seed = seed
        self._key = jax.random.key(seed)
        initialized = set(self.graph.initializers)
        self.required_inputs = [i for i in self.graph.inputs if i.name not in initialized]
        self.optional_inputs = [i for i in self.graph.inputs if i.name in initialized]
        self._static_inits, traced = split_initializers(self.graph, set())
        with jax.enable_x64(True):
            self._params = {name: jax.device_put(value) for name, value in traced.items()}
        feed_names = {i.name for i in self.graph.inputs}
        self._infer = Program(self._infer_body, self.graph.nodes, feed_names)

    @property
    def input_names(self) -> list[str]:
        return [i.name for i in self.required_inputs]

    @property
    def output_names(self) -> list[str]:
        return [o.name for o in self.graph.outputs]

    def _infer_body(self, params, key, feeds, static_feeds):
        scope = Scope({**self._static_inits, **params, **static_feeds, **feeds})
        run_nodes(self.graph.nodes, scope, Runtime(key, self.functions))
        return {}, {o.name: scope[o.name] for o in self.graph.outputs}

    def infer(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        """Run the main graph on `feeds`; returns {output name: array}. Changes nothing."""
        checked = check_feeds(feeds, self.required_inputs, self.optional_inputs)
        _, outputs = self._infer(self._params, self._key, feeds=checked)
        return {name: outputs[name] for name in self.output_names}

    @property
    def trace_count(self) -> int:
        """How many times a graph was traced (compiled); a repeated input signature adds nothing."""
        return self._infer.trace_count

    @property
    def state(self) -> Mapping[str, Any]:
        return MappingProxyType({})


def load(source: ModelSource, seed: int = 0, check: bool = True) -> Engine:
    """Read an ONNX model (path, bytes or ModelProto), validate it and bind every node to its lowering."""
    model, _folder = read_model(source)
    return Engine(model, seed=seed, check=check)
