"""Single-node models for per-op tests: run through onnxtrain and through onnx's ReferenceEvaluator."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import helper
from onnx.reference import ReferenceEvaluator

import onnxtrain
from onnxtrain.dtypes import onnx_type
from onnxtrain.lower.layout import channels_first_results
from onnxtrain.lower.registry import lookup, schema_for


def node_model(
    op_type: str,
    inputs: dict[str, np.ndarray],
    n_outputs: int = 1,
    opset: int | None = None,
    domain: str = "",
    **attributes: Any,
) -> onnx.ModelProto:
    """A model of one node whose inputs are graph inputs named and typed after `inputs`."""
    outputs = [f"out{i}" for i in range(n_outputs)]
    node = helper.make_node(op_type, list(inputs), outputs, domain=domain, **attributes)
    graph = helper.make_graph(
        [node],
        op_type.lower(),
        [helper.make_tensor_value_info(n, onnx_type(v.dtype), v.shape) for n, v in inputs.items()],
        [helper.make_empty_tensor_value_info(o) for o in outputs],
    )
    opsets = [helper.make_opsetid(domain, opset or onnx.defs.onnx_opset_version())]
    if domain:
        opsets.append(helper.make_opsetid("", onnx.defs.onnx_opset_version()))
    return helper.make_model(graph, opset_imports=opsets)


def run_both(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(onnxtrain's outputs, the reference evaluator's outputs) for `feeds`."""
    engine = onnxtrain.load(model, check=False)
    got = engine.infer(feeds)
    ours = [np.asarray(got[name]) for name in engine.output_names]
    theirs = ReferenceEvaluator(model).run(None, feeds)
    return ours, [np.asarray(t) for t in theirs]


def assert_matches_reference(
    op_type: str, inputs: dict[str, np.ndarray], n_outputs: int = 1, rtol: float = 1e-5, atol: float = 1e-6, **attrs
) -> list[np.ndarray]:
    """Run a single-node model both ways and assert equal dtypes, shapes and values; returns ours."""
    model = node_model(op_type, inputs, n_outputs, **attrs)
    ours, theirs = run_both(model, inputs)
    for mine, ref in zip(ours, theirs):
        assert mine.dtype == ref.dtype, (mine.dtype, ref.dtype)
        assert mine.shape == ref.shape, (mine.shape, ref.shape)
        np.testing.assert_allclose(mine.astype(np.float64), ref.astype(np.float64), rtol=rtol, atol=atol)
    return ours


def run_with_engine(
    model: onnx.ModelProto, feeds: dict[str, Any], engine: onnxtrain.Engine | None = None
) -> tuple[list[np.ndarray], onnxtrain.Engine]:
    """Every output of `model` (in graph order) as NumPy, and the engine (pass it back to reuse its cache)."""
    engine = engine or onnxtrain.load(model, check=False)
    outputs = engine.infer(feeds)
    return [np.asarray(outputs[name]) for name in engine.output_names], engine


def run_outputs(model: onnx.ModelProto, feeds: dict[str, Any]) -> list[np.ndarray]:
    return run_with_engine(model, feeds)[0]


def value(name: str, elem_type: int, shape=None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, shape)


def graph_model(nodes, inputs, outputs, initializers=(), opset: int = 21) -> onnx.ModelProto:
    """A model of `nodes`; outputs are names (types left to inference), initializers a name -> array map."""
    graph = helper.make_graph(
        nodes, "g", inputs, [helper.make_value_info(o, helper.TypeProto()) for o in outputs],
        [onnx.numpy_helper.from_array(v, n) for n, v in dict(initializers).items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def lowering(op_type: str, opset: int = onnx.defs.onnx_opset_version()):
    """The function registered for `op_type` at `opset` (to call or differentiate directly), its results as the
    model sees them (a channels-last activation transposed back)."""
    fn = lookup("", op_type, schema_for("", op_type, opset).since_version).fn

    def call(*args: Any, **attrs: Any) -> Any:
        return channels_first_results(fn(*args, **attrs))

    return call
