"""Bad input gets an onnxtrain.errors exception that names the offending thing."""

from __future__ import annotations

import io
import warnings

import jax
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import onnxtrain
from onnxtrain.errors import ExternalDataError, FeedError, ModelLoadError, UnsupportedOpError
from onnxtrain.feeds import to_array
from onnxtrain.ir import ValueInfo


def add_model() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["c"])],
        "add",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N", 3]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, ["N", 3])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_truncated_file(tmp_path):
    data = add_model().SerializeToString()
    path = tmp_path / "cut.onnx"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="cut.onnx"):
        onnxtrain.load(path)


def test_not_an_onnx_file(tmp_path):
    path = tmp_path / "notes.onnx"
    path.write_text("these are not the weights you are looking for")
    with pytest.raises(ModelLoadError, match="notes.onnx.*not an ONNX model"):
        onnxtrain.load(path)


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="nowhere.onnx"):
        onnxtrain.load(tmp_path / "nowhere.onnx")


def test_unknown_ops_are_reported_all_at_once():
    model = add_model()
    model.graph.node.append(helper.make_node("FancyOp", ["c"], ["d"], domain="my.domain"))
    model.graph.node.append(helper.make_node("OtherOp", ["d"], ["e"], domain="my.domain"))
    model.opset_import.append(helper.make_opsetid("my.domain", 3))
    with pytest.raises(UnsupportedOpError) as info:
        onnxtrain.load(model, check=False)
    assert "my.domain::FancyOp (opset 3)" in str(info.value)
    assert "my.domain::OtherOp (opset 3)" in str(info.value)


def test_an_op_of_a_domain_the_model_does_not_import_says_so():
    """Listed as "(opset -1)", Add read as an operator the engine lacks, not as a model without opset_import."""
    model = add_model()
    del model.opset_import[:]
    model.graph.node.append(helper.make_node("FancyOp", ["c"], ["d"], domain="my.domain"))
    with pytest.raises(UnsupportedOpError) as info:
        onnxtrain.load(model, check=False)
    assert str(info.value).splitlines()[1:] == [
        "  ai.onnx::Add (its domain is not in the model's opset_import)",
        "  my.domain::FancyOp (its domain is not in the model's opset_import)"]


def test_aten_fallback_ops_are_named_with_the_export_option():
    """operator_export_type=ONNX_ATEN_FALLBACK writes each PyTorch operator without an ONNX form as an
    org.pytorch.aten::ATen node named by its `operator` attribute: the error names that operator and the option,
    where it had listed "org.pytorch.aten::ATen (opset 1)" alone."""
    torch = pytest.importorskip("torch")

    class Attend(torch.nn.Module):
        def forward(self, q):
            return torch.nn.functional.scaled_dot_product_attention(q, q, q)

    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Attend(), (torch.zeros(1, 2, 3, 4),), f, dynamo=False, opset_version=13,
                          operator_export_type=torch.onnx.OperatorExportTypes.ONNX_ATEN_FALLBACK)
    with pytest.raises(UnsupportedOpError, match=r"org.pytorch.aten::ATen\('scaled_dot_product_attention'\) "
                       r"\(opset 1\)\n.*ONNX_ATEN_FALLBACK.*default operator_export_type"):
        onnxtrain.load(f.getvalue())


class Unconvertible:
    """An object whose conversion to an array raises what it likes, as a torch tensor that requires grad does."""

    def __array__(self, *args, **kwargs):
        raise RuntimeError("no numbers here")


FEEDS_OK = {"a": np.ones((2, 3), np.float32), "b": np.ones((2, 3), np.float32)}


@pytest.mark.parametrize(
    "feeds, message",
    [
        ({"a": FEEDS_OK["a"]}, r"missing feed\(s\) \['b'\]"),
        ({**FEEDS_OK, "bogus": FEEDS_OK["a"]}, r"unknown feed name\(s\) \['bogus'\]"),
        ({**FEEDS_OK, "b": np.ones((2, 3), np.int64)}, "feed 'b': expected dtype float, got int64"),
        ({**FEEDS_OK, "b": np.ones((2, 3, 1), np.float32)}, "feed 'b': expected rank 2"),
        ({**FEEDS_OK, "b": np.ones((2, 4), np.float32)}, "feed 'b': dimension 1 must be 3 .* got 4: the model "
         "fixes that size .* dynamic_shapes="),
        ({**FEEDS_OK, "b": np.ones((5, 3), np.float32)}, "feed 'b': dimension 0 \\('N'\\) is 5, but 'a' dimension 0"),
        # nested lists are one tensor, not the ONNX sequence a list feeds elsewhere, checked as any other
        ({**FEEDS_OK, "b": [[1.0] * 3]}, "feed 'b': dimension 0 \\('N'\\) is 1, but 'a' dimension 0"),
        ({**FEEDS_OK, "b": [[1] * 3, [1] * 2]}, "feed 'b': cannot convert list to an array"),
        ({**FEEDS_OK, "b": Unconvertible()}, "feed 'b': cannot convert Unconvertible to an array \\(no numbers"),
        ({**FEEDS_OK, "b": None}, "feed 'b' is None, which only an optional-typed input takes"),
    ],
)
def test_bad_feeds(feeds, message):
    engine = onnxtrain.load(add_model())
    with pytest.raises(FeedError, match=message):
        engine.infer(feeds)


def test_a_torch_bfloat16_tensor_feeds_a_bfloat16_input():
    """NumPy has no bfloat16, so torch's tensor cannot become a NumPy array; JAX reads it through DLPack. One that
    requires grad is still refused, with torch's own advice (detach)."""
    torch = pytest.importorskip("torch")
    graph = helper.make_graph([helper.make_node("Mul", ["x", "x"], ["y"])], "square",
                              [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [2, 3])])
    engine = onnxtrain.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    x = torch.linspace(-2, 2, 6).reshape(2, 3).to(torch.bfloat16)
    y = np.asarray(engine.infer({"x": x})["y"]).astype(np.float32)
    np.testing.assert_array_equal(y, (x * x).float().numpy())  # bfloat16 products, rounded alike
    # DLPack shares the tensor's memory (the pointers agree); the feed is a copy, so a loop refilling its one
    # buffer cannot change a step's input while the step runs
    assert jax.dlpack.from_dlpack(x).unsafe_buffer_pointer() == x.data_ptr()
    info = ValueInfo("x", TensorProto.BFLOAT16, (2, 3), graph.input[0].type)
    assert to_array("x", x, info).unsafe_buffer_pointer() != x.data_ptr()
    with pytest.raises(FeedError, match=r"feed 'x': cannot convert Tensor to an array \(.*detach"):
        engine.infer({"x": x.float().requires_grad_().to(torch.bfloat16)})


def test_a_traced_feed_is_refused_pointing_to_jax_function():
    """infer inside jax.jit met JAX's TypeError from the compiled program, even for a signature checked before."""
    engine = onnxtrain.load(add_model())
    engine.infer(FEEDS_OK)  # the signature is known: its check is skipped for arrays, not for traced values
    with pytest.raises(FeedError, match="feed 'a' is a value JAX is tracing .* Engine.jax_function"):
        jax.jit(lambda a: engine.infer({**FEEDS_OK, "a": a}))(FEEDS_OK["a"])


def sequence_and_optional_model() -> onnx.ModelProto:
    """y = ConcatFromSequence(s) for s: seq(float[k]); has = OptionalHasElement(o) for o: optional(float[2])."""
    optional = helper.make_value_info("o", helper.make_optional_type_proto(
        helper.make_tensor_type_proto(TensorProto.FLOAT, [2])))
    graph = helper.make_graph(
        [helper.make_node("ConcatFromSequence", ["s"], ["y"], axis=0),
         helper.make_node("OptionalHasElement", ["o"], ["has"])], "g",
        [helper.make_tensor_sequence_value_info("s", TensorProto.FLOAT, ["k"]), optional],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m"]),
         helper.make_tensor_value_info("has", TensorProto.BOOL, [])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


ONE = np.ones(2, np.float32)


@pytest.mark.parametrize("feeds, message", [
    ({"s": [ONE, ONE.astype(np.int64)], "o": ONE}, r"feed 's\[1\]': expected dtype float, got int64"),
    ({"s": [ONE.reshape(1, 2)], "o": ONE}, r"feed 's\[0\]': expected rank 1 \(shape \[k\]\), got rank 2"),
    ({"s": ONE, "o": ONE}, "feed 's' is a sequence input: feed a list of tensors, not ndarray"),
    ({"s": None, "o": ONE}, "feed 's' is None, which only an optional-typed input takes"),
    ({"s": [ONE], "o": ONE.astype(np.float64)}, "feed 'o': expected dtype float, got double"),
    ({"s": [ONE], "o": np.ones(3, np.float32)}, "feed 'o': dimension 0 must be 2"),
])
def test_sequence_elements_and_optional_values_are_checked_against_their_declared_types(feeds, message):
    """Unchecked, an int64 element of a float sequence computed an int64 result that the graph declares float."""
    engine = onnxtrain.load(sequence_and_optional_model())
    with pytest.raises(FeedError, match=message):
        engine.infer(feeds)


def test_sequence_elements_and_optional_values_that_match_are_computed():
    engine = onnxtrain.load(sequence_and_optional_model())
    out = engine.infer({"s": [ONE, [2.0, 3.0, 4.0]], "o": None})  # elements differ in length: each has its own k
    np.testing.assert_array_equal(np.asarray(out["y"]), np.array([1, 1, 2, 3, 4], np.float32))
    assert np.asarray(out["y"]).dtype == np.float32 and not bool(out["has"])
    assert bool(engine.infer({"s": [ONE], "o": [5.0, 6.0]})["has"])


def map_model(key_type: int, vocabulary: dict[str, list]) -> onnx.ModelProto:
    """y = DictVectorizer(m) for m: map(key_type, float)."""
    graph = helper.make_graph(
        [helper.make_node("DictVectorizer", ["m"], ["y"], domain="ai.onnx.ml", **vocabulary)], "g",
        [helper.make_value_info("m", helper.make_map_type_proto(
            key_type, helper.make_tensor_type_proto(TensorProto.FLOAT, [])))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 3)])


STRING_KEYS = (TensorProto.STRING, {"string_vocabulary": ["a", "b", "c"]})
INT_KEYS = (TensorProto.INT64, {"int64_vocabulary": [7, 8, 9]})


@pytest.mark.parametrize("model, feed, message", [
    (STRING_KEYS, [1.0, 2.0], r"feed 'm' is a map input: feed a dict \{key: value\}, not list"),
    (STRING_KEYS, None, "feed 'm' is a map input: feed a dict"),
    (STRING_KEYS, {1: 2.0}, "feed 'm': key 1 is not of the map's key type string"),
    (INT_KEYS, {"7": 2.0}, "feed 'm': key '7' is not of the map's key type int64"),
    (INT_KEYS, {True: 2.0}, "feed 'm': key True is not of the map's key type int64"),
    (INT_KEYS, {2**63: 2.0}, "key 9223372036854775808 is not of the map's key type int64"),
    (STRING_KEYS, {"a": "x"}, r"feed \"m\['a'\]\": expected dtype float"),
    (STRING_KEYS, {"a": [1.0, 2.0]}, r"feed \"m\['a'\]\": expected rank 0"),
    (STRING_KEYS, {"a": np.float64(1.0)}, r"feed \"m\['a'\]\": expected dtype float, got double"),
    (STRING_KEYS, {"a": None}, r"feed \"m\['a'\]\" is None"),
])
def test_map_feeds_are_checked_against_their_declared_key_and_value_types(model, feed, message):
    """Unchecked, a map with int keys for string ones vectorized to zeros, a string value came out as a string
    tensor the graph declares float, and None became NaN."""
    engine = onnxtrain.load(map_model(*model))
    with pytest.raises(FeedError, match=message):
        engine.infer({"m": feed})


def test_map_feeds_that_match_are_computed():
    """Python numbers take the declared value type; NumPy integer keys are int64 keys."""
    out = onnxtrain.load(map_model(*STRING_KEYS)).infer({"m": {"a": 1, "c": 2.5}})
    np.testing.assert_array_equal(np.asarray(out["y"]), np.array([[1, 0, 2.5]], np.float32))
    assert np.asarray(out["y"]).dtype == np.float32
    out = onnxtrain.load(map_model(*INT_KEYS)).infer({"m": {np.int64(9): np.float32(4), 7: -1.0}})
    np.testing.assert_array_equal(np.asarray(out["y"]), np.array([[-1, 0, 4]], np.float32))


def test_a_sequence_of_strings_is_fed():
    """A host-only sequence (of string tensors) had reached the trace and failed with JAX's TypeError."""
    graph = helper.make_graph(
        [helper.make_node("SequenceAt", ["s", "p"], ["y"])], "g",
        [helper.make_tensor_sequence_value_info("s", TensorProto.STRING, ["n"]),
         helper.make_tensor_value_info("p", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("y", TensorProto.STRING, ["n"])])
    engine = onnxtrain.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    with pytest.warns(UserWarning, match="compiled in as constants"):  # the position, beside a host sequence
        out = engine.infer({"s": [np.array(["a", "b"], dtype=object), np.array(["c"], dtype=object)],
                            "p": np.int64(1)})
    np.testing.assert_array_equal(out["y"], np.array(["c"], dtype=object))


def test_external_data_outside_the_model_folder_is_refused(tmp_path):
    model = add_model()
    weight = onnx.numpy_helper.from_array(np.ones((2, 3), np.float32), "b")
    weight.data_location = TensorProto.EXTERNAL
    entry = weight.external_data.add()
    entry.key, entry.value = "location", "../secret.bin"
    weight.ClearField("raw_data")
    model.graph.initializer.append(weight)
    folder = tmp_path / "model"
    folder.mkdir()
    (tmp_path / "secret.bin").write_bytes(np.ones((2, 3), np.float32).tobytes())
    (folder / "m.onnx").write_bytes(model.SerializeToString())
    with pytest.raises(ExternalDataError, match="'../secret.bin' is outside the model's folder"):
        onnxtrain.load(folder / "m.onnx")


def test_compiles_once_per_input_signature():
    engine = onnxtrain.load(add_model())
    for n in (2, 2, 5, 2, 5):
        feeds = {"a": np.ones((n, 3), np.float32), "b": np.ones((n, 3), np.float32)}
        np.testing.assert_array_equal(np.asarray(engine.infer(feeds)["c"]), np.full((n, 3), 2.0))
    assert engine.trace_count == 2


def test_initializer_that_is_also_an_input_is_an_overridable_default():
    from onnx import numpy_helper

    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "scale"], ["y"])],
        "scaled",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
         helper.make_tensor_value_info("scale", TensorProto.FLOAT, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        [numpy_helper.from_array(np.float32(3.0), "scale")],
    )
    engine = onnxtrain.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    x = np.array([1.0, 2.0], np.float32)
    assert engine.input_names == ["x"]
    np.testing.assert_array_equal(np.asarray(engine.infer({"x": x})["y"]), [3.0, 6.0])
    np.testing.assert_array_equal(np.asarray(engine.infer({"x": x, "scale": np.float32(-1)})["y"]), [-1.0, -2.0])


def test_node_binds_to_the_highest_version_not_above_the_model_opset():
    """Softmax-11 flattens to 2-D at axis; Softmax-13 works along one axis: same node, different results."""
    x = np.arange(6, dtype=np.float32).reshape(1, 2, 3)
    results = {}
    for opset in (11, 13):
        graph = helper.make_graph([helper.make_node("Softmax", ["x"], ["y"], axis=1)], "s",
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 3])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 3])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        results[opset] = np.asarray(onnxtrain.load(model).infer({"x": x})["y"])
    flat = np.exp(x.reshape(1, 6)) / np.exp(x.reshape(1, 6)).sum()
    np.testing.assert_allclose(results[11], flat.reshape(1, 2, 3), rtol=1e-6)
    np.testing.assert_allclose(results[13], np.exp(x) / np.exp(x).sum(axis=1, keepdims=True), rtol=1e-6)


def test_engine_repr_summarises_the_model():
    engine = onnxtrain.load(add_model())
    assert repr(engine) == "<onnxtrain.Engine inputs=['a', 'b'] outputs=['c'] state=0 variables (0 values) " \
                           "algorithms=0 step=0>"
