"""ai.onnx.ml: every op against ONNX's reference evaluator; against ONNX Runtime where the reference has no
implementation (CategoryMapper, CastMap, ZipMap, LabelEncoder 1) or departs from the spec and ONNX Runtime
(noted at each test); against NumPy written here where both do."""

from __future__ import annotations

import math

import jax
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from nodes import node_model, run_both
from onnxtrain.errors import NodeError
from onnxtrain.lower.ops import ml
from onnxtrain.lower.registry import ML_DOMAIN, lookup, versions

# Strings only exist on the host: an op producing them from numbers compiles its numeric feed in (a warning).
pytestmark = pytest.mark.filterwarnings("ignore:.*compiled in as constants:UserWarning")


def normal(seed: int, size: tuple) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=size)


def latest(op_type: str) -> int:
    return versions(op_type, domain=ML_DOMAIN)[-1]


def ml_model(op_type: str, inputs: dict, n_outputs: int = 1, opset: int | None = None, **attrs) -> onnx.ModelProto:
    return node_model(op_type, inputs, n_outputs, opset=opset or latest(op_type), domain=ML_DOMAIN, **attrs)


def ours(op_type: str, inputs: dict, n_outputs: int = 1, opset: int | None = None, **attrs) -> list:
    engine = onnxtrain.load(ml_model(op_type, inputs, n_outputs, opset, **attrs), check=False)
    outputs = engine.infer(inputs)
    return [outputs[name] for name in engine.output_names]


def assert_same(mine, ref, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    mine, ref = np.asarray(mine), np.asarray(ref)
    assert mine.shape == ref.shape, (mine.shape, ref.shape)
    if ref.dtype.kind in "OUS":
        assert mine.tolist() == ref.astype(object).tolist()
    else:
        np.testing.assert_allclose(mine.astype(np.float64), ref.astype(np.float64), rtol=rtol, atol=atol)


def check(op_type: str, inputs: dict, n_outputs: int = 1, opset: int | None = None, dtypes=None, rtol=1e-5, atol=1e-6,
          **attrs) -> list:
    """Ours against the reference evaluator; `dtypes` are the spec's output dtypes (default: the reference's)."""
    mine, ref = run_both(ml_model(op_type, inputs, n_outputs, opset, **attrs), inputs)
    for i, (a, b) in enumerate(zip(mine, ref)):
        assert_same(a, b, rtol, atol)
        want = np.dtype(dtypes[i]) if dtypes else b.dtype
        assert a.dtype == want or (want.kind in "OUS" and a.dtype == object), (i, a.dtype, want)
    return mine


def tensor(name: str, values) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(values), name)


def onnxruntime(model: onnx.ModelProto, feeds: dict) -> list:
    ort = pytest.importorskip("onnxruntime")
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def check_ort(op_type: str, inputs: dict, n_outputs: int = 1, opset: int | None = None, rtol=1e-5, atol=1e-6,
              **attrs) -> list:
    """Ours against ONNX Runtime, dtypes included."""
    model = ml_model(op_type, inputs, n_outputs, opset, **attrs)
    mine = ours(op_type, inputs, n_outputs, opset, **attrs)
    for a, b in zip(mine, onnxruntime(model, inputs)):
        assert_same(a, b, rtol, atol)
        assert np.asarray(a).dtype == np.asarray(b).dtype
    return mine


def map_model(op_type: str, key: int, value: int, **attrs) -> onnx.ModelProto:
    """One node whose input is a map(key, value)."""
    map_type = helper.make_map_type_proto(key, helper.make_tensor_type_proto(value, None))
    node = helper.make_node(op_type, ["x"], ["y"], domain=ML_DOMAIN, **attrs)
    graph = helper.make_graph([node], "g", [helper.make_value_info("x", map_type)],
                              [helper.make_empty_tensor_value_info("y")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid(ML_DOMAIN, 1), helper.make_opsetid("", 21)])


def test_every_schema_version_is_registered():
    for schema in onnx.defs.get_all_schemas_with_history():
        if schema.domain == ML_DOMAIN:
            assert lookup(ML_DOMAIN, schema.name, schema.since_version), (schema.name, schema.since_version)


# ---- elementwise preprocessing -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float64, np.int64, np.int32])
def test_binarizer_keeps_dtype(dtype):
    x = np.array([[-2, 0, 1], [3, 1, 5]], dtype)
    check("Binarizer", {"x": x}, threshold=1.0)


def test_scaler_per_feature_and_float_output():
    x = normal(1, (4, 3)).astype(np.float32)
    check("Scaler", {"x": x}, dtypes=[np.float32], offset=[0.5, -1.0, 2.0], scale=[2.0, 0.5, -1.0])
    ints = np.array([[1, 2], [3, 4]], np.int64)  # the spec's output is float for any input (the reference's is int)
    (got,) = ours("Scaler", {"x": ints}, offset=[0.5], scale=[3.0])
    np.testing.assert_array_equal(got, ((ints - 0.5) * 3).astype(np.float32))
    assert got.dtype == np.float32


@pytest.mark.parametrize("norm", ["L1", "L2"])
def test_normalizer_l1_l2(norm):
    x = np.array([[1.0, -3.0, 2.0], [0.0, 0.0, 0.0], [-0.5, 4.0, 1.0]], np.float64)
    check("Normalizer", {"x": x}, dtypes=[np.float32], norm=norm)


def test_normalizer_max_divides_by_max_as_specified():
    # The spec (and ONNX Runtime) divide by max(X); ONNX's reference divides by max(|X|) (onnx/onnx#8452).
    x = np.array([[1.0, -4.0, 2.0], [0.0, 0.0, 0.0], [-1.0, -2.0, 0.0]], np.float32)
    (got,) = check_ort("Normalizer", {"x": x}, norm="MAX")
    np.testing.assert_allclose(got, [[0.5, -2.0, 1.0], [0.0, 0.0, 0.0], [-1.0, -2.0, 0.0]])  # zero divisor: Y = X


def test_imputer_nan_per_feature_and_int_value():
    x = np.array([[np.nan, 1.0, 2.0], [3.0, np.nan, np.nan]], np.float32)
    check("Imputer", {"x": x}, imputed_value_floats=[-1.0, -2.0, -3.0], replaced_value_float=math.nan)
    ints = np.array([[-1, 5], [7, -1]], np.int64)
    check("Imputer", {"x": ints}, imputed_value_int64s=[99], replaced_value_int64=-1)


# ---- feature selection and assembly --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("x", "indices"),
    [
        (np.arange(24, dtype=np.float32).reshape(2, 3, 4), np.array([3, 0, 3])),
        (np.arange(5, dtype=np.int64), np.array([[4, 1]])),  # a 1-D input is one row: [1, 2]
        (np.array([["a", "b", "c"], ["d", "e", "f"]], object), np.array([2, 0])),
    ],
)
def test_array_feature_extractor(x, indices):
    check("ArrayFeatureExtractor", {"x": x, "y": indices.astype(np.int64)})


def test_array_feature_extractor_traced_indices_compile_once_and_range_check():
    x = np.arange(6.0).reshape(2, 3)
    engine = onnxtrain.load(ml_model("ArrayFeatureExtractor", {"x": x, "y": np.zeros(2, np.int64)}), check=False)
    for indices in ([2, 0], [1, 1]):
        got = engine.infer({"x": x, "y": np.array(indices)})["out0"]
        np.testing.assert_array_equal(got, x[:, indices])
    assert engine.trace_count == 1
    with jax.enable_x64(True), pytest.raises(IndexError, match="out of range"):
        ml.array_feature_extractor(x, np.array([3]))


def test_feature_vectorizer_cuts_pads_and_casts():
    # The spec (and ONNX Runtime) read a 1-D input as [1, C]; ONNX's reference reads it as [C, 1].
    a = np.array([[1, 2, 3], [4, 5, 6]], np.float64)  # the schema: all inputs of one element type
    b = np.array([[0.5], [1.5]], np.float64)
    (got,) = ours("FeatureVectorizer", {"a": a, "b": b}, inputdimensions=[2, 3])
    np.testing.assert_array_equal(got, [[1, 2, 0.5, 0, 0], [4, 5, 1.5, 0, 0]])
    assert got.dtype == np.float32
    (row,) = ours("FeatureVectorizer", {"v": np.array([7.0, 8.0], np.float32)})
    np.testing.assert_array_equal(row, [[7, 8]])


# ---- encoders ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("x", "attrs"),
    [
        (np.array(["b", "z", "a"], object), {"keys_strings": ["a", "b"], "values_int64s": [4, 5]}),
        (np.array([[1, 7], [2, 1]], np.int64), {"keys_int64s": [1, 2], "values_strings": ["x", "y"]}),
        (np.array([0.5, 2.0, -1.0], np.float32), {"keys_floats": [2.0, 0.5], "values_floats": [20.0, 5.0],
                                                  "default_float": 9.0}),
        (np.array([3, 1, 4], np.int64), {"keys_int64s": [4, 3], "values_floats": [0.25, 0.5]}),
    ],
)
def test_label_encoder_v2_v4(x, attrs):
    for opset in (2, 4):
        check("LabelEncoder", {"x": x}, opset=opset, **attrs)


def test_label_encoder_v4_tensors_traced_int16():
    x = np.array([[5, -3], [9, 5]], np.int32)
    attrs = {"keys_tensor": tensor("k", np.array([5, 9], np.int32)),
             "values_tensor": tensor("v", np.array([1, 2], np.int16)),
             "default_tensor": tensor("d", np.array([-7], np.int16))}
    engine = onnxtrain.load(ml_model("LabelEncoder", {"x": x}, **attrs), check=False)
    for feed in (x, np.array([[9, 9], [0, 5]], np.int32)):
        got = engine.infer({"x": feed})["out0"]
        assert got.dtype == np.int16
        np.testing.assert_array_equal(got, np.select([feed == 5, feed == 9], [1, 2], -7))
    assert engine.trace_count == 1


def test_label_encoder_v4_nan_key_and_last_duplicate_wins():
    # Spec: a NaN key matches any NaN input and a repeated key's last value wins (the reference misses NaNs,
    # ONNX Runtime keeps a repeated key's first value).
    x = np.array([np.nan, 1.0, 2.0, -np.nan], np.float32)
    (got,) = ours("LabelEncoder", {"x": x}, keys_floats=[1.0, math.nan, 1.0], values_int64s=[10, 20, 30])
    np.testing.assert_array_equal(got, [20, 30, -1, 20])


def test_label_encoder_traced_int_to_string_is_compiled_per_value():
    model = ml_model("LabelEncoder", {"x": np.zeros(2, np.int64)}, keys_int64s=[1, 2], values_strings=["a", "b"])
    engine = onnxtrain.load(model, check=False)
    with pytest.warns(UserWarning, match="compiled in as constants"):
        assert engine.infer({"x": np.array([2, 3])})["out0"].tolist() == ["b", "_Unused"]
    assert engine.infer({"x": np.array([1, 1])})["out0"].tolist() == ["a", "a"]


@pytest.mark.parametrize(
    ("x", "default"), [(np.array(["b", "q", "a"], object), {"default_int64": -5}),
                       (np.array([[2, 7], [0, 1]], np.int64), {"default_string": "?"})]
)
def test_label_encoder_v1_both_directions(x, default):
    check_ort("LabelEncoder", {"x": x}, opset=1, classes_strings=["a", "b", "a"], **default)


@pytest.mark.parametrize("x", [np.array([["dog", "eel"], ["cat", "cat"]], object), np.array([8, 1, 3], np.int64)])
def test_category_mapper_both_directions(x):
    check_ort("CategoryMapper", {"x": x}, cats_int64s=[3, 8], cats_strings=["cat", "dog"], default_int64=-9,
              default_string="?")


@pytest.mark.parametrize(
    ("x", "attrs"),
    [
        (np.array([["a", "c"], ["b", "z"]], object), {"cats_strings": ["a", "b", "c"]}),
        (np.array([[1, 5], [3, 1]], np.int64), {"cats_int64s": [5, 1, 3, 9]}),
        (np.array([3.0, 1.0], np.float64), {"cats_int64s": [1, 3]}),
    ],
)
def test_one_hot_encoder(x, attrs):
    check("OneHotEncoder", {"x": x}, dtypes=[np.float32], **attrs)


def test_one_hot_encoder_unknown_category_with_zeros_0_is_an_error():
    with jax.enable_x64(True), pytest.raises(ValueError, match="not among the categories"):
        ml.one_hot_encoder(np.array([1, 4], np.int64), cats_int64s=[1, 2], zeros=0)
    with pytest.raises(NodeError, match="not among the categories"):
        ours("OneHotEncoder", {"x": np.array(["x"], object)}, cats_strings=["a"], zeros=0)


# ---- maps ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("keys", [{"classlabels_strings": ["no", "yes"]}, {"classlabels_int64s": [7, 3]}])
def test_zip_map_rows_to_dicts(keys):
    x = np.array([[0.25, 0.75], [1.0, 0.0], [0.5, 0.5]], np.float32)
    (got,) = ours("ZipMap", {"x": x}, **keys)
    (ref,) = onnxruntime(ml_model("ZipMap", {"x": x}, **keys), {"x": x})
    assert isinstance(got, list) and len(got) == len(ref) == 3
    for mine, theirs in zip(got, ref):
        assert {k: float(v) for k, v in mine.items()} == theirs
        assert all(np.asarray(v).dtype == np.float32 for v in mine.values())


# A map fed to the engine cannot be hashed for its compile cache (see test_map_fed_as_graph_input), so the map
# ops are called directly here; test_zip_map_into_dict_vectorizer_traced runs one inside a graph.
def test_dict_vectorizer_against_onnxruntime():
    mapping, vocabulary = {"a": 4.0, "c": -8.5}, {"string_vocabulary": ["a", "b", "c"]}
    (ref,) = onnxruntime(map_model("DictVectorizer", TensorProto.STRING, TensorProto.FLOAT, **vocabulary),
                         {"x": mapping})
    got = ml.dict_vectorizer(mapping, **vocabulary)
    assert got.dtype == ref.dtype and got.tolist() == ref.tolist()  # [1, V] for one map, as here


@pytest.mark.parametrize(
    ("mapping", "vocabulary", "dtype"),
    [
        ({"b": np.float64(2.5), "c": np.float64(1)}, {"string_vocabulary": ["a", "b", "c"]}, np.float64),
        ({7: "x", 2: "y"}, {"int64_vocabulary": [2, 5, 7]}, object),
        ({"q": 3, "a": 1}, {"string_vocabulary": ["a", "q"]}, np.int64),
    ],
)
def test_dict_vectorizer_value_types(mapping, vocabulary, dtype):  # map types ONNX Runtime's Python API cannot feed
    zero = "" if dtype is object else 0  # a value-initialized element, as in ONNX Runtime
    expected = [mapping.get(k, zero) for k in next(iter(vocabulary.values()))]
    with jax.enable_x64(True):
        got = ml.dict_vectorizer(mapping, **vocabulary)
        rows = ml.dict_vectorizer([mapping, {}], **vocabulary)
    assert got.dtype == dtype and rows.dtype == dtype
    assert got.tolist() == [expected]
    assert rows.tolist() == [expected, [zero] * len(expected)]


def test_zip_map_into_dict_vectorizer_traced():
    """A map made inside the graph from traced scores: ZipMap -> SequenceAt -> DictVectorizer under jit."""
    nodes = [
        helper.make_node("ZipMap", ["x"], ["maps"], domain=ML_DOMAIN, classlabels_strings=["a", "b", "c"]),
        helper.make_node("SequenceAt", ["maps", "one"], ["map"]),
        helper.make_node("DictVectorizer", ["map"], ["y"], domain=ML_DOMAIN, string_vocabulary=["c", "a"]),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_empty_tensor_value_info("y")], [tensor("one", np.array(1, np.int64))],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(ML_DOMAIN, 1), helper.make_opsetid("", 21)])
    engine = onnxtrain.load(model, check=False)
    for x in (np.array([[1, 2, 3], [4, 5, 6]], np.float32), np.array([[0, 0, 0], [-1, 2, -3]], np.float32)):
        got = np.asarray(engine.infer({"x": x})["y"])
        np.testing.assert_array_equal(got, x[1:, [2, 0]])
        assert got.dtype == np.float32
    assert engine.trace_count == 1


def test_map_fed_as_graph_input():
    model = map_model("DictVectorizer", TensorProto.STRING, TensorProto.FLOAT, string_vocabulary=["a", "b"])
    got = onnxtrain.load(model, check=False).infer({"x": {"b": np.float32(2.0)}})["y"]
    np.testing.assert_array_equal(got, [[0, 2]])


def cast_map(mapping: dict, **attrs) -> np.ndarray:
    with jax.enable_x64(True):
        return ml.cast_map(mapping, **{"cast_to": "TO_FLOAT", "map_form": "DENSE", "max_map": 1, **attrs})


@pytest.mark.parametrize(
    ("mapping", "attrs"),
    [
        ({3: 1.5, 1: -2.0}, {}),
        ({3: 1.5, 1: -2.7}, {"cast_to": "TO_INT64"}),
        ({1: 0.5, 0: -2.25}, {"cast_to": "TO_STRING", "map_form": "SPARSE", "max_map": 3}),
        ({4: 0.5, 0: -2.25}, {"map_form": "SPARSE", "max_map": 2}),
    ],
)
def test_cast_map_float_values(mapping, attrs):
    (ref,) = onnxruntime(map_model("CastMap", TensorProto.INT64, TensorProto.FLOAT, **attrs), {"x": mapping})
    got = cast_map(mapping, **attrs)
    assert got.dtype == ref.dtype and got.tolist() == ref.tolist()


def test_cast_map_string_values():  # map(int64, string) cannot be fed to ONNX Runtime from Python
    assert cast_map({5: "b", 2: "a"}, cast_to="TO_STRING").tolist() == [["a", "b"]]
    sparse = cast_map({2: "4.5", 0: "1"}, map_form="SPARSE", max_map=4)
    assert sparse.dtype == np.float32 and sparse.tolist() == [[1, 0, 4.5, 0]]
    assert cast_map({1: "-7"}, cast_to="TO_INT64").tolist() == [[-7]]


# ---- linear models -------------------------------------------------------------------------------------------


def test_linear_regressor_targets():
    x = normal(2, (5, 3)).astype(np.float32)
    check("LinearRegressor", {"x": x}, dtypes=[np.float32], targets=2, coefficients=[1, -2, 0.5, 3, 0, -1],
          intercepts=[0.5, -0.25])


def test_linear_regressor_post_transform():  # the reference implements NONE only
    x = np.array([[1.0, 2.0], [-3.0, 0.5]], np.float64)
    (got,) = ours("LinearRegressor", {"x": x}, coefficients=[0.5, -1.0], intercepts=[0.25], post_transform="LOGISTIC")
    np.testing.assert_allclose(got, 1 / (1 + np.exp(-(x @ [0.5, -1.0] + 0.25)))[:, None], rtol=1e-6)
    assert got.dtype == np.float32


LINEAR_3 = {"coefficients": [1.0, -1.0, 0.5, 0.0, 2.0, -1.5, -0.5, 0.25, 1.0], "intercepts": [0.1, -0.2, 0.3]}


@pytest.mark.parametrize("transform", ["NONE", "SOFTMAX", "LOGISTIC", "SOFTMAX_ZERO", "PROBIT"])
def test_linear_classifier_multiclass(transform):
    x, attrs, tolerance = normal(3, (6, 3)).astype(np.float32), LINEAR_3, {}
    if transform == "PROBIT":  # probabilities in, so scores must lie in (0, 1); float32 erfinv is ill-conditioned
        x, attrs, tolerance = x * 0.05, {**LINEAR_3, "intercepts": [0.5, 0.4, 0.6]}, {"rtol": 1e-4, "atol": 1e-5}
    check("LinearClassifier", {"x": x}, n_outputs=2, classlabels_ints=[10, 20, 30], post_transform=transform,
          dtypes=[np.int64, np.float32], **attrs, **tolerance)


def test_linear_classifier_string_labels_and_binary():
    x = normal(4, (5, 3)).astype(np.float32)
    check("LinearClassifier", {"x": x}, n_outputs=2, classlabels_strings=["a", "b", "c"], **LINEAR_3)
    check("LinearClassifier", {"x": x}, n_outputs=2, classlabels_ints=[0, 1], coefficients=[1.0, -2.0, 0.5],
          intercepts=[0.2], post_transform="LOGISTIC")


def test_linear_classifier_traced_compiles_once():
    model = ml_model("LinearClassifier", {"x": np.zeros((4, 3), np.float32)}, 2, classlabels_ints=[1, 2, 3], **LINEAR_3)
    engine = onnxtrain.load(model, check=False)
    for _ in range(2):
        engine.infer({"x": normal(5, (4, 3)).astype(np.float32)})
    assert engine.trace_count == 1


# ---- support vector machines ---------------------------------------------------------------------------------

SUPPORT = normal(0, (5, 3)).round(2).tolist()


@pytest.mark.parametrize(
    ("kernel", "params"), [("RBF", [0.5, 0.0, 0.0]), ("POLY", [0.3, 1.0, 3.0]), ("SIGMOID", [0.2, 0.1, 0.0])]
)
def test_svm_regressor_kernels(kernel, params):
    x = normal(6, (4, 3)).astype(np.float32)
    check("SVMRegressor", {"x": x}, dtypes=[np.float32], rtol=1e-4, kernel_type=kernel, kernel_params=params,
          n_supports=5, support_vectors=sum(SUPPORT, []), coefficients=[0.5, -1.0, 0.25, 1.5, -0.75], rho=[0.3])


def test_svm_regressor_linear_and_one_class():
    x = normal(7, (6, 3)).astype(np.float32)
    check("SVMRegressor", {"x": x}, coefficients=[1.0, -0.5, 2.0], rho=[0.1])
    check("SVMRegressor", {"x": x}, dtypes=[np.float32], kernel_type="RBF", kernel_params=[0.5, 0, 0], n_supports=5,
          support_vectors=sum(SUPPORT, []), coefficients=[0.5, -1.0, 0.25, 1.5, -0.75], rho=[0.3], one_class=1)


SVC_3 = {
    "kernel_type": "RBF", "kernel_params": [0.4, 0.0, 0.0], "vectors_per_class": [2, 1, 2],
    "support_vectors": sum(SUPPORT, []), "rho": [0.1, -0.2, 0.3],
    "coefficients": [1.0, 0.5, -0.7, 0.4, -0.3, -0.2, 0.8, -1.0, 0.6, -0.9],
}


def test_svm_classifier_one_vs_one_votes():
    x = normal(8, (8, 3)).astype(np.float32)
    check("SVMClassifier", {"x": x}, n_outputs=2, dtypes=[np.int64, np.float32], rtol=1e-4, atol=1e-5,
          classlabels_ints=[4, 5, 6], **SVC_3)
    check("SVMClassifier", {"x": x}, n_outputs=2, rtol=1e-4, atol=1e-5, classlabels_strings=["p", "q", "r"],
          post_transform="LOGISTIC", **SVC_3)


def libsvm_coupling(r: np.ndarray) -> np.ndarray:
    """libsvm's multiclass_probability, elementwise as written in libsvm (the reference's vectorized Q is wrong
    for 3 classes or more)."""
    k = len(r)
    q = np.zeros((k, k))
    for t in range(k):
        for j in range(k):
            if j != t:
                q[t, t] += r[j, t] ** 2
                q[t, j] = -r[j, t] * r[t, j]
    p = np.full(k, 1 / k)
    for _ in range(max(100, k)):
        qp = q @ p
        pqp = p @ qp
        if np.max(np.abs(qp - pqp)) < 0.005 / k:
            break
        for t in range(k):
            diff = (-qp[t] + pqp) / q[t, t]
            p[t] += diff
            pqp = (pqp + diff * (diff * q[t, t] + 2 * qp[t])) / (1 + diff) ** 2
            qp = (qp + diff * q[t]) / (1 + diff)
            p /= 1 + diff
    return p


def test_svm_classifier_probabilities_three_classes():
    x = normal(9, (5, 3))
    prob_a, prob_b = [-1.5, -0.8, -2.0], [0.1, -0.2, 0.05]
    labels, scores = ours("SVMClassifier", {"x": x}, n_outputs=2, classlabels_ints=[0, 1, 2], prob_a=prob_a,
                          prob_b=prob_b, **SVC_3)
    _, reference_labels = None, run_both(ml_model("SVMClassifier", {"x": x}, 2, classlabels_ints=[0, 1, 2], **SVC_3),
                                        {"x": x})[1][0]
    np.testing.assert_array_equal(labels, reference_labels)  # labels come from the votes either way
    vectors, gamma = np.array(SUPPORT), 0.4
    kernel = np.exp(-gamma * ((x[:, None, :] - vectors[None]) ** 2).sum(-1))
    coef = np.array(SVC_3["coefficients"]).reshape(2, 5)
    owners = [[0, 1], [2], [3, 4]]
    for n in range(len(x)):
        r, p = np.zeros((3, 3)), 0
        for i in range(3):
            for j in range(i + 1, 3):
                s = SVC_3["rho"][p] + sum(coef[j - 1, v] * kernel[n, v] for v in owners[i])
                s += sum(coef[i, v] * kernel[n, v] for v in owners[j])
                pairwise = np.clip(1 / (1 + np.exp(s * prob_a[p] + prob_b[p])), 1e-7, 1 - 1e-7)
                r[i, j], r[j, i], p = pairwise, 1 - pairwise, p + 1
        np.testing.assert_allclose(scores[n], libsvm_coupling(r), rtol=1e-4, atol=1e-5)
    assert scores.dtype == np.float32


def test_svm_classifier_binary_with_and_without_probabilities():
    x = normal(10, (6, 3)).astype(np.float32)
    binary = {"kernel_type": "RBF", "kernel_params": [0.4, 0, 0], "vectors_per_class": [3, 2],
              "support_vectors": sum(SUPPORT, []), "rho": [0.1], "coefficients": [1.0, 0.5, -0.7, 0.4, -0.3]}
    check("SVMClassifier", {"x": x}, n_outputs=2, rtol=1e-4, atol=1e-5, classlabels_ints=[0, 1], **binary)
    check("SVMClassifier", {"x": x}, n_outputs=2, rtol=1e-4, atol=1e-5, classlabels_ints=[0, 1], prob_a=[-2.0],
          prob_b=[0.3], **binary)


def test_svm_classifier_linear():
    x = normal(11, (6, 2)).astype(np.float32)
    check("SVMClassifier", {"x": x}, n_outputs=2, classlabels_ints=[1, 2, 3], coefficients=[1, -1, 0.5, 2, -1, 0.25],
          rho=[0.5, 0.1, -0.3], post_transform="SOFTMAX")


# ---- tree ensembles ------------------------------------------------------------------------------------------

GRID = np.array([-1.0, -0.5, 0.0, 0.5, 1.0])  # thresholds and features share a grid, so ties are exercised


def random_tree(rng, depth: int, n_features: int, n_targets: int, votes: int, modes: int):
    """("leaf", [(target, weight)...]) or ("split", mode, feature, threshold, missing_true, true, false)."""
    if depth == 0 or (depth < 3 and rng.random() < 0.3):
        targets = rng.choice(n_targets, size=votes, replace=False)
        return ("leaf", [(int(t), float(rng.integers(-8, 9)) / 4) for t in targets])
    return ("split", int(rng.integers(modes)), int(rng.integers(n_features)), float(rng.choice(GRID)),
            int(rng.integers(2)), random_tree(rng, depth - 1, n_features, n_targets, votes, modes),
            random_tree(rng, depth - 1, n_features, n_targets, votes, modes))


MODES = ["BRANCH_LEQ", "BRANCH_LT", "BRANCH_GTE", "BRANCH_GT", "BRANCH_EQ", "BRANCH_NEQ"]


def old_encoding(trees, prefix: str) -> dict:
    """TreeEnsembleRegressor/Classifier attributes: nodes in pre-order, ids restarting at 0 per tree."""
    a = {k: [] for k in ("treeids", "nodeids", "featureids", "values", "modes", "truenodeids", "falsenodeids",
                         "missing_value_tracks_true")}
    v = {k: [] for k in ("treeids", "nodeids", "ids", "weights")}

    def add(tree_id, node, counter):
        node_id = counter[0]
        counter[0] += 1
        position = len(a["treeids"])
        for key, value in zip(a, (tree_id, node_id, 0, 0.0, "LEAF", 0, 0, 0)):
            a[key].append(value)
        if node[0] == "leaf":
            for target, weight in node[1]:
                for key, value in zip(v, (tree_id, node_id, target, weight)):
                    v[key].append(value)
        else:
            _, mode, feature, threshold, missing, yes, no = node
            a["modes"][position], a["featureids"][position] = MODES[mode], feature
            a["values"][position], a["missing_value_tracks_true"][position] = threshold, missing
            a["truenodeids"][position] = add(tree_id, yes, counter)
            a["falsenodeids"][position] = add(tree_id, no, counter)
        return node_id

    for tree_id, tree in enumerate(trees):
        add(tree_id, tree, [0])
    return {**{f"nodes_{k}": x for k, x in a.items()}, **{f"{prefix}_{k}": x for k, x in v.items()}}


def v5_encoding(trees, dtype) -> dict:
    """TreeEnsemble attributes: interior nodes and (single-vote) leaves listed apart."""
    n = {k: [] for k in ("featureids", "splits", "modes", "truenodeids", "falsenodeids", "trueleafs", "falseleafs",
                         "missing_value_tracks_true")}
    leaf_targets, leaf_weights, roots = [], [], []

    def add(node):
        if node[0] == "leaf":
            (target, weight), = node[1]
            leaf_targets.append(target)
            leaf_weights.append(weight)
            return len(leaf_weights) - 1, 1
        _, mode, feature, threshold, missing, yes, no = node
        index = len(n["featureids"])
        for key, value in zip(n, (feature, threshold, mode, 0, 0, 0, 0, missing)):
            n[key].append(value)
        n["truenodeids"][index], n["trueleafs"][index] = add(yes)
        n["falsenodeids"][index], n["falseleafs"][index] = add(no)
        return index, 0

    for tree in trees:
        roots.append(add(tree)[0])
    attrs = {f"nodes_{k}": x for k, x in n.items()}
    attrs["nodes_splits"] = tensor("splits", np.array(n["splits"], dtype))
    attrs["nodes_modes"] = tensor("modes", np.array(n["modes"], np.uint8))
    return {**attrs, "leaf_targetids": leaf_targets, "leaf_weights": tensor("w", np.array(leaf_weights, dtype)),
            "tree_roots": roots}


def forest(seed: int, n_trees: int = 4, votes: int = 1, n_targets: int = 3, split_root: bool = False):
    rng = np.random.default_rng(seed)
    trees = [random_tree(rng, 4, 3, n_targets, votes, len(MODES)) for _ in range(n_trees)]
    if split_root:  # TreeEnsemble cannot encode a tree that is one leaf without a node
        trees = [t if t[0] == "split" else ("split", 0, 0, 0.0, 0, t, t) for t in trees]
    return trees


def features(seed: int, n: int = 40, dtype=np.float32, nan: bool = True) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.choice(np.concatenate([GRID, GRID + 0.25]), (n, 3))
    if nan:
        x[rng.random(x.shape) < 0.1] = np.nan
    return x.astype(dtype)


def without_unvoted(reference: np.ndarray, base) -> np.ndarray:
    """MIN/MAX of a target no leaf votes for: ONNX's reference leaves the dtype's extreme value (plus the base),
    ONNX Runtime and onnxtrain give 0 (plus the base)."""
    return np.where(np.abs(reference) > 1e30, np.broadcast_to(base, reference.shape), reference)


@pytest.mark.parametrize(("aggregate", "opset"), [("SUM", 1), ("AVERAGE", 3), ("MIN", 5), ("MAX", 1)])
def test_tree_ensemble_regressor(aggregate, opset):
    attrs = old_encoding(forest(opset, votes=2), "target")
    x, base = features(opset), [0.5, -1.0, 0.0]
    model = ml_model("TreeEnsembleRegressor", {"x": x}, opset=opset, n_targets=3, aggregate_function=aggregate,
                     base_values=base, **attrs)
    (got,), (ref,) = run_both(model, {"x": x})
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, without_unvoted(ref, base), rtol=1e-6)


@pytest.mark.parametrize("x", [features(8, dtype=np.float64), np.array([[0, 1, -1], [1, 0, 0]], np.int64)])
def test_tree_ensemble_regressor_as_tensor_and_other_input_types(x):
    # The reference reads only the float attributes and fails on integer features: it runs the equivalent
    # float-attribute model on float64 features (the grid's thresholds and weights are exact in float32).
    attrs = old_encoding(forest(7), "target")
    floats = {"x": x.astype(np.float64)}
    _, (ref,) = run_both(ml_model("TreeEnsembleRegressor", floats, opset=3, n_targets=3, **attrs), floats)
    thresholds, weights = np.array(attrs.pop("nodes_values")), np.array(attrs.pop("target_weights"))
    attrs.update(nodes_values_as_tensor=tensor("t", thresholds), target_weights_as_tensor=tensor("w", weights))
    (got,) = ours("TreeEnsembleRegressor", {"x": x}, opset=3, n_targets=3, **attrs)
    assert got.dtype == np.float32  # the spec's output type; the reference returns the input's
    np.testing.assert_allclose(got, ref, rtol=1e-6)


def test_tree_ensemble_regressor_traced_compiles_once():
    attrs = old_encoding(forest(3), "target")
    engine = onnxtrain.load(ml_model("TreeEnsembleRegressor", {"x": features(0)}, n_targets=3, **attrs), check=False)
    for seed in (1, 2):
        x = features(seed)
        _, (ref,) = run_both(ml_model("TreeEnsembleRegressor", {"x": x}, n_targets=3, **attrs), {"x": x})
        np.testing.assert_allclose(engine.infer({"x": x})["out0"], ref, rtol=1e-6)
    assert engine.trace_count == 1


@pytest.mark.parametrize(("labels", "transform"), [
    ({"classlabels_int64s": [5, 6, 7]}, "NONE"),
    ({"classlabels_strings": ["x", "y", "z"]}, "SOFTMAX"),
    ({"classlabels_int64s": [0, 1, 2]}, "SOFTMAX_ZERO"),
])
def test_tree_ensemble_classifier_multiclass(labels, transform):
    attrs = old_encoding(forest(11, votes=2), "class")
    check("TreeEnsembleClassifier", {"x": features(12)}, n_outputs=2, post_transform=transform,
          base_values=[0.1, 0.0, -0.1], **labels, **attrs)


@pytest.mark.parametrize(("transform", "labels"), [("NONE", [0, 1]), ("LOGISTIC", [3, 9]), ("NONE", [1])])
def test_tree_ensemble_classifier_binary(transform, labels):
    attrs = old_encoding(forest(21, n_targets=1), "class")
    attrs["class_weights"] = [w / 8 for w in attrs["class_weights"]]
    check("TreeEnsembleClassifier", {"x": features(22)}, n_outputs=2, dtypes=[np.int64, np.float32],
          post_transform=transform, classlabels_int64s=labels, **attrs)


@pytest.mark.parametrize(("aggregate", "dtype"), [(1, np.float32), (0, np.float64), (2, np.float32), (3, np.float64)])
def test_tree_ensemble_v5(aggregate, dtype):
    attrs = v5_encoding(forest(31 + aggregate, n_targets=3, split_root=True), dtype)
    x = features(aggregate, dtype=dtype)
    (got,), (ref,) = run_both(ml_model("TreeEnsemble", {"x": x}, n_targets=3, aggregate_function=aggregate, **attrs),
                              {"x": x})
    assert got.dtype == dtype
    np.testing.assert_allclose(got, without_unvoted(ref, 0), rtol=1e-6)


def test_tree_ensemble_v5_single_leaf_tree_and_post_transform():
    # A tree that is one leaf: a node whose branches both lead to it. The reference ignores post_transform.
    attrs = {"nodes_featureids": [0, 0], "nodes_splits": tensor("s", np.array([0.0, 1.0], np.float32)),
             "nodes_modes": tensor("m", np.array([0, 0], np.uint8)), "nodes_truenodeids": [0, 1],
             "nodes_falsenodeids": [0, 2], "nodes_trueleafs": [1, 1], "nodes_falseleafs": [1, 1],
             "leaf_targetids": [0, 1, 0], "leaf_weights": tensor("w", np.array([2.0, 1.0, -1.0], np.float32)),
             "tree_roots": [0, 1]}
    x = np.array([[0.5], [1.5], [np.nan]], np.float32)
    (raw,) = ours("TreeEnsemble", {"x": x}, n_targets=2, **attrs)
    np.testing.assert_array_equal(raw, [[2, 1], [1, 0], [1, 0]])
    (soft,) = ours("TreeEnsemble", {"x": x}, n_targets=2, post_transform=1, **attrs)
    np.testing.assert_allclose(soft, np.exp(raw) / np.exp(raw).sum(1, keepdims=True), rtol=1e-6)


def test_tree_ensemble_v5_membership_and_missing_tracks_true():
    # Node 0 tests x0 in {1, 2.5}; node 1 tests x1 <= 0 and sends NaN to the true branch.
    attrs = {"nodes_featureids": [0, 1], "nodes_splits": tensor("s", np.array([0.0, 0.0], np.float32)),
             "nodes_modes": tensor("m", np.array([6, 0], np.uint8)), "nodes_truenodeids": [0, 1],
             "nodes_falsenodeids": [1, 2], "nodes_trueleafs": [1, 1], "nodes_falseleafs": [0, 1],
             "nodes_missing_value_tracks_true": [1, 1],
             "membership_values": tensor("mv", np.array([1.0, 2.5, np.nan], np.float32)),
             "leaf_targetids": [0, 0, 0], "leaf_weights": tensor("w", np.array([10.0, 20.0, 30.0], np.float32)),
             "tree_roots": [0]}
    x = np.array([[2.5, 5.0], [3.0, -1.0], [3.0, np.nan], [np.nan, 4.0], [1.0, np.nan]], np.float32)
    check("TreeEnsemble", {"x": x}, n_targets=1, **attrs)


def test_tree_errors():
    attrs = old_encoding(forest(5), "target")
    attrs["nodes_truenodeids"][0] = 99
    with pytest.raises(NodeError, match="does not have"):
        ours("TreeEnsembleRegressor", {"x": features(0)}, n_targets=3, **attrs)
    attrs = old_encoding([("split", 0, 0, 0.0, 0, ("leaf", [(0, 1.0)]), ("leaf", [(0, 2.0)]))], "target")
    attrs["target_nodeids"][0] = 0  # a vote on the root, which is not a leaf
    with pytest.raises(NodeError, match="not a LEAF"):
        ours("TreeEnsembleRegressor", {"x": features(0)}, n_targets=1, **attrs)
