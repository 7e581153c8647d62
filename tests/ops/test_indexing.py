"""Indexing ops: what conformance leaves out (traced indices, exact 64-bit dtypes, old opsets, gradients, errors)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from onnx import numpy_helper

import onnxtrain
from nodes import assert_matches_reference, node_model, run_both
from onnxtrain.errors import NodeError
from onnxtrain.lower.ops import indexing, reduce
from onnxtrain.lower.registry import lookup, versions
from nodes import run_with_engine as run

BIG = 2**53 + 1  # not representable in float64: an int64 that drifts through a float comes back wrong


def with_constants(op_type, feeds, constants, n_outputs=1, **attrs):
    """A one-node model whose `constants` are initializers: integer initializers are static at trace time."""
    model = node_model(op_type, {**feeds, **constants}, n_outputs, **attrs)
    kept = [i for i in model.graph.input if i.name not in constants]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    model.graph.initializer.extend(numpy_helper.from_array(v, name) for name, v in constants.items())
    return model


def grad(fn, *args, argnum=0):
    """d sum(fn(*args) * weights) / d args[argnum], jitted: every other argument (indices too) is traced."""
    with jax.enable_x64(True):
        cotangent = weights(jax.eval_shape(fn, *args).shape)
        return np.asarray(jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) * cotangent), argnums=argnum))(*args))


def weights(shape):
    """Distinct cotangents, so a gradient that routes to the wrong element cannot pass."""
    return jnp.arange(1, int(np.prod(shape)) + 1, dtype=jnp.float64).reshape(shape)


# ---- gathers -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "axis"), [(np.float32, 0), (np.int64, 1), (np.int32, -1)])
def test_gather_negative_indices_and_dtypes(dtype, axis):
    data = (np.arange(24).reshape(2, 3, 4) + BIG * (dtype == np.int64)).astype(dtype)
    indices = np.array([[0, -1], [1, -2]], dtype=np.int64)
    assert_matches_reference("Gather", {"data": data, "indices": indices}, axis=axis)


@pytest.mark.parametrize("opset", [1, 11])
def test_gather_old_opsets(opset):
    data = np.arange(12.0).reshape(4, 3)
    indices = np.array([3, 0, 0], dtype=np.int32)
    feeds = {"data": data, "indices": indices}
    ours, theirs = run_both(node_model("Gather", feeds, opset=opset), feeds)
    np.testing.assert_array_equal(ours[0], theirs[0])


def test_gather_traced_indices_compile_once():
    data = np.arange(10.0).reshape(5, 2)
    model = node_model("Gather", {"data": data, "indices": np.zeros(3, np.int64)})
    engine = onnxtrain.load(model, check=False)
    for indices in (np.array([0, 4, -1]), np.array([2, -5, 3])):
        got = np.asarray(engine.infer({"data": data, "indices": indices})["out0"])
        np.testing.assert_array_equal(got, data[indices])
    assert engine.trace_count == 1


def test_gather_static_out_of_range_index_is_an_error():
    model = with_constants("Gather", {"data": np.arange(5.0)}, {"indices": np.array([1, 5])})
    with pytest.raises(NodeError, match="Gather.*out of range for an axis of size 5"):
        run(model, {"data": np.arange(5.0)})


def test_gather_gradient_accumulates_repeated_rows():
    table = np.arange(12.0).reshape(4, 3)
    indices = np.array([[1, 1], [-1, 0]])
    got = grad(indexing.gather, table, indices)
    expected = np.zeros_like(table)
    np.add.at(expected, indices % 4, np.arange(1, 13.0).reshape(2, 2, 3))
    np.testing.assert_array_equal(got, expected)


def test_gather_elements_smaller_indices_negative_and_exact_int64():
    data = (np.arange(12).reshape(3, 4) + BIG).astype(np.int64)
    indices = np.array([[0, -1, 2], [3, 1, -4]], dtype=np.int64)
    feeds = {"data": data, "indices": indices}  # ONNX's reference rejects shorter indices (torch.gather does not)
    (got,), _ = run(node_model("GatherElements", feeds, axis=1), feeds)
    np.testing.assert_array_equal(got, np.take_along_axis(data[:2, :], indices % 4, axis=1))
    assert got.dtype == np.int64
    full_height = np.vstack([indices, -indices])[:3, :2]
    assert_matches_reference("GatherElements", {"data": data, "indices": full_height}, axis=1)


def test_gather_elements_gradient_like_cross_entropy():
    logits = np.arange(12.0).reshape(4, 3) / 7
    labels = np.array([[2], [0], [1], [-1]])
    got = grad(lambda x, i: indexing.gather_elements(x, i, axis=1), logits, labels)
    expected = np.zeros_like(logits)
    expected[np.arange(4), labels[:, 0] % 3] = np.arange(1, 5.0)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("batch_dims", [0, 1, 2])
def test_gather_nd_batch_dims(batch_dims):
    data = np.arange(2 * 3 * 4 * 5, dtype=np.int64).reshape(2, 3, 4, 5) + BIG
    depth = 4 - batch_dims - 1
    rng = np.random.default_rng(batch_dims)
    index_shape = (2, 3)[:batch_dims] + (2, 1, depth)
    indices = rng.integers(-2, 2, size=index_shape).astype(np.int64)
    assert_matches_reference("GatherND", {"data": data, "indices": indices}, batch_dims=batch_dims)


def test_gather_nd_opset11_and_gradient():
    data = np.arange(8.0).reshape(2, 2, 2)
    indices = np.array([[1, 0], [1, -2]], dtype=np.int64)
    model = node_model("GatherND", {"data": data, "indices": indices}, opset=11)
    ours, theirs = run_both(model, {"data": data, "indices": indices})
    np.testing.assert_array_equal(ours[0], theirs[0])
    got = grad(indexing.gather_nd, data, indices)
    expected = np.zeros_like(data)
    expected[1, 0] = [1 + 3, 2 + 4]  # both index tuples name the same row
    np.testing.assert_array_equal(got, expected)


# ---- scatters ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["add", "mul", "min"])
def test_scatter_elements_reductions_exact_int64(reduction):
    data = (np.arange(12).reshape(3, 4) + BIG).astype(np.int64)
    indices = np.array([[1, -1], [0, 2], [3, 1]], dtype=np.int64)
    updates = np.array([[5, -6], [7, 8], [9, 10]], dtype=np.int64) * (1 if reduction == "mul" else BIG)
    inputs = {"data": data, "indices": indices, "updates": updates}
    assert_matches_reference("ScatterElements", inputs, axis=1, reduction=reduction)


@pytest.mark.parametrize(("op_type", "opset"), [("Scatter", 9), ("Scatter", 11), ("ScatterElements", 11)])
def test_scatter_old_opsets(op_type, opset):
    data = np.zeros((3, 3), np.float32)
    indices = np.array([[1, 0, 2], [0, 2, 1]], dtype=np.int64)
    updates = np.arange(1.0, 7.0, dtype=np.float32).reshape(2, 3)
    feeds = {"data": data, "indices": indices, "updates": updates}
    (got,), _ = run(node_model(op_type, feeds, opset=opset), feeds)
    expected = data.copy()
    expected[indices, np.arange(3)] = updates
    np.testing.assert_array_equal(got, expected)


def test_scatter_elements_gradients():
    data = np.arange(6.0).reshape(2, 3)
    indices = np.array([[2, 0]])
    updates = np.array([[10.0, 20.0]])
    scatter = lambda d, u, i: indexing.scatter_elements(d, i, u, axis=1)  # noqa: E731
    np.testing.assert_array_equal(grad(scatter, data, updates, indices, argnum=0), [[0, 2, 0], [4, 5, 6]])
    np.testing.assert_array_equal(grad(scatter, data, updates, indices, argnum=1), [[3, 1]])


@pytest.mark.parametrize("reduction", ["none", "mul"])
def test_scatter_nd_reductions_slices(reduction):
    data = np.arange(24.0).reshape(4, 3, 2)
    indices = np.array([[[0]], [[-1]]], dtype=np.int64)
    updates = np.arange(12.0).reshape(2, 1, 3, 2) - 5
    inputs = {"data": data, "indices": indices, "updates": updates}
    assert_matches_reference("ScatterND", inputs, reduction=reduction)


def test_scatter_nd_opset11_traced_indices():
    data = np.arange(4, dtype=np.int64) + BIG
    feeds = {"data": data, "indices": np.zeros((2, 1), np.int64), "updates": data[:2]}
    model = node_model("ScatterND", feeds, opset=11)
    engine = onnxtrain.load(model, check=False)
    for indices in (np.array([[3], [0]]), np.array([[1], [2]])):
        got = np.asarray(engine.infer({"data": data, "indices": indices, "updates": data[:2] * 0 + 7})["out0"])
        expected = data.copy()
        expected[indices[:, 0]] = 7
        np.testing.assert_array_equal(got, expected)
    assert engine.trace_count == 1


def test_scatter_unknown_reduction_is_an_error():
    with pytest.raises(ValueError, match="unknown reduction 'sum'"):
        indexing.scatter_nd(np.zeros(3), np.array([[0]]), np.ones(1), reduction="sum")


@pytest.mark.parametrize(("mode", "shape", "axis"), [("circular", (2, 3, 6, 2), -2), ("linear", (2, 6, 3), 1)])
def test_tensor_scatter(mode, shape, axis):
    cache = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    update_shape = list(shape)
    update_shape[axis] = 3
    update = -np.arange(np.prod(update_shape), dtype=np.float32).reshape(update_shape)
    starts = np.array([1, 3 if mode == "linear" else 5], dtype=np.int64)
    inputs = {"past_cache": cache, "update": update, "write_indices": starts}
    assert_matches_reference("TensorScatter", inputs, axis=axis, mode=mode)


def test_tensor_scatter_without_write_indices():
    cache = np.zeros((2, 4, 2), np.float64)
    update = np.ones((2, 2, 2), np.float64)
    assert_matches_reference("TensorScatter", {"past_cache": cache, "update": update}, axis=1)


# ---- selection -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("opset", [9, 16])
def test_where_broadcasts_and_keeps_int64(opset):
    cond = np.array([[True], [False]])
    x = np.array([BIG, 1, 2], dtype=np.int64)
    y = np.array([[-BIG]], dtype=np.int64)
    feeds = {"cond": cond, "x": x, "y": y}
    (got,), _ = run(node_model("Where", feeds, opset=opset), feeds)
    np.testing.assert_array_equal(got, np.where(cond, x, y))
    assert got.dtype == np.int64


def test_where_strings():
    feeds = {"cond": np.array([True, False]), "x": np.array(["a", "b"], object), "y": np.array(["c", "d"], object)}
    (got,), _ = run(node_model("Where", feeds), feeds)
    assert got.tolist() == ["a", "d"]


@pytest.mark.parametrize("axis", [0, -1])
def test_one_hot_negative_and_out_of_range(axis):
    indices = np.array([[0, -1, 5], [2, -4, 3]], dtype=np.int64)
    inputs = {"indices": indices, "depth": np.array(4.0, np.float32), "values": np.array([-BIG, BIG], np.int64)}
    assert_matches_reference("OneHot", inputs, axis=axis)


def test_one_hot_opset9_negative_index_is_out_of_range():
    indices = np.array([1, -1, 2], dtype=np.int64)
    feeds = {"indices": indices, "depth": np.array([3], np.int64), "values": np.array([0.0, 1.0], np.float32)}
    (got,), _ = run(node_model("OneHot", feeds, opset=9), feeds)
    np.testing.assert_array_equal(got, [[0, 1, 0], [0, 0, 0], [0, 0, 1]])


def test_one_hot_float_indices():
    indices = np.array([1.0, -1.0, 1.5], dtype=np.float32)
    inputs = {"indices": indices, "depth": np.array(3, np.int64), "values": np.array([0.0, 1.0], np.float64)}
    assert_matches_reference("OneHot", inputs)


@pytest.mark.parametrize("axis", [None, -1])
def test_compress_short_condition(axis):
    data = np.arange(12, dtype=np.int64).reshape(3, 4) + BIG
    condition = np.array([False, True, True])
    attrs = {} if axis is None else {"axis": axis}
    assert_matches_reference("Compress", {"input": data, "condition": condition}, **attrs)


def test_compress_condition_beyond_axis_is_an_error():
    data = np.arange(3.0)
    model = with_constants("Compress", {"input": data}, {"condition": np.ones(4, bool)}, axis=0)
    with pytest.raises(NodeError, match="beyond axis 0 of size 3"):
        run(model, {"input": data})


@pytest.mark.parametrize("shape", [(2, 3, 2), ()])
def test_non_zero(shape):
    x = (np.arange(int(np.prod(shape))).reshape(shape) % 3).astype(np.float32)
    (got,), _ = run(node_model("NonZero", {"x": x}), {"x": x})
    assert got.dtype == np.int64
    assert got.shape == (len(shape), np.count_nonzero(x))
    np.testing.assert_array_equal(got, np.array(np.nonzero(np.atleast_1d(x)))[: len(shape)])


def test_non_zero_opset9_traced_feed_changes_shape():
    model = node_model("NonZero", {"x": np.zeros(4, np.int32)}, opset=9)
    engine = onnxtrain.load(model, check=False)
    with pytest.warns(UserWarning, match="compiled in as constants"):
        first = engine.infer({"x": np.array([0, 1, 0, 1], np.int32)})["out0"]
    second = engine.infer({"x": np.array([1, 1, 1, 0], np.int32)})["out0"]
    np.testing.assert_array_equal(first, [[1, 3]])
    np.testing.assert_array_equal(second, [[0, 1, 2]])


def unique_reference(x, axis, sort):
    """Unique by a first-occurrence scan: no np.unique, so ours is checked against something independent."""
    flat = x.reshape(-1) if axis is None else np.moveaxis(x, axis, 0)
    keys = [flat[i].tobytes() for i in range(len(flat))]
    first = {}
    for i, key in enumerate(keys):
        first.setdefault(key, i)
    order = list(first.values())
    if sort:
        order.sort(key=lambda i: tuple(np.ravel(flat[i]).tolist()))
    position = {keys[i]: n for n, i in enumerate(order)}
    y = flat[order] if axis is None else np.moveaxis(flat[order], 0, axis)
    inverse = [position[k] for k in keys]
    counts = [keys.count(keys[i]) for i in order]
    return y, np.array(order), np.array(inverse), np.array(counts)


@pytest.mark.parametrize(("axis", "sort"), [(None, 0), (1, 0), (-1, 1)])
def test_unique_all_outputs(axis, sort):
    x = np.array([[[3, 1], [0, 2], [3, 1]], [[2, 2], [0, 2], [2, 2]]], dtype=np.int64) + BIG
    attrs = {"sorted": sort} if axis is None else {"sorted": sort, "axis": axis}
    (y, first, inverse, counts), _ = run(node_model("Unique", {"x": x}, n_outputs=4, **attrs), {"x": x})
    expected = unique_reference(x, None if axis is None else axis % 3, sort)
    for got, want in zip((y, first, inverse, counts), expected):
        np.testing.assert_array_equal(got, want)
        assert got.dtype == want.dtype if got is y else got.dtype == np.int64


def test_unique_strings_unsorted():
    x = np.array(["b", "a", "b", "c"], dtype=object)
    (y, first, inverse, counts), _ = run(node_model("Unique", {"x": x}, n_outputs=4, sorted=0), {"x": x})
    assert y.tolist() == ["b", "a", "c"]
    np.testing.assert_array_equal(first, [0, 1, 3])
    np.testing.assert_array_equal(inverse, [0, 1, 0, 2])
    np.testing.assert_array_equal(counts, [2, 1, 1])


@pytest.mark.parametrize(("batch_axis", "time_axis"), [(0, 1), (1, 0)])
def test_reverse_sequence_traced_lengths(batch_axis, time_axis):
    x = np.arange(4 * 3 * 2, dtype=np.int64).reshape((4, 3, 2) if time_axis == 0 else (3, 4, 2)) + BIG
    model = node_model(
        "ReverseSequence", {"x": x, "lens": np.zeros(3, np.int64)}, batch_axis=batch_axis, time_axis=time_axis
    )
    engine = onnxtrain.load(model, check=False)
    for lens in (np.array([4, 1, 2]), np.array([0, 3, 4])):
        got = np.asarray(engine.infer({"x": x, "lens": lens})["out0"])
        expected = x.copy()
        batch_major = np.moveaxis(expected, (batch_axis, time_axis), (0, 1))  # a view of expected
        for b, n in enumerate(lens):
            batch_major[b, :n] = batch_major[b, :n][::-1].copy()
        np.testing.assert_array_equal(got, expected)
    assert engine.trace_count == 1


# ---- scans ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("op_type", "exclusive", "reverse"), [("CumSum", 1, 1), ("CumProd", 1, 0), ("CumProd", 0, 1)])
def test_cumulative_3d_exact_int64(op_type, exclusive, reverse):
    x = np.array([[[3, 0, -2], [1, 5, 2]]], dtype=np.int64).repeat(2, axis=0)
    if op_type == "CumSum":
        x = x + BIG
    inputs = {"x": x, "axis": np.array(-1, np.int64)}
    assert_matches_reference(op_type, inputs, exclusive=exclusive, reverse=reverse, rtol=0, atol=0)


def test_cumsum_opset11_and_axis_as_int32_vector(opset=11):
    x = np.arange(6.0).reshape(2, 3)
    feeds = {"x": x, "axis": np.array([0], np.int32)}
    (got,), _ = run(node_model("CumSum", feeds, opset=opset, exclusive=1), feeds)
    np.testing.assert_array_equal(got, [[0, 0, 0], [0, 1, 2]])


@pytest.mark.parametrize(
    ("op_type", "x", "expected"),
    [
        ("CumSum", [2.0, 0.5, 3.0, -1.0], [0, 1, 3, 6]),
        # y = [x1 x2 x3, x2 x3, x3, 1]: the zero must not stop gradients (no division by x)
        ("CumProd", [2.0, 0.0, 3.0, -1.0], [0, -3, -2, 9]),
    ],
)
def test_cumulative_exclusive_reverse_gradients(op_type, x, expected):
    scan = lookup("", op_type, versions(op_type)[-1]).fn
    got = grad(lambda v: scan(v, np.array(0), exclusive=1, reverse=1), np.array(x))
    np.testing.assert_array_equal(got, expected)


# ---- ordering ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("op_type", "opset"), [("ArgMax", 1), ("ArgMin", 11)])
def test_arg_reductions_old_opsets(op_type, opset):
    data = np.array([[1, 4, 4], [2, 2, 0]], dtype=np.float64)
    ours, theirs = run_both(node_model(op_type, {"data": data}, opset=opset, axis=1, keepdims=0), {"data": data})
    np.testing.assert_array_equal(ours[0], theirs[0])
    assert ours[0].dtype == np.int64


@pytest.mark.parametrize(("op_type", "axis", "keepdims"), [("ArgMax", 1, 0), ("ArgMin", 0, 1)])
def test_arg_reductions_select_last_index_exact_int64(op_type, axis, keepdims):
    data = np.array([[BIG, BIG - 1, BIG], [-BIG, -BIG, -BIG + 1]], dtype=np.int64)
    assert_matches_reference(op_type, {"data": data}, axis=axis, keepdims=keepdims, select_last_index=1)


@pytest.mark.parametrize(
    ("dtype", "largest"), [(np.int32, 0), (np.uint64, 0), (np.int64, 1), (np.float64, 0)]  # smallest: no overflow
)
def test_top_k_ties_extremes_and_dtypes(largest, dtype):
    info = np.finfo(dtype) if np.issubdtype(dtype, np.floating) else np.iinfo(dtype)
    x = np.array([[3, info.min, 3, info.max, info.min, 3], [0, 0, 1, 0, info.max, info.max]], dtype=dtype)
    inputs = {"x": x, "k": np.array([4], np.int64)}
    values, indices = assert_matches_reference("TopK", inputs, n_outputs=2, axis=1, largest=largest, rtol=0, atol=0)
    assert values.dtype == dtype and indices.dtype == np.int64


def test_top_k_opset1_attribute_and_opset10_input():
    x = np.array([[1.0, 5.0, 5.0], [2.0, 7.0, 3.0]], np.float32)
    (values, indices), _ = run(node_model("TopK", {"x": x}, n_outputs=2, opset=1, k=2, axis=0), {"x": x})
    np.testing.assert_array_equal(indices, [[1, 1, 0], [0, 0, 1]])
    feeds = {"x": x, "k": np.array([2], np.int64)}
    (values, indices), _ = run(node_model("TopK", feeds, n_outputs=2, opset=10), feeds)
    np.testing.assert_array_equal(values, [[5, 5], [7, 3]])
    np.testing.assert_array_equal(indices, [[1, 2], [1, 2]])


def test_top_k_traced_k_recompiles_per_value():
    x = np.arange(6.0)
    model = node_model("TopK", {"x": x, "k": np.array([1], np.int64)}, n_outputs=2, largest=0)
    engine = onnxtrain.load(model, check=False)
    with pytest.warns(UserWarning, match="compiled in as constants"):
        assert engine.infer({"x": x, "k": np.array([2])})["out0"].shape == (2,)
    np.testing.assert_array_equal(engine.infer({"x": x, "k": np.array([0])})["out0"], np.zeros(0))


def test_top_k_k_too_large_is_an_error():
    x = np.arange(3.0)
    model = with_constants("TopK", {"x": x}, {"k": np.array([4])}, n_outputs=2)
    with pytest.raises(NodeError, match="k = 4 is out of range"):
        run(model, {"x": x})


def test_top_k_gradient_reaches_selected_elements():
    x = np.array([0.5, 3.0, -1.0, 2.0])
    got = grad(lambda v: reduce.top_k(v, np.array([2]), axis=0, largest=0)[0], x)
    np.testing.assert_array_equal(got, [2, 0, 1, 0])


# ---- strings (always static: computed on the host) -----------------------------------------------------------


@pytest.mark.parametrize(
    ("op_type", "inputs"),
    [
        ("Gather", {"data": np.array(["a", "bc", "d"], object), "indices": np.array([2, -3])}),
        ("GatherElements", {"data": np.array([["a", "b"], ["c", "d"]], object), "indices": np.array([[1, 0]])}),
        ("GatherND", {"data": np.array([["a", "b"], ["c", "d"]], object), "indices": np.array([[1, 0]])}),
        (
            "ScatterElements",
            {"data": np.array(["a", "b", "c"], object), "indices": np.array([-1]), "updates": np.array(["z"], object)},
        ),
        (
            "ScatterND",
            {"data": np.array(["a", "b"], object), "indices": np.array([[0]]), "updates": np.array(["z"], object)},
        ),
        ("ReverseSequence", {"x": np.array([["a", "b"], ["c", "d"]], object), "lens": np.array([2, 1])}),
        ("Compress", {"x": np.array(["a", "b", "c"], object), "condition": np.array([True, False, True])}),
    ],
)
def test_strings(op_type, inputs):
    model = node_model(op_type, inputs)
    ours, theirs = run_both(model, inputs)
    assert ours[0].tolist() == theirs[0].tolist()


def test_string_one_hot():  # ONNX's reference evaluator cannot do this one
    feeds = {"i": np.array([1, -2]), "depth": np.array(2), "values": np.array(["off", "on"], object)}
    (got,), _ = run(node_model("OneHot", feeds), feeds)
    assert got.tolist() == [["off", "on"], ["on", "off"]]


def test_string_scatter_with_reduction_is_an_error():
    with pytest.raises(ValueError, match="not defined for strings"):
        indexing.scatter_nd(np.array(["a"], object), np.array([[0]]), np.array(["b"], object), reduction="add")
