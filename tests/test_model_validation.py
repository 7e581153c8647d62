"""A malformed model file or proto is one ModelLoadError naming the culprit, never a traceback from NumPy or onnx,
and reading it never blocks or reads without end."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain.errors import ModelLoadError, NodeError


def add_model() -> onnx.ModelProto:
    """c = a + b, with b an initializer."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["c"])], "add",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, ["N", 3])],
        [numpy_helper.from_array(np.ones(3, np.float32), "b")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_fifo_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "m.onnx")
    with pytest.raises(ModelLoadError, match="m.onnx' is not a regular file"):
        onnxtrain.load(tmp_path / "m.onnx")


def test_sparse_constants_that_no_host_memory_holds_are_refused():
    """Eight sparse Constants of 2 GiB dense each (at the bound of one, 8 bytes of the file each): their dense forms
    had let NumPy's MemoryError out of load; the second now takes their total past the bound of all of them
    (DenseBudget). A child process whose address space is capped at 8 GiB loads them, so that no system's
    overcommit lets them pass."""
    model = add_model()
    for i in range(8):
        sparse = helper.make_sparse_tensor(numpy_helper.from_array(np.ones(1, np.float32)),
                                           numpy_helper.from_array(np.array([0], np.int64)), [2**29 - 1024])
        model.graph.node.append(helper.make_node("Constant", [], [f"k{i}"], sparse_value=sparse, name=f"k{i}"))
    child = ("import resource, sys, onnxtrain\n"
             "resource.setrlimit(resource.RLIMIT_AS, (2**33, 2**33))\n"
             "try:\n    onnxtrain.load(sys.stdin.buffer.read(), check=False)\n"
             "except onnxtrain.errors.ModelLoadError as exc:\n    print(exc)\n")
    done = subprocess.run([sys.executable, "-c", child], input=model.SerializeToString(), capture_output=True,
                          timeout=300)
    assert re.fullmatch(rb"attribute 'sparse_value' of node 'k1': its dense form of 2147479552 bytes takes the dense "
                        rb"forms of the model's sparse tensors past 2147483647 bytes together \(2147479552 before "
                        rb"it\); store the large ones dense\n", done.stdout), done.stderr[-2000:]


def sparse_vector(name: str, size: int, position: int, value: float) -> onnx.SparseTensorProto:
    return helper.make_sparse_tensor(numpy_helper.from_array(np.array([value], np.float32), name),
                                     numpy_helper.from_array(np.array([position], np.int64)), [size])


def test_sparse_tensors_each_under_the_bound_are_bounded_together(monkeypatch):
    """Sparse initializers and constants, in every graph, each far under the bound of one, take one budget: 3 of
    400 dense bytes load (their dense values as NumPy writes them), a 4th in the training graph takes them past 1500."""
    from onnxtrain.lower import build
    monkeypatch.setattr(build, "MAX_SPARSE_DENSE_BYTES", 1500)
    model = add_model()
    model.graph.sparse_initializer.extend([sparse_vector("s0", 100, 3, 2.0), sparse_vector("s1", 100, 99, -1.0)])
    model.graph.node.append(helper.make_node("Constant", [], ["s2"], sparse_value=sparse_vector("s2", 100, 0, 5.0)))
    model.graph.node.append(helper.make_node("Sum", ["s0", "s1", "s2"], ["s"]))
    model.graph.output.append(helper.make_tensor_value_info("s", TensorProto.FLOAT, [100]))
    expected = np.zeros(100, np.float32)
    expected[[3, 99, 0]] = [2.0, -1.0, 5.0]
    engine = onnxtrain.load(model)
    np.testing.assert_array_equal(engine.infer({"a": np.ones((1, 3), np.float32)})["s"], expected)
    info = training_graph_reading(model, "b")
    info.algorithm.node.append(helper.make_node("Constant", [], ["s3"], sparse_value=sparse_vector("s3", 100, 1, 1.0),
                                                name="k3"))
    with pytest.raises(ModelLoadError, match=r"attribute 'sparse_value' of node 'k3': its dense form of 400 bytes "
                                             r"takes the dense forms of the model's sparse tensors past 1500 bytes "
                                             r"together \(1200 before it\)"):
        onnxtrain.load(model)


def test_sparse_tensors_of_function_bodies_are_bounded_per_trace_not_per_call(monkeypatch):
    """A local function's sparse Constant (400 dense bytes) is built again by each call the trace expands: three
    calls take 1200 of a trace's 1500 bytes, and each trace (a new batch size) has its own; a fourth call takes
    them past it, where each call had had 1500 of its own."""
    from onnxtrain.lower import build
    monkeypatch.setattr(build, "MAX_SPARSE_DENSE_BYTES", 1500)
    local = "local.fns"
    body = [helper.make_node("Constant", [], ["k"], sparse_value=sparse_vector("k", 100, 3, 2.0), name="k"),
            helper.make_node("Add", ["x", "k"], ["y"])]
    function = helper.make_function(local, "AddK", ["x"], ["y"], body, [helper.make_opsetid("", 17)])

    def calls(count: int) -> onnx.ModelProto:
        nodes = [helper.make_node("AddK", [f"h{i}"], [f"h{i + 1}"], domain=local) for i in range(count)]
        graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("h0", TensorProto.FLOAT, ["N", 100])],
                                  [helper.make_tensor_value_info(f"h{count}", TensorProto.FLOAT, ["N", 100])])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(local, 1)],
                                 functions=[function])

    engine = onnxtrain.load(calls(3))
    for batch in (1, 2):
        x = np.random.default_rng(batch).standard_normal((batch, 100)).astype(np.float32)
        expected = x.copy()
        expected[:, 3] += 3 * np.float32(2.0)
        np.testing.assert_allclose(engine.infer({"h0": x})["h3"], expected, rtol=1e-6)
    engine = onnxtrain.load(calls(4))
    with pytest.raises(ModelLoadError, match=r"^attribute 'sparse_value' of node 'k': its dense form of 400 bytes "
                                             r"takes the dense forms of the model's sparse tensors past 1500 bytes "
                                             r"together \(1200 before it\)"):
        engine.infer({"h0": np.zeros((1, 100), np.float32)})


def test_a_path_a_shell_would_have_read_otherwise_says_so(tmp_path, monkeypatch):
    """'~' (expanded by shells, not by open()) and white space around a path (a line read from a file) name no
    file: the error says what was meant; a path given as bytes is read as a model's contents, and says so."""
    onnx.save(add_model(), tmp_path / "m.onnx")
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ModelLoadError, match=r"'~' is expanded by shells, not here: os.path.expanduser gives '.*'"):
        onnxtrain.load("~/m.onnx")
    with pytest.raises(ModelLoadError, match=r"it has white space around it, and '.*m.onnx' exists"):
        onnxtrain.load(f"{tmp_path / 'm.onnx'}\n")
    with pytest.raises(ModelLoadError, match="bytes are a model's contents: give its path as a str"):
        onnxtrain.load(os.fsencode(tmp_path / "m.onnx"))
    (tmp_path / "m.onnx.data").write_bytes(np.arange(64, dtype=np.float32).tobytes())  # weights, not a model
    with pytest.raises(ModelLoadError, match="external data file of a model: load the .onnx file that references"):
        onnxtrain.load(tmp_path / "m.onnx.data")
    out = onnxtrain.load(os.path.expanduser("~/m.onnx")).infer({"a": np.zeros((2, 3), np.float32)})
    np.testing.assert_array_equal(out["c"], np.ones((2, 3), np.float32))  # the file meant, c = 0 + b


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="no /dev/zero")
def test_device_is_refused_without_reading_it():
    with pytest.raises(ModelLoadError, match="'/dev/zero' is not a regular file"):
        onnxtrain.load("/dev/zero")


def test_file_larger_than_a_protobuf_is_refused_unread(tmp_path):
    path = tmp_path / "huge.onnx"
    with open(path, "wb") as f:
        f.truncate(2**31)  # sparse: no disk or memory spent
    with pytest.raises(ModelLoadError, match="huge.onnx' has 2147483648 bytes, more than a protobuf"):
        onnxtrain.load(path)


def unknown_type(m):
    m.graph.initializer[0].data_type = 99


def short_raw_data(m):
    m.graph.initializer[0].raw_data = b"\0" * 8


def huge_dims(m):
    m.graph.initializer[0].dims[:] = [2**62]


def negative_dims(m):
    m.graph.initializer[0].dims[:] = [-1]


def empty_with_a_huge_dim(m):
    """No bytes back an empty tensor's dims: NumPy's reshape to them had raised its own ValueError."""
    m.graph.initializer[0].dims[:] = [0, 2**62]
    m.graph.initializer[0].raw_data = b""


def empty_constant_with_huge_dims(m):
    value = numpy_helper.from_array(np.zeros(0, np.float32))
    value.dims[:] = [2**40, 2**40, 0]
    m.graph.node.append(helper.make_node("Constant", [], ["k"], value=value, name="const"))


def sparse_empty_with_a_huge_dim(m):
    m.graph.sparse_initializer.append(helper.make_sparse_tensor(
        numpy_helper.from_array(np.zeros(0, np.float32), "sp"), numpy_helper.from_array(np.zeros((0, 2), np.int64)),
        [0, 2**62]))


def segment(m):
    m.graph.initializer[0].segment.begin = 0


def too_few_floats(m):
    t = m.graph.initializer[0]
    t.ClearField("raw_data")
    t.float_data[:] = [1.0, 2.0]


def newer_opset(m):
    m.opset_import[0].version = 10**6


def opset_zero(m):
    m.opset_import[0].version = 0


def opset_twice(m):
    m.opset_import.append(helper.make_opsetid("ai.onnx", 13))  # the default domain's other spelling


def function_opset(m):
    m.functions.append(helper.make_function("local", "F", ["x"], ["y"], [helper.make_node("Relu", ["x"], ["y"])],
                                            [helper.make_opsetid("", 10**6)]))
    m.opset_import.append(helper.make_opsetid("local", 1))
    m.graph.node.append(helper.make_node("F", ["c"], ["d"], domain="local"))


def local_function(op_type: str, overload: str = "") -> onnx.FunctionProto:
    """local::F(x) = op_type(x), of the given overload."""
    function = helper.make_function("local", "F", ["x"], ["y"], [helper.make_node(op_type, ["x"], ["y"])],
                                    [helper.make_opsetid("", 17)])
    function.overload = overload
    return function


def function_defined_twice(m):
    m.functions.extend([local_function("Neg"), local_function("Abs")])  # which one would F(c) call?
    m.opset_import.append(helper.make_opsetid("local", 1))
    m.graph.node.append(helper.make_node("F", ["c"], ["d"], domain="local"))


def call_chain(m, names: list[str]) -> None:
    """local::names[0] calls names[1] ..., the last Relu; the main graph calls the first."""
    for name, callee in zip(names, names[1:] + ["Relu"]):
        body = helper.make_node(callee, ["x"], ["y"], domain="" if callee == "Relu" else "local")
        m.functions.append(helper.make_function("local", name, ["x"], ["y"], [body],
                                                [helper.make_opsetid("", 17), helper.make_opsetid("local", 1)]))
    m.opset_import.append(helper.make_opsetid("local", 1))
    m.graph.node.append(helper.make_node(names[0], ["c"], ["d"], domain="local"))


def functions_calling_each_other(m):
    """F -> G -> F: its expansion at trace had ended in a RecursionError (check=False)."""
    call_chain(m, ["F", "G"])
    m.functions[1].node[0].CopyFrom(helper.make_node("F", ["x"], ["y"], domain="local"))


def function_calls_too_deep(m):
    """A chain of 101 functions, which the checker passes: 200 had failed the first infer with a RecursionError."""
    call_chain(m, [f"F{i}" for i in range(101)])


def attribute_referring_outside_a_function(m):
    """onnx.checker passes it; the engine had dropped the attribute, so Softmax took its default axis."""
    m.graph.node.append(helper.make_node("Softmax", ["c"], ["s"], name="soft"))
    reference = onnx.AttributeProto(name="axis", ref_attr_name="ax", type=onnx.AttributeProto.INT)
    m.graph.node[-1].attribute.append(reference)


def concat_without_axis(m):
    m.graph.node.append(helper.make_node("Concat", ["c", "c"], ["d"], name="cat"))  # axis had defaulted to 1


def gemm_with_one_input(m):
    m.graph.node.append(helper.make_node("Gemm", ["c"], ["d"], name="gm"))  # had been gemm()'s TypeError


def castlike_with_one_input(m):
    m.graph.node.append(helper.make_node("CastLike", ["c"], ["d"], name="cl"))


def relu_with_two_inputs(m):
    m.graph.node.append(helper.make_node("Relu", ["c", "c"], ["d"], name="relu"))


def gemm_with_empty_b(m):
    m.graph.node.append(helper.make_node("Gemm", ["c", ""], ["d"], name="gm"))


def call_with_an_input_too_many(m):
    m.functions.append(local_function("Neg"))
    m.opset_import.append(helper.make_opsetid("local", 1))
    m.graph.node.append(helper.make_node("F", ["c", "a"], ["d"], domain="local", name="call"))  # 'a' was dropped


def non_utf8_string_attribute(m):
    m.graph.node.insert(0, helper.make_node("Constant", [], ["s"], value_string="x", name="const"))
    m.graph.node[0].attribute[0].s = b"\xff"


def non_utf8_string_tensor(m):
    t = helper.make_tensor("words", TensorProto.STRING, [1], [b"\xff"])
    m.graph.initializer.append(t)


def unknown_input_type(m):
    m.graph.input[0].type.tensor_type.elem_type = 99


def negative_input_dim(m):
    m.graph.input[0].type.tensor_type.shape.dim[1].dim_value = -3


def sparse_index_out_of_range(m):
    m.graph.sparse_initializer.append(helper.make_sparse_tensor(
        numpy_helper.from_array(np.ones(1, np.float32), "sp"), numpy_helper.from_array(np.array([7], np.int64)), [3]))


def sparse_too_large(m):
    m.graph.sparse_initializer.append(helper.make_sparse_tensor(
        numpy_helper.from_array(np.ones(1, np.float32), "sp"), numpy_helper.from_array(np.array([0], np.int64)),
        [2**40]))


def output_never_produced(m):
    m.graph.node[0].output[0] = "elsewhere"


def reads_a_later_value(m):
    m.graph.node.insert(0, helper.make_node("Relu", ["c"], ["r"]))


def function_output_never_produced(m):
    m.functions.append(helper.make_function("local", "F", ["x"], ["y"], [helper.make_node("Relu", ["x"], ["z"])],
                                            [helper.make_opsetid("", 17)]))
    m.opset_import.append(helper.make_opsetid("local", 1))
    m.graph.node.append(helper.make_node("F", ["c"], ["d"], domain="local"))


def subgraph_reads_an_unknown_value(m):
    branch = helper.make_graph([helper.make_node("Identity", ["ghost"], ["o"])], "branch", [],
                               [helper.make_tensor_value_info("o", TensorProto.FLOAT, None)])
    m.graph.initializer.append(numpy_helper.from_array(np.array(True), "flag"))
    m.graph.node.append(helper.make_node("If", ["flag"], ["i"], then_branch=branch, else_branch=branch))


def node_redefines_an_initializer(m):
    m.graph.node.append(helper.make_node("Relu", ["a"], ["b"]))


def training_graph_redefines_a_main_value(m):
    """The checker checks each graph alone: a training graph reusing a name of ModelProto.graph, whose values it
    sees, passed it, and the lowering read one of the two values."""
    info = m.training_info.add()
    info.algorithm.CopyFrom(helper.make_graph([helper.make_node("Relu", ["b"], ["c"])], "step", [],
                                              [helper.make_tensor_value_info("c", TensorProto.FLOAT, [3])]))


def initializer_twice(m):
    m.graph.initializer.append(numpy_helper.from_array(np.full(3, 2, np.float32), "b"))  # which b would be read?


def sparse_and_dense_initializer(m):
    m.graph.sparse_initializer.append(helper.make_sparse_tensor(
        numpy_helper.from_array(np.ones(1, np.float32), "b"), numpy_helper.from_array(np.array([0], np.int64)), [3]))


def input_twice(m):
    m.graph.input.append(helper.make_tensor_value_info("a", TensorProto.DOUBLE, ["N", 3]))


@pytest.mark.parametrize("break_it, message", [
    (initializer_twice, "graph 'add' has more than one initializer named 'b'"),
    (sparse_and_dense_initializer, "graph 'add' has more than one initializer named 'b'"),
    (input_twice, "graph 'add' has more than one input named 'a'"),
    (node_redefines_an_initializer, "node 'Relu' of graph 'add' defines 'b', which an input, an initializer"),
    (training_graph_redefines_a_main_value, "node 'Relu' of graph 'step' defines 'c', which .* defines already"),
    (output_never_produced, "graph 'add' returns 'c', which nothing in it or around it defines"),
    (reads_a_later_value, "node 'Relu' of graph 'add' reads 'c', which is not an input, an initializer or an output"),
    (function_output_never_produced, "function 'F' returns 'y', which none of its inputs or nodes defines"),
    (subgraph_reads_an_unknown_value, "node 'Identity' of graph 'branch' reads 'ghost'"),
])
def test_every_value_is_defined_before_it_is_read(break_it, message):
    model = add_model()
    break_it(model)
    with pytest.raises(ModelLoadError, match=message):
        onnxtrain.load(model, check=False)


def test_a_training_graph_redefining_a_main_value_is_refused_past_the_checker():
    model = add_model()
    training_graph_redefines_a_main_value(model)
    onnx.checker.check_model(model)  # which checks each graph alone
    with pytest.raises(ModelLoadError, match="node 'Relu' of graph 'step' defines 'c'"):
        onnxtrain.load(model)


def test_a_name_that_is_not_utf8_is_refused():
    """protobuf parses invalid UTF-8 in a string field (op_type here) as bytes instead of refusing it."""
    data = add_model().SerializeToString().replace(b"\x03Add", b"\x03\xffdd")
    with pytest.raises(ModelLoadError, match=r"model.graph.node\[0\].op_type is not valid UTF-8"):
        onnxtrain.load(data, check=False)


def test_a_string_inside_a_tensor_or_a_training_graph_that_is_not_utf8_is_refused():
    """The check reads only string and message fields (not a tensor's raw bytes), at any depth."""
    model = add_model()
    model.graph.initializer[0].doc_string = "Qdoc"
    info = model.training_info.add()
    info.algorithm.CopyFrom(helper.make_graph([helper.make_node("Identity", ["b"], ["b2"], name="Qnode")], "step",
                                              [], [helper.make_tensor_value_info("b2", TensorProto.FLOAT, [3])]))
    data = model.SerializeToString()
    for field, found in ((b"\x04Qdoc", r"model.graph.initializer\[0\].doc_string"),
                         (b"\x05Qnode", r"model.training_info\[0\].algorithm.node\[0\].name")):
        assert data.count(field) == 1
        with pytest.raises(ModelLoadError, match=f"{found} is not valid UTF-8"):
            onnxtrain.load(data.replace(field, field[:1] + b"\xff" + field[2:]), check=False)


def raw_and_typed_data(m):
    """The spec reads raw_data where it is set; the engine's zero-state path had read float_data instead."""
    m.graph.initializer[0].float_data[:] = [1.0, 2.0, 3.0]


def add_softmax(m):
    m.graph.node.append(helper.make_node("Softmax", ["c"], ["s"], axis=1, name="soft"))
    return m.graph.node[-1].attribute[0]


def int_attribute_set_as_float(m):
    axis = add_softmax(m)
    axis.ClearField("i")
    axis.f = 0.0  # read as the INT's field, i, this was the default 0, not an error


def floats_attribute_set_as_ints(m):
    m.graph.node.append(helper.make_node("Constant", [], ["k"], value_floats=[1.0], name="const"))
    value = m.graph.node[-1].attribute[0]
    del value.floats[:]
    value.ints[:] = [1]


def cast_to_no_type(m):
    m.graph.node.append(helper.make_node("Cast", ["c"], ["d"], to=99, name="cast"))  # had been a KeyError traced


def cast_to_undefined(m):
    m.graph.node.append(helper.make_node("Cast", ["c"], ["d"], to=TensorProto.UNDEFINED, name="cast"))


def eye_like_of_strings(m):
    m.graph.node.append(helper.make_node("EyeLike", ["c"], ["d"], dtype=TensorProto.STRING, name="eye"))


def random_normal_of_ints(m):
    m.graph.node.append(helper.make_node("RandomNormal", [], ["d"], shape=[2], dtype=TensorProto.INT64, name="rn"))


def layer_norm_stashed_in_no_type(m):
    m.graph.node.append(helper.make_node("LayerNormalization", ["c", "b"], ["d"], stash_type=-1, name="ln"))


@pytest.mark.parametrize("break_it, message", [
    (cast_to_no_type, "attribute 'to' of node 'cast' is 99, which is not a TensorProto data type"),
    (cast_to_undefined, "attribute 'to' of node 'cast' is 0, which is not a TensorProto data type"),
    (eye_like_of_strings, r"attribute 'dtype' of node 'eye' is STRING, which EyeLike-9's output 'output' cannot "
                          r"have \(it takes \['tensor\(bool\)', 'tensor\(double\)'"),
    (random_normal_of_ints, "attribute 'dtype' of node 'rn' is INT64, which RandomNormal-1's output 'output' cannot"),
    (layer_norm_stashed_in_no_type, "attribute 'stash_type' of node 'ln' is -1, which is not a TensorProto data type"),
    (raw_and_typed_data, "initializer 'b' holds values both in raw_data and in float_data"),
    (int_attribute_set_as_float, "attribute 'axis' of node 'soft' is of type INT but sets field 'f', not 'i'"),
    (floats_attribute_set_as_ints, "attribute 'value_floats' of node 'const' is of type FLOATS but sets field 'ints'"),
    (unknown_type, "initializer 'b' has unknown element type 99"),
    (short_raw_data, r"initializer 'b' has 8 bytes of raw_data where its dims \[3\] and type FLOAT need 12"),
    (huge_dims, r"initializer 'b' has 12 bytes of raw_data where its dims \[4611686018427387904\]"),
    (negative_dims, r"initializer 'b' has a negative dimension in \[-1\]"),
    (empty_with_a_huge_dim, r"initializer 'b' has dims \[0, 4611686018427387904\]: an empty tensor whose other "
                            "dimensions multiply past 2\\*\\*48"),
    (empty_constant_with_huge_dims, r"attribute 'value' of node 'const' has dims \[1099511627776, 1099511627776, 0\]"),
    (sparse_empty_with_a_huge_dim, r"sparse initializer 'sp' has dims \[0, 4611686018427387904\]: an empty tensor"),
    (segment, "initializer 'b' is a segment"),
    (too_few_floats, "initializer 'b' has 2 entries of float_data where its dims"),
    (newer_opset, "imports opset ai.onnx version 1000000, newer than the newest onnx"),
    (opset_zero, "imports opset ai.onnx version 0; versions start at 1"),
    (opset_twice, r"the model imports opset ai.onnx twice \(versions 17 and 13\)"),
    (function_opset, "function 'F' imports opset ai.onnx version 1000000"),
    (attribute_referring_outside_a_function, r"attribute 'axis' of node 'soft' refers to attribute 'ax' of a "
                                             r"calling function \(ref_attr_name\), but the node is not in a function"),
    (concat_without_axis, "attribute 'axis' of node 'cat' is required by Concat-13 but not set"),
    (gemm_with_one_input, r"node 'gm' has 1 inputs, but Gemm-13 takes 2 to 3"),
    (castlike_with_one_input, r"node 'cl' has 1 inputs, but CastLike-15 takes 2"),
    (relu_with_two_inputs, r"node 'relu' has 2 inputs, but Relu-14 takes 1"),
    (gemm_with_empty_b, r"input 1 \('B'\) of node 'gm' is required by Gemm-13 but left empty"),
    (call_with_an_input_too_many, "node 'call' passes 2 inputs to local function 'F', which declares 1"),
    (function_defined_twice, r"defines local function 'F' \(domain 'local'\) more than once"),
    (functions_calling_each_other, r"model-local functions call each other in a cycle \(local::F -> local::G -> "
                                   r"local::F\); a function may not call itself"),
    (function_calls_too_deep, r"model-local function 'F0' \(domain 'local'\) starts a chain of 101 nested function "
                              r"calls, more than 100"),
    (non_utf8_string_attribute, "attribute 'value_string' of node 'const' is not valid UTF-8"),
    (non_utf8_string_tensor, "a string of initializer 'words' is not valid UTF-8"),
    (unknown_input_type, "value 'a' has unknown element type 99"),
    (negative_input_dim, "value 'a' has a negative dimension"),
    (sparse_index_out_of_range, "sparse initializer 'sp': an index lies outside the 3 elements"),
    (sparse_too_large, r"sparse initializer 'sp': its dense form \[1099511627776\] would exceed"),
])
def test_malformed_model_is_one_model_load_error(break_it, message):
    """Without onnx.checker (check=False) the engine's own decoding must still refuse; the checker, where it runs
    first, may word it differently."""
    model = add_model()
    break_it(model)
    with pytest.raises(ModelLoadError, match=message):
        onnxtrain.load(model.SerializeToString(), check=False)
    with pytest.raises(ModelLoadError):
        onnxtrain.load(model.SerializeToString())


def test_a_data_type_attribute_of_an_allowed_type_or_its_default_runs():
    """The data-type check (DATA_TYPE_ATTRIBUTES) passes what the output may have, and a schema default given
    explicitly (QuantizeLinear's output_dtype 0, "not supplied")."""
    model = add_model()
    model.graph.node.extend([
        helper.make_node("EyeLike", ["c"], ["e"], dtype=TensorProto.INT32, k=1),
        helper.make_node("QuantizeLinear", ["c", "s"], ["q"], output_dtype=0),
    ])
    model.graph.initializer.append(numpy_helper.from_array(np.array(0.5, np.float32), "s"))
    model.graph.output.extend([helper.make_tensor_value_info("e", TensorProto.INT32, [3, 3]),
                               helper.make_tensor_value_info("q", TensorProto.UINT8, [3, 3])])
    model.opset_import[0].version = 21
    a = np.arange(9, dtype=np.float32).reshape(3, 3)
    result = onnxtrain.load(model).infer({"a": a})
    np.testing.assert_array_equal(result["e"], np.eye(3, k=1, dtype=np.int32))
    np.testing.assert_array_equal(result["q"], np.clip(np.round((a + 1) / 0.5), 0, 255).astype(np.uint8))


def test_one_opset_version_listed_twice_loads():
    """skl2onnx 1.20 lists ("", 22) twice in a LogisticRegression(zipmap=False) or LinearRegression export; the
    checker and ONNX Runtime take it (one version, no guess of which the nodes mean), and so does the engine. Two
    different versions stay refused (test_malformed_model_is_one_model_load_error)."""
    model = add_model()
    model.opset_import.extend([helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx", 17)])
    onnx.checker.check_model(model)
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(onnxtrain.load(model).infer({"a": a})["c"], a + 1)


def training_graph_attribute_of_another_type(m):
    info = training_graph_reading(m, "b")
    info.algorithm.node.append(helper.make_node("Softmax", ["b2"], ["s"], axis=0, name="soft"))
    info.algorithm.node[-1].attribute[0].type = onnx.AttributeProto.STRING


def training_softmax(m, **attributes) -> onnx.NodeProto:
    info = training_graph_reading(m, "b")
    info.algorithm.node.append(helper.make_node("Softmax", ["b2"], ["s"], name="soft", **attributes))
    return info.algorithm.node[-1]


def training_graph_string_axis(m):
    """A STRING axis had reached the lowering, whose JAX call read it as a named axis ("unbound axis name")."""
    training_softmax(m, axis="x")


def training_graph_unknown_attribute(m):
    training_softmax(m, temperature=2.0)  # had been a TypeError of the lowering when traced


def training_graph_attribute_twice(m):
    training_softmax(m, axis=0).attribute.append(helper.make_attribute("axis", -1))  # the last had been read


def training_graph_cast_to_no_type(m):
    """onnx.checker passes a Cast to 99 in any graph; the training graph's had failed at the first step."""
    info = training_graph_reading(m, "b")
    info.algorithm.node.append(helper.make_node("Cast", ["b2"], ["s"], to=99, name="cast"))


def initialization_random_of_strings(m):
    info = training_graph_reading(m, "b")
    info.initialization.CopyFrom(helper.make_graph(
        [helper.make_node("RandomUniform", [], ["r"], shape=[3], dtype=TensorProto.STRING, name="init")], "init", [],
        [helper.make_tensor_value_info("r", TensorProto.FLOAT, [3])]))


def ir_version_before_training(m):
    training_graph_reading(m, "b")
    m.ir_version = 6


def training_graph_reading(m, name):
    info = m.training_info.add()
    info.algorithm.CopyFrom(helper.make_graph([helper.make_node("Identity", [name], ["b2"])], "step", [],
                                              [helper.make_tensor_value_info("b2", TensorProto.FLOAT, [3])]))
    return info


@pytest.mark.parametrize("break_it, message", [
    (training_graph_attribute_of_another_type, "attribute 'axis' of node 'soft' is of type STRING but sets field 'i'"),
    (ir_version_before_training, "training_info but declares ir_version 6; TrainingInfoProto exists from IR version 7"),
    (training_graph_string_axis, "attribute 'axis' of node 'soft' is of type STRING, but Softmax-13 takes INT"),
    (training_graph_unknown_attribute, r"attribute 'temperature' of node 'soft' is not one Softmax-13 has \(it has "
                                       r"\['axis'\]\)"),
    (training_graph_attribute_twice, "attribute 'axis' of node 'soft' is given 2 times; an attribute is set once"),
    (training_graph_cast_to_no_type, "attribute 'to' of node 'cast' is 99, which is not a TensorProto data type"),
    (initialization_random_of_strings, "attribute 'dtype' of node 'init' is STRING, which RandomUniform-1's output"),
])
@pytest.mark.parametrize("check", [True, False])
def test_what_the_checker_passes_in_a_training_model_is_refused(break_it, message, check):
    """onnx.checker looks neither inside the training graphs nor at the IR version training_info needs."""
    model = add_model()
    break_it(model)
    onnx.checker.check_model(model)
    with pytest.raises(ModelLoadError, match=message):
        onnxtrain.load(model.SerializeToString(), check=check)


def test_a_zero_state_variable_holding_typed_values_too_is_refused():
    """load drops the bytes of an all-zero state variable (export.without_zero_state); its float_data, left
    behind, was then read as its value instead of the raw_data the spec reads."""
    from training_models import linear_regression
    model = linear_regression(np.zeros((2, 1), np.float32), np.zeros(1, np.float32), 0.1)
    model.graph.initializer[0].float_data[:] = [5.0, 6.0]
    with pytest.raises(ModelLoadError, match="initializer 'W' holds values both in raw_data and in float_data"):
        onnxtrain.load(model.SerializeToString(), check=False)


@pytest.mark.parametrize("overload, expected", [("neg", [[1, -2, 3]]), ("abs", [[1, 2, 3]])])
def test_a_node_calls_the_local_function_of_its_overload(overload, expected):
    """Functions of one (domain, name) differing by overload (IR version 10) are distinct: each node calls the one
    its `overload` names, not the last of them."""
    model = add_model()
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.zeros(3, np.float32), "b"))
    model.functions.extend([local_function("Neg", "neg"), local_function("Abs", "abs")])
    model.opset_import.append(helper.make_opsetid("local", 1))
    model.graph.node.append(helper.make_node("F", ["c"], ["d"], domain="local", overload=overload))
    model.graph.output[0].name = "d"
    model.ir_version = 10
    engine = onnxtrain.load(model)
    np.testing.assert_array_equal(engine.infer({"a": np.array([[-1, 2, -3]], np.float32)})["d"], expected)


def test_a_required_attribute_a_function_body_references_is_the_callers():
    """A body node's required attribute given by reference (ref_attr_name) is set by each call, not missing."""
    model = add_model()
    concat = helper.make_node("Concat", ["x", "x"], ["y"])
    concat.attribute.append(onnx.AttributeProto(name="axis", ref_attr_name="ax", type=onnx.AttributeProto.INT))
    function = helper.make_function("local", "Twice", ["x"], ["y"], [concat], [helper.make_opsetid("", 17)],
                                    attributes=["ax"])
    model.functions.append(function)
    model.opset_import.append(helper.make_opsetid("local", 1))
    model.graph.node.append(helper.make_node("Twice", ["c"], ["d"], domain="local", ax=0))
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("d", TensorProto.FLOAT, ["2N", 3]))
    a = np.array([[1, 2, 3]], np.float32)
    np.testing.assert_array_equal(onnxtrain.load(model).infer({"a": a})["d"], np.concatenate([a + 1, a + 1], 0))


def test_a_call_leaving_out_an_input_its_body_needs_names_it():
    """A call may pass fewer inputs than its function declares (the rest are absent); a body node that requires
    one of those had been called with None: a TypeError from its lowering."""
    model = add_model()
    add = helper.make_node("Add", ["x", "y"], ["z"])
    model.functions.append(helper.make_function("local", "G", ["x", "y"], ["z"], [add], [helper.make_opsetid("", 17)]))
    model.opset_import.append(helper.make_opsetid("local", 1))
    model.graph.node.append(helper.make_node("G", ["c"], ["d"], domain="local", name="call"))
    model.graph.output[0].name = "d"
    engine = onnxtrain.load(model)
    with pytest.raises(NodeError, match=r"Add: input 1 \('B'\) of Add-14 is required, but 'y' has no value"):
        engine.infer({"a": np.ones((1, 3), np.float32)})


def test_batchnorm_1_without_its_required_in_place_hint_runs():
    """consumed_inputs, which BatchNormalization-1 requires, is a hint the lowering drops: its absence is no guess."""
    x = np.array([[1, 2], [3, 4]], np.float32)
    stats = {"s": [1, 2], "b": [0, 1], "m": [1, 0], "v": [4, 1]}
    graph = helper.make_graph(
        [helper.make_node("BatchNormalization", ["x", *stats], ["y"], is_test=1)], "bn1",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])], [helper.make_empty_tensor_value_info("y")],
        [numpy_helper.from_array(np.array(v, np.float32), k) for k, v in stats.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 1)], ir_version=3)
    s, b, m, v = (np.array(stats[k], np.float32) for k in stats)
    np.testing.assert_allclose(onnxtrain.load(model, check=False).infer({"x": x})["y"],
                               (x - m) / np.sqrt(v + 1e-5) * s + b, rtol=1e-6)
