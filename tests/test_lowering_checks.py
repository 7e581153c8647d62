"""Invalid graphs the lowering rejects with a NodeError naming the node, where XLA would crash or a wrong value
would come out."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import onnxtrain
from onnxtrain.errors import NodeError, ValueTooLargeError
from onnxtrain.lower import values
from training_models import TRAINING, linear_regression, model, tensor, vi


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


def test_gradient_with_respect_to_a_name_the_graph_does_not_define_is_an_error():
    """xs=['W', 'Nope'] fed W and B: no node reads 'Nope', so B's gradient came out zeros and B never trained."""
    m = linear_regression(np.zeros((2, 1), np.float32), np.zeros(1, np.float32), 0.1)
    gradient = next(n for n in m.training_info[0].algorithm.node if n.op_type == "Gradient")
    gradient.name = "grad"
    next(a for a in gradient.attribute if a.name == "xs").strings[:] = [b"W", b"Nope"]
    engine = onnxtrain.load(m)
    with pytest.raises(NodeError, match=r"Gradient 'grad'.*xs/zs name \['Nope'\], which the graph does not define"):
        engine.train_step({"X": np.ones((2, 2), np.float32), "T": np.ones((2, 1), np.float32)})
    np.testing.assert_array_equal(np.asarray(engine.state["B"]), np.zeros(1, np.float32))


def test_gradient_of_an_integer_y_is_an_error():
    """An integer y (the loss cast to int64) has no derivative: JAX had returned zero gradients, so the step ran
    and W, B never trained. The step fails before it runs: the state is as it was."""
    m = linear_regression(np.zeros((2, 1), np.float32), np.zeros(1, np.float32), 0.1)
    algorithm = m.training_info[0].algorithm
    gradient = next(n for n in algorithm.node if n.op_type == "Gradient")
    gradient.name = "grad"
    next(a for a in gradient.attribute if a.name == "y").s = b"IntLoss"
    algorithm.node.insert(list(algorithm.node).index(gradient),
                          helper.make_node("Cast", ["Loss"], ["IntLoss"], to=TensorProto.INT64))
    engine = onnxtrain.load(m)
    with pytest.raises(NodeError, match=r"Gradient 'grad': y='IntLoss' is int64, which has no derivative"):
        engine.train_step({"X": np.ones((2, 2), np.float32), "T": np.ones((2, 1), np.float32)})
    np.testing.assert_array_equal(np.asarray(engine.state["W"]), np.zeros((2, 1), np.float32))


def expand_to(data: str, size: int) -> onnx.ModelProto:
    nodes = [
        helper.make_node("Constant", [], ["S"], value=tensor("S", np.array([size], np.int64))),
        helper.make_node("Constant", [], ["C"], value=tensor("C", np.ones(1, np.float32))),
        helper.make_node("Expand", [data, "S"], ["Y"], name="big"),
    ]
    graph = helper.make_graph(nodes, "g", [vi("X", TensorProto.FLOAT, [1])], [vi("Y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_result_too_large_for_any_device_is_refused_before_xla_sees_it():
    """Expand to [2**63 - 1] aborted the whole process (SIGABRT from XLA's int64 size arithmetic). Traced data is
    checked on the traced result; a constant's before it is computed, at load (the next test)."""
    engine = onnxtrain.load(expand_to("X", 2**63 - 1), check=False)
    with pytest.raises(ValueTooLargeError, match=r"Expand 'big': output 'Y' would be float32\[9223372036854775807\], "
                                                 r"3.69e\+19 bytes: more than any device holds"):
        engine.infer({"X": np.ones(1, np.float32)})


def constant_of_shape():
    return [helper.make_node("ConstantOfShape", ["S"], ["Y"], name="big",
                             value=tensor("v", np.ones(1, np.float32)))], "its output would be float32"


def expand_of_a_constant():
    return [helper.make_node("Expand", ["C", "S"], ["Y"], name="big")], "output 'Y' would be float32"


def range_of_constants():
    return [helper.make_node("Range", ["zero", "S", "one"], ["Y"], name="big")], "its steps would be int64"


@pytest.mark.parametrize("make", [constant_of_shape, expand_of_a_constant, range_of_constants])
def test_a_constant_no_host_memory_holds_is_refused_at_load_before_it_is_built(make, monkeypatch):
    """A value computed from constants is built on the host, at load (lower/folding.py): one of 8 GiB, over a
    host bound of 4 GiB here, had come out of the first infer as a NodeError wrapping NumPy's MemoryError (or
    XLA's RESOURCE_EXHAUSTED), or had taken the host's memory. Refused before any of it is allocated."""
    monkeypatch.setattr(values, "MAX_HOST_VALUE_BYTES", 2**32)
    model = expand_to("C", 2**31)
    nodes, built = make()
    del model.graph.node[2:]
    model.graph.node.extend(nodes)
    model.graph.initializer.extend([tensor("zero", np.int64(0)), tensor("one", np.int64(1))])
    with pytest.raises(ValueTooLargeError, match=f"{nodes[0].op_type} 'big': {built}\\[2147483648\\], "
                                                 r"\d{10,11} bytes: more than this host's memory \(the limit is "
                                                 r"4294967296 bytes\)"):
        onnxtrain.load(model, check=False)


def test_a_constant_shape_computed_from_run_time_shapes_is_refused_at_the_first_step(monkeypatch):
    """A ConstantOfShape whose shape the trace computes from an input's static shape is known at the first infer
    only: the same error there, naming node, op and bytes."""
    monkeypatch.setattr(values, "MAX_HOST_VALUE_BYTES", 2**20)
    nodes = [helper.make_node("Shape", ["X"], ["s"]), helper.make_node("Mul", ["s", "k"], ["S"]),
             helper.make_node("ConstantOfShape", ["S"], ["Y"], name="zeros")]
    graph = helper.make_graph(nodes, "g", [vi("X", TensorProto.FLOAT, ["N"])], [vi("Y", TensorProto.FLOAT, ["M"])],
                              [tensor("k", np.array([2**17], np.int64))])
    engine = onnxtrain.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    np.testing.assert_array_equal(engine.infer({"X": np.ones(1, np.float32)})["Y"], np.zeros(2**17, np.float32))
    with pytest.raises(ValueTooLargeError, match=r"ConstantOfShape 'zeros': its output would be float32\[393216\], "
                                                 r"1572864 bytes: more than this host's memory \(the limit is 1048576"):
        engine.infer({"X": np.ones(3, np.float32)})


def test_inputs_bound_to_one_type_parameter_must_agree():
    """X retyped to int64 into Gemm with float weights: ONNX Runtime refuses the model ("Type parameter (T) ...
    bound to different types"); JAX would promote and return floats."""
    graph = helper.make_graph([helper.make_node("Gemm", ["X", "W"], ["Y"], name="fc", transB=1)], "g",
                              [vi("X", TensorProto.INT64, [2, 3])], [vi("Y", TensorProto.FLOAT, [2, 4])],
                              [tensor("W", np.ones((4, 3), np.float32))])
    engine = onnxtrain.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    with pytest.raises(NodeError, match=r"Gemm 'fc': input 1 \('W'\) is tensor\(float\) but input 0 \('X'\) is "
                                        r"tensor\(int64\)"):
        engine.infer({"X": np.ones((2, 3), np.int64)})


def if_model(then_types, else_types):
    def branch(name, dtypes):
        nodes = [helper.make_node("Constant", [], [f"{name}{i}"], value=tensor(f"{name}{i}", np.ones(1, d)))
                 for i, d in enumerate(dtypes)]
        outputs = [vi(f"{name}{i}", helper.np_dtype_to_tensor_dtype(np.dtype(d)), [1]) for i, d in enumerate(dtypes)]
        return helper.make_graph(nodes, name, [], outputs)

    node = helper.make_node("If", ["C"], ["Y"], name="choose", then_branch=branch("t", then_types),
                            else_branch=branch("e", else_types))
    graph = helper.make_graph([node], "g", [vi("C", TensorProto.BOOL, [])], [vi("Y", TensorProto.FLOAT, [1])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("else_types, message", [
    ((np.float32, np.float32), "else_branch has 2 outputs, the node 1"),
    ((np.int64,), "output 0 differs in element type between the branches"),
])
def test_if_branches_must_agree(else_types, message):
    """Checked before either branch runs: with a cond known at trace time only one would."""
    engine = onnxtrain.load(if_model((np.float32,), else_types), check=False)
    with pytest.raises(NodeError, match=f"If 'choose': {message}"):
        engine.infer({"C": np.array(True)})


def declared(graph, name: str):
    return next(o for o in graph.output if o.name == name).type.tensor_type


def declare_double(t):
    t.elem_type = TensorProto.DOUBLE


def declare_other_size(t):
    t.shape.dim[-1].dim_value = 4


def declare_other_rank(t):
    t.shape.dim.add().dim_value = 1


@pytest.mark.parametrize("graph, output, change, message", [
    ("main", "Y", declare_double, "output 'Y' of graph 'linear' is declared double but computes float"),
    ("main", "Y", declare_other_size, r"output 'Y' of graph 'linear' is declared of shape \['N', 4\] but computes \[2"),
    ("main", "Y", declare_other_rank, r"output 'Y' of graph 'linear' is declared of shape \['N', 1, 1\] but computes"),
    ("algorithm", "W_new", declare_double, "output 'W_new' of graph 'sgd' is declared double but computes float"),
    ("algorithm", "W_new", declare_other_size, r"output 'W_new' of graph 'sgd' is declared of shape \[2, 4\]"),
])
def test_an_output_computed_other_than_declared_is_an_error(graph, output, change, message):
    """The value returned is what the graph computes; a declaration it contradicts is a model error (the checker
    passes it: it infers no types), not a reading to choose. dim_param and elem_type 0 leave it free."""
    m = linear_regression(np.zeros((2, 1), np.float32), np.zeros(1, np.float32), 0.1)
    change(declared(m.graph if graph == "main" else m.training_info[0].algorithm, output))
    feeds = {"X": np.ones((2, 2), np.float32), "T": np.ones((2, 1), np.float32)}
    engine = onnxtrain.load(m)
    with pytest.raises(NodeError, match=message):
        engine.train_step(feeds)
    if graph == "main":
        with pytest.raises(NodeError, match=message):
            engine.infer({"X": feeds["X"]})


def if_then_declared_2() -> tuple[onnx.ModelProto, dict]:
    """The If of if_model with its then-branch's output declared [2] (it computes [1])."""
    m = if_model((np.float32,), (np.float32,))
    then = next(a.g for a in m.graph.node[0].attribute if a.name == "then_branch")
    then.output[0].type.tensor_type.shape.dim[0].dim_value = 2
    return m, {"C": np.array(True)}


def loop_body_declaring(carried: int, scan_shape: list) -> onnx.ModelProto:
    """Loop 'repeat' (3 iterations) of a body v -> (v + v, scan v), declaring v + v's type and the scan's shape."""
    body = helper.make_graph(
        [helper.make_node("Identity", ["c"], ["c2"]), helper.make_node("Add", ["v", "v"], ["v2"]),
         helper.make_node("Identity", ["v"], ["s"])], "body",
        [vi("i", TensorProto.INT64, []), vi("c", TensorProto.BOOL, []), vi("v", TensorProto.FLOAT, [3])],
        [vi("c2", TensorProto.BOOL, []), vi("v2", carried, [3]), vi("s", TensorProto.FLOAT, scan_shape)])
    graph = helper.make_graph([helper.make_node("Loop", ["M", "", "X"], ["V", "S"], body=body, name="repeat")], "g",
                              [vi("X", TensorProto.FLOAT, [3])], [vi("V", TensorProto.FLOAT, None),
                                                                   vi("S", TensorProto.FLOAT, None)],
                              [tensor("M", np.array(3, np.int64))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("make, message", [
    (if_then_declared_2, r"If 'choose' \(then_branch\): output 't0' of graph 't' is declared of shape "
                                       r"\[2\] but computes \[1\]"),
    (lambda: (loop_body_declaring(TensorProto.INT64, [3]), {"X": np.ones(3, np.float32)}),
     r"Loop 'repeat' \(body\): output 'v2' of graph 'body' is declared int64 but computes float"),
    (lambda: (loop_body_declaring(TensorProto.FLOAT, [3, 1]), {"X": np.ones(3, np.float32)}),
     r"Loop 'repeat' \(body\): output 's' of graph 'body' is declared of shape \[3, 1\] but computes \[3\]"),
], ids=["if-branch-shape", "loop-carried-type", "loop-scan-rank"])
def test_a_subgraph_output_computed_other_than_declared_is_an_error(make, message):
    """Nested graphs' declarations are checked as a top-level graph's are: the values had passed on as computed."""
    m, feeds = make()
    with pytest.raises(NodeError, match=message):
        onnxtrain.load(m, check=False).infer(feeds)


def test_a_subgraph_rank_declared_without_sizes_is_the_exporters_guess():
    """TorchScript's scatter_reduce, exported with a dynamic batch: If(rank(X) == 0) flattens in then_branch and
    passes X on in else_branch, whose output it declares with the then_branch's rank-1 placeholder. ONNX Runtime
    runs it (warning of the shape); the check had refused every such export. A declared number still binds."""
    placeholder = ["Reshape_output_0_dim_0"]
    branch = lambda op, extra: helper.make_graph(  # noqa: E731
        [helper.make_node(op, ["X", *extra], ["B"])], op, [], [vi("B", TensorProto.FLOAT, placeholder)])
    nodes = [helper.make_node("Shape", ["X"], ["S"]), helper.make_node("Size", ["S"], ["R"]),
             helper.make_node("Equal", ["R", "zero"], ["C"]),
             helper.make_node("If", ["C"], ["Y"], then_branch=branch("Reshape", ["flat"]),
                              else_branch=branch("Identity", []))]
    graph = helper.make_graph(nodes, "g", [vi("X", TensorProto.FLOAT, ["batch", 3])],
                              [vi("Y", TensorProto.FLOAT, ["batch", 3])],
                              [tensor("zero", np.array(0, np.int64)), tensor("flat", np.array([-1], np.int64))])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    ort = pytest.importorskip("onnxruntime")
    expected = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"X": x})[0]
    np.testing.assert_array_equal(np.asarray(onnxtrain.load(m).infer({"X": x})["Y"]), expected)


@pytest.mark.parametrize("outputs, message", [
    ([("Y", ["N", 3])], r"output 'Y' of graph 'g': dimension 0 \('N'\) is 4, but input 'X' dimension 0 gave 'N' = 2"),
    ([("X2", ["M", 3]), ("Y", ["M", 3])],
     r"output 'Y' of graph 'g': dimension 0 \('M'\) is 4, but output 'X2' of graph 'g' dimension 0 gave 'M' = 2"),
], ids=["input-and-output", "two-outputs"])
def test_a_dim_param_is_one_size_across_the_graph(outputs, message):
    """IR.md: "A dimension variable "N" represents the same value across the entire graph in a model": an output
    declared [N, 3] that computes 2N rows had passed, each dim_param matching any size."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["X"], ["X2"]), helper.make_node("Concat", ["X", "X"], ["Y"], axis=0)], "g",
        [vi("X", TensorProto.FLOAT, ["N", 3])], [vi(name, TensorProto.FLOAT, shape) for name, shape in outputs])
    engine = onnxtrain.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    with pytest.raises(NodeError, match=message):
        engine.infer({"X": np.ones((2, 3), np.float32)})


def test_an_output_declared_without_type_or_with_symbolic_dims_takes_what_is_computed():
    m = linear_regression(np.zeros((2, 1), np.float32), np.zeros(1, np.float32), 0.1)
    y = declared(m.graph, "Y")
    y.elem_type = 0
    y.shape.dim[1].dim_param = "M"
    w_new = declared(m.training_info[0].algorithm, "W_new")
    w_new.shape.dim[0].dim_param = "K"
    w_new.shape.dim[1].Clear()  # neither dim_value nor dim_param: unknown
    engine = onnxtrain.load(m, check=False)  # the checker wants a main output's type
    assert engine.infer({"X": np.ones((2, 2), np.float32)})["Y"].shape == (2, 1)
    engine.train_step({"X": np.ones((2, 2), np.float32), "T": np.ones((2, 1), np.float32)})
