"""Invalid graphs the lowering rejects with a NodeError naming the node, where XLA would crash or a wrong value
would come out."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import onnxtrain
from onnxtrain.errors import NodeError
from training_models import TRAINING, model, tensor, vi


def test_gradient_with_respect_to_an_integer_input_is_an_error():
    """docs/semantics.md: integer xs are an error (JAX would return a float0 array)."""
    graph = helper.make_graph(
        [helper.make_node("Cast", ["K"], ["F"], to=TensorProto.FLOAT),
         helper.make_node("ReduceSum", ["F"], ["O"], keepdims=0)],
        "g", [], [vi("O", TensorProto.FLOAT, [])], [tensor("K", np.array([1, 2, 3], np.int64))],
    )
    algorithm = helper.make_graph(
        [helper.make_node("Gradient", ["K"], ["G"], domain=TRAINING, name="grad", xs=["K"], y="O")],
        "a", [], [vi("G", TensorProto.INT64, [3])],
    )
    engine = onnxtrain.load(model(graph, [helper.make_training_info(algorithm, [], None, None)]))
    with pytest.raises(NodeError, match=r"Gradient 'grad'.*xs input 'K' is int64"):
        engine.train_step({})
