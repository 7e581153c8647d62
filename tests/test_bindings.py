"""Each rule of the spec's "Training Related Information" violated once, each with its own message."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import onnxtrain
from onnxtrain.errors import BindingError, StateError
from training_models import linear_regression, model, tensor, vi


def base():
    return linear_regression(np.zeros((2, 1), np.float32), np.zeros(1, np.float32), 0.1)


def with_info(edit) -> onnx.ModelProto:
    m = base()
    edit(m)
    return m


def add_binding(entries, key, value):
    b = entries.add()
    b.key, b.value = key, value


def init_graph(outputs=("Z",), inputs=()):
    nodes = [helper.make_node("Constant", [], [o], value=tensor(o, np.zeros((2, 1), np.float32))) for o in outputs]
    return helper.make_graph(nodes, "init", [vi(i, TensorProto.FLOAT, [1]) for i in inputs],
                             [vi(o, TensorProto.FLOAT, [2, 1]) for o in outputs])


CASES = {
    "key not an initializer": (
        lambda m: add_binding(m.training_info[0].update_binding, "Nope", "W_new"),
        "key 'Nope' is not an initializer",
    ),
    "repeated key": (
        lambda m: add_binding(m.training_info[0].update_binding, "W", "B_new"),
        "key 'W' appears twice",
    ),
    "update value not an output": (
        lambda m: add_binding(m.training_info[0].update_binding, "LR", "Missing"),
        "value 'Missing' (for 'LR') is not an output of the algorithm graph or of ModelProto.graph",
    ),
    "initialization binding without initialization graph": (
        lambda m: add_binding(m.training_info[0].initialization_binding, "W", "Z"),
        "MAY be omitted only if there are no initialization_bindings",
    ),
    "initialization value not an output": (
        lambda m: (
            m.training_info[0].initialization.CopyFrom(init_graph()),
            add_binding(m.training_info[0].initialization_binding, "W", "Other"),
        ),
        "value 'Other' (for 'W') is not an output of the initialization graph",
    ),
    "initialization graph with an input": (
        lambda m: (
            m.training_info[0].initialization.CopyFrom(init_graph(inputs=("In",))),
            add_binding(m.training_info[0].initialization_binding, "W", "Z"),
        ),
        "an initialization graph has no input",
    ),
    "algorithm initializer redefining a main-graph initializer": (
        lambda m: m.training_info[0].algorithm.initializer.append(tensor("W", np.ones((2, 1), np.float32))),
        "training_info[0].algorithm: initializer 'W' is already defined by ModelProto.graph",
    ),
    "update key bound by two TrainingInfoProtos": (
        lambda m: m.training_info.append(m.training_info[0]),
        "already updated by training_info[0]",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_binding_rule_violation_is_rejected_at_load(case):
    edit, message = CASES[case]
    with pytest.raises(BindingError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        onnxtrain.load(with_info(edit), check=False)


def assignment_model(new_value: np.ndarray) -> onnx.ModelProto:
    graph = helper.make_graph([helper.make_node("Identity", ["W"], ["Y"])], "g", [],
                              [vi("Y", TensorProto.FLOAT, [2])], [tensor("W", np.zeros(2, np.float32))])
    algorithm = helper.make_graph([helper.make_node("Constant", [], ["W_new"], value=tensor("v", new_value))],
                                  "a", [], [vi("W_new", onnx.helper.np_dtype_to_tensor_dtype(new_value.dtype))])
    return model(graph, [helper.make_training_info(algorithm, [("W", "W_new")], None, None)])


@pytest.mark.parametrize(
    "value, message",
    [(np.zeros(3, np.float32), r"float32\[3\] to state variable 'W' of float32\[2\]"),
     (np.zeros(2, np.float64), r"float64\[2\] to state variable 'W' of float32\[2\]")],
)
def test_assignment_changing_shape_or_dtype_is_refused(value, message):
    engine = onnxtrain.load(assignment_model(value), check=False)
    with pytest.raises(StateError, match=message):
        engine.train_step({})
    np.testing.assert_array_equal(np.asarray(engine.state["W"]), np.zeros(2, np.float32))


def test_a_string_state_variable_is_refused_at_load():
    """A string initializer bound as state: JAX's TypeError ("Dtype object is not a valid JAX array type") came
    out of the load, where the state goes to the device."""
    graph = helper.make_graph([helper.make_node("Identity", ["S"], ["Y"])], "g", [], [vi("Y", TensorProto.STRING, [1])],
                              [helper.make_tensor("S", TensorProto.STRING, [1], [b"a"])])
    algorithm = helper.make_graph([helper.make_node("Identity", ["S"], ["S_new"])], "a", [],
                                  [vi("S_new", TensorProto.STRING, [1])])
    with pytest.raises(StateError, match="state variable 'S' is a string tensor"):
        onnxtrain.load(model(graph, [helper.make_training_info(algorithm, [("S", "S_new")], None, None)]))


def test_unknown_algorithm_index():
    engine = onnxtrain.load(base())
    with pytest.raises(StateError, match="algorithm 3 does not exist"):
        engine.train_step({"X": np.zeros((1, 2), np.float32), "T": np.zeros((1, 1), np.float32)}, algorithm=3)


def test_an_empty_algorithm_graph_is_a_step_that_updates_nothing():
    """onnx.proto: the algorithm "is an empty graph" by default, and "evaluating the default training step never
    update any initializers"."""
    m = base()
    m.training_info.add()
    engine = onnxtrain.load(m)
    x = np.array([[1.0, 2.0]], np.float32)
    outputs = engine.train_step({"X": x}, algorithm=1)
    np.testing.assert_array_equal(np.asarray(outputs["Y"]), np.zeros((1, 1), np.float32))
    np.testing.assert_array_equal(np.asarray(engine.state["W"]), np.zeros((2, 1), np.float32))


def test_two_keys_bound_to_one_value_each_take_it():
    """No rule of onnx.proto's keeps two keys from naming one value (rule 1 makes the keys unique, not the values):
    both variables are assigned it."""
    graph = helper.make_graph([helper.make_node("Add", ["A", "B"], ["Y"])], "g", [], [vi("Y", TensorProto.FLOAT, [2])],
                              [tensor("A", np.array([1, 2], np.float32)), tensor("B", np.array([10, 20], np.float32))])
    algorithm = helper.make_graph([helper.make_node("Add", ["A", "One"], ["A_new"])], "a", [],
                                  [vi("A_new", TensorProto.FLOAT, [2])], [tensor("One", np.ones(2, np.float32))])
    info = helper.make_training_info(algorithm, [("A", "A_new"), ("B", "A_new")], None, None)
    engine = onnxtrain.load(model(graph, [info]))
    for _ in range(2):
        engine.train_step({})
    np.testing.assert_array_equal(np.asarray(engine.state["A"]), [3, 4])
    np.testing.assert_array_equal(np.asarray(engine.state["B"]), [3, 4])
