"""Shape ops: what conformance leaves out (traced data, static shape folding, exact 64-bit dtypes, old opsets,
gradients, errors). References are onnx's ReferenceEvaluator or NumPy written here."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from nodes import node_model, run_both
from onnxtrain.errors import NodeError
from onnxtrain.lower.ops import creation
from onnxtrain.lower.ops import shape as shape_ops
from nodes import run_with_engine as run

BIG = 2**53 + 1  # an int64 that cannot pass through a float64 unchanged
INT64_MAX, INT64_MIN = np.iinfo(np.int64).max, np.iinfo(np.int64).min

# Shapes fed as graph inputs are compiled in as constants, which the engine announces with a warning.
pytestmark = pytest.mark.filterwarnings("ignore:.*compiled in as constants")


def ints(*values):
    return np.array(values, dtype=np.int64)


def assert_exact(op_type, inputs, n_outputs=1, **attrs):
    """Equal dtypes, shapes and bits against the reference evaluator (no float64 round trip)."""
    ours, theirs = run_both(node_model(op_type, inputs, n_outputs, **attrs), inputs)
    assert len(ours) == len(theirs)
    for mine, ref in zip(ours, theirs):
        assert mine.dtype == ref.dtype, (mine.dtype, ref.dtype)
        np.testing.assert_array_equal(mine, ref)
    return ours


def grad(fn, x):
    """d sum(fn(x) * w) / dx under jit, with distinct weights so a misrouted gradient cannot pass."""
    with jax.enable_x64(True):
        shape = jax.eval_shape(fn, x).shape
        w = jnp.arange(1, int(np.prod(shape)) + 1, dtype=jnp.float64).reshape(shape)
        return np.asarray(jax.jit(jax.grad(lambda v: jnp.sum(fn(v) * w)))(x)), np.asarray(w)


# ---- shape queries fold at trace time ------------------------------------------------------------------------


def test_shape_of_traced_value_is_static_numpy():
    seen = []

    @jax.jit
    def traced(x):
        seen.append((shape_ops.shape(x, start=1), shape_ops.size(x)))
        return x

    traced(jnp.zeros((2, 3, 4)))
    (dims, count), = seen
    assert isinstance(dims, np.ndarray) and dims.dtype == np.int64 and dims.tolist() == [3, 4]
    assert isinstance(count, np.ndarray) and count.dtype == np.int64 and count == 24


def test_shape_arithmetic_on_traced_input_needs_no_recompilation():
    """Reshape(x, Concat(Shape(y), [-1])) with traced x and y: the shape folds, no feed is frozen."""
    nodes = [
        helper.make_node("Shape", ["y"], ["s"], end=1),
        helper.make_node("Concat", ["s", "minus_one"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["out"]),
    ]
    graph = helper.make_graph(
        nodes,
        "fold",
        [helper.make_tensor_value_info("x", TensorProto.INT64, [12]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 5])],
        [helper.make_empty_tensor_value_info("out")],
        initializer=[numpy_helper.from_array(ints(-1), "minus_one")],
    )
    engine = onnxtrain.load(helper.make_model(graph), check=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # freezing a feed into the executable warns
        for offset in (0, 1):
            x = np.arange(12, dtype=np.int64) + BIG + offset
            out = np.asarray(engine.infer({"x": x, "y": np.zeros((3, 5), np.float32)})["out"])
            np.testing.assert_array_equal(out, x.reshape(3, 4))
    assert engine.trace_count == 1


@pytest.mark.parametrize(("start", "end"), [(0, None), (-1, None), (1, -1), (-10, 10), (3, 1), (2, 2)])
def test_shape_start_end(start, end):
    attrs = {"start": start} if end is None else {"start": start, "end": end}
    assert_exact("Shape", {"x": np.zeros((2, 3, 4), np.float32)}, **attrs)


def test_size_of_empty_and_scalar():
    assert_exact("Size", {"x": np.zeros((3, 0, 2), np.int64)})
    assert_exact("Size", {"x": np.array(1.5)})


# ---- views ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "allowzero"),
    [(ints(0, -1), 0), (ints(0, 3, 2), 0), (ints(), 0), (ints(-1), 0), (ints(0, 3), 1)],
)
def test_reshape_int64_stays_exact(target, allowzero):
    data = (np.arange(12) + BIG).astype(np.int64).reshape(2, 6) if target.size else np.array([BIG], np.int64)
    if allowzero:
        data = np.zeros((0, 3), np.int64)
    assert_exact("Reshape", {"data": data, "shape": target}, allowzero=allowzero)


def test_reshape_old_opsets():
    data = np.arange(24.0).reshape(2, 3, 4)
    assert_exact("Reshape", {"data": data, "shape": ints(4, 0, -1)}, opset=5)
    model = node_model("Reshape", {"data": data}, opset=1, shape=[0, -1])
    (out,), _ = run(model, {"data": data})
    np.testing.assert_array_equal(out, data.reshape(2, 12))


@pytest.mark.parametrize("axis", [0, 1, 3, -1, -3])
def test_flatten_axes(axis):
    assert_exact("Flatten", {"x": (np.arange(24) + BIG).astype(np.int64).reshape(2, 3, 1, 4)}, axis=axis)


@pytest.mark.parametrize("opset", [9, 11, 13])
def test_flatten_old_opsets(opset):
    assert_exact("Flatten", {"x": np.arange(24.0).reshape(2, 3, 4)}, opset=opset, axis=2)


def test_squeeze_unsqueeze_inputs_and_old_attributes():
    x = np.arange(6, dtype=np.int64).reshape(1, 2, 1, 3) + BIG
    assert_exact("Squeeze", {"x": x, "axes": ints(-2, 0)})
    assert_exact("Squeeze", {"x": x})
    assert_exact("Squeeze", {"x": x}, opset=11, axes=[-2])
    assert_exact("Squeeze", {"x": x}, opset=1, axes=[0, 2])
    assert_exact("Unsqueeze", {"x": x, "axes": ints(-1, 0, 3)})
    assert_exact("Unsqueeze", {"x": x}, opset=11, axes=[-1, 1])
    assert_exact("Unsqueeze", {"x": x}, opset=1, axes=[0, 5])


def test_squeeze_error_names_the_axis():
    model = node_model("Squeeze", {"x": np.zeros((1, 2), np.float32), "axes": ints(1)})
    with pytest.raises(NodeError, match=r"Squeeze.*cannot squeeze axes \[1\]"):
        run(model, {"x": np.zeros((1, 2), np.float32), "axes": ints(1)})


def test_unsqueeze_rejects_repeated_axes():
    model = node_model("Unsqueeze", {"x": np.zeros(2, np.float32), "axes": ints(0, -3)})
    with pytest.raises(NodeError, match="repeat"):
        run(model, {"x": np.zeros(2, np.float32), "axes": ints(0, -3)})


@pytest.mark.parametrize("perm", [None, [1, 2, 0], [0, 2, 1]])
def test_transpose(perm):
    attrs = {} if perm is None else {"perm": perm}
    assert_exact("Transpose", {"x": (np.arange(24) + BIG).astype(np.int64).reshape(2, 3, 4)}, **attrs)


def test_identity_passes_sequences_and_empty_optionals():
    assert shape_ops.identity() is None
    items = [np.zeros(2), np.ones(3)]
    assert shape_ops.identity(items) is items
    assert_exact("Identity", {"x": np.array([BIG], np.int64)})


# ---- joining and splitting -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("axis", "opset"), [(0, None), (-1, None), (1, 4)])
def test_concat(axis, opset):
    a = (np.arange(6) + BIG).astype(np.int64).reshape(2, 3)
    b = np.full((2, 3), -BIG, np.int64)
    assert_exact("Concat", {"a": a, "b": b, "c": np.zeros((2, 3), np.int64)}, axis=axis, opset=opset)


def test_concat_with_empty_input():
    assert_exact("Concat", {"a": np.zeros((0,), np.float64), "b": np.arange(3.0)}, axis=0)


@pytest.mark.parametrize(
    ("opset", "inputs", "attrs", "n_outputs"),
    [
        (18, {}, {"num_outputs": 3, "axis": 1}, 3),  # 7 does not divide by 3: the last part is smaller
        (18, {"split": ints(2, 0, 5)}, {"axis": -1}, 3),
        (13, {"split": ints(1, 6)}, {"axis": 1}, 2),
        (13, {}, {"axis": 0}, 2),
        (11, {}, {"split": [3, 4], "axis": -1}, 2),
        (2, {}, {"axis": 0}, 2),
    ],
)
def test_split_versions(opset, inputs, attrs, n_outputs):
    x = (np.arange(28) + BIG).astype(np.int64).reshape(4, 7)
    assert_exact("Split", {"x": x, **inputs}, n_outputs, opset=opset, **attrs)


def test_split_1_reads_its_float_sizes_from_an_initializer():
    """Split-1 types its `split` input like its data (T: float); as an initializer it is a float weight, traced
    unless read when traced, and had been a StaticValueRequired."""
    x = np.arange(12, dtype=np.float32).reshape(2, 6)
    graph = helper.make_graph([helper.make_node("Split", ["x", "split"], ["a", "b"], axis=1)], "split1",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6])],
                              [helper.make_empty_tensor_value_info(o) for o in "ab"],
                              [numpy_helper.from_array(np.array([2, 4], np.float32), "split")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 1)], ir_version=3)
    a, b = run(model, {"x": x})[0]
    np.testing.assert_array_equal(a, x[:, :2])
    np.testing.assert_array_equal(b, x[:, 2:])


def test_split_bad_sizes_error():
    x = np.zeros((4, 7), np.float32)
    model = node_model("Split", {"x": x, "split": ints(2, 2)}, 2, axis=1)
    with pytest.raises(NodeError, match="do not add up"):
        run(model, {"x": x, "split": ints(2, 2)})


# ---- slicing -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("starts", "ends", "axes", "steps"),
    [
        ((1, 0), (3, -1), (0, 1), (1, 2)),
        ((-1,), (INT64_MIN,), (1,), (-1,)),
        ((INT64_MAX,), (0,), (-1,), (-2,)),
        ((2, -100), (100, 100), (0, 1), (3, 1)),
        ((4, 5), (0, 0), (0, 1), (-3, -2)),
        ((3,), (3,), (0,), (1,)),
    ],
)
def test_slice_steps_and_clamping(starts, ends, axes, steps):
    x = (np.arange(42) + BIG).astype(np.int64).reshape(6, 7)
    feeds = {"x": x, "starts": ints(*starts), "ends": ints(*ends), "axes": ints(*axes), "steps": ints(*steps)}
    assert_exact("Slice", feeds)


def test_slice_negative_step_clamps_start_into_range():
    """The spec clamps a too-negative start to 0 for a negative step, so the first element is taken."""
    x = np.arange(5.0)
    feeds = {"x": x, "starts": ints(-10), "ends": ints(-20), "axes": ints(0), "steps": ints(-1)}
    (out,), _ = run(node_model("Slice", feeds), feeds)
    np.testing.assert_array_equal(out, [0.0])


def test_slice_opset1_attributes_and_opset10():
    x = np.arange(24.0).reshape(2, 3, 4)
    assert_exact("Slice", {"x": x}, opset=1, starts=[1, -3], ends=[1000, -1], axes=[2, 1])
    assert_exact("Slice", {"x": x}, opset=1, starts=[0, 1], ends=[1, 3])
    assert_exact("Slice", {"x": x, "starts": ints(1), "ends": ints(3), "axes": ints(-1)}, opset=10)


def test_slice_gradient_routes_to_the_sliced_elements():
    x = np.arange(7.0)
    g, w = grad(lambda v: shape_ops.slice_axes(v, [5], [0], [0], [-2]), x)  # takes x[5], x[3], x[1]
    expected = np.zeros(7)
    expected[[5, 3, 1]] = w
    np.testing.assert_array_equal(g, expected)


def test_slice_step_zero_error():
    x = np.zeros(4, np.float32)
    feeds = {"x": x, "starts": ints(0), "ends": ints(4), "axes": ints(0), "steps": ints(0)}
    with pytest.raises(NodeError, match="step cannot be 0"):
        run(node_model("Slice", feeds), feeds)


# ---- broadcasting and repetition -----------------------------------------------------------------------------


@pytest.mark.parametrize("target", [ints(2, 1, 1), ints(4), ints(3, 1, 4), ints(1)])
def test_expand_is_bidirectional(target):
    assert_exact("Expand", {"x": (np.arange(4) + BIG).astype(np.int64).reshape(1, 4), "shape": target})


@pytest.mark.parametrize("opset", [6, 13])
def test_tile(opset):
    assert_exact("Tile", {"x": (np.arange(6) + BIG).astype(np.int64).reshape(2, 3), "r": ints(2, 1)}, opset=opset)


def test_tile_opset1_repeats_along_one_axis():
    x = np.arange(6.0).reshape(2, 3)
    # Tile-1 gives input, tiles and axis one type T (a float type)
    feeds = {"x": x, "tiles": np.array(3.0), "axis": np.array(-1.0)}
    (out,), _ = run(node_model("Tile", feeds, opset=1), feeds)
    np.testing.assert_array_equal(out, np.tile(x, (1, 3)))


# ---- padding -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge", "wrap"])
@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_pad_modes(mode, dtype):
    x = (np.arange(12) + (BIG if dtype == np.int64 else 0)).astype(dtype).reshape(3, 4)
    feeds = {"x": x, "pads": ints(1, 2, 2, 3)}
    if mode == "constant":
        feeds["value"] = np.array(-7, dtype)
    assert_exact("Pad", feeds, mode=mode)


@pytest.mark.parametrize(
    ("mode", "pads", "expected"),
    [
        # axis 0 loses its first row and gains a row of zeros; axis 1 gains two columns and loses its last two
        ("constant", (-1, 2, 1, -2), lambda x: np.pad(x[1:, :3], ((0, 1), (2, 0)))),
        ("edge", (-1, 2, -1, 1), lambda x: np.pad(x[1:-1], ((0, 0), (2, 1)), mode="edge")),
        ("reflect", (-1, 2, -1, 1), lambda x: np.pad(x[1:-1], ((0, 0), (2, 1)), mode="reflect")),
        ("wrap", (0, -2, 0, 3), lambda x: np.pad(x[:, 2:], ((0, 0), (0, 3)), mode="wrap")),
    ],
)
def test_pad_negative_pads_crop(mode, pads, expected):
    x = np.arange(20.0).reshape(4, 5)
    feeds = {"x": x, "pads": ints(*pads)}
    (out,), _ = run(node_model("Pad", feeds, mode=mode), feeds)
    np.testing.assert_array_equal(out, expected(x))


def test_pad_axes_input():
    x = np.arange(24.0).reshape(2, 3, 4)
    assert_exact("Pad", {"x": x, "pads": ints(1, 0, 2, 1), "value": np.array(5.0), "axes": ints(-1, 0)})


def test_pad_traced_constant_value_compiles_once():
    x = np.arange(6.0, dtype=np.float32).reshape(2, 3)
    model = node_model("Pad", {"x": x, "pads": ints(1, 1, 1, 1), "value": np.array(0, np.float32)})
    engine = onnxtrain.load(model, check=False)
    for value in (1.5, -2.0):
        out = np.asarray(engine.infer({"x": x, "pads": ints(1, 1, 1, 1), "value": np.array(value, np.float32)})["out0"])
        np.testing.assert_array_equal(out, np.pad(x, 1, constant_values=value))
    assert engine.trace_count == 1  # pads is frozen (one value), the fill value stays traced


@pytest.mark.parametrize(("opset", "attrs"), [(2, {"pads": [0, 1, 2, 0], "mode": "reflect"}),
                                               (2, {"pads": [1, 0, 0, 1], "value": 3.0}),
                                               (1, {"paddings": [0, 1, 1, 0], "mode": "edge"})])
def test_pad_attribute_opsets(opset, attrs):
    assert_exact("Pad", {"x": np.arange(12.0, dtype=np.float32).reshape(3, 4)}, opset=opset, **attrs)


def test_pad_reflect_gradient_counts_each_source():
    x = np.arange(5.0)
    g, w = grad(lambda v: shape_ops.pad_axes(v, [2, 3], "reflect", None), x)
    source = np.pad(np.arange(5), (2, 3), mode="reflect")  # which input element each output copies
    np.testing.assert_array_equal(g, np.bincount(source, weights=w, minlength=5))


def test_center_crop_pad_odd_differences():
    x = np.arange(35.0).reshape(5, 7)
    assert_exact("CenterCropPad", {"x": x, "shape": ints(2, 10)})
    assert_exact("CenterCropPad", {"x": x, "shape": ints(8)}, axes=[-2])


# ---- block rearrangements ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("opset", "mode"), [(1, None), (11, "CRD"), (13, "DCR")])
def test_depth_to_space(opset, mode):
    x = (np.arange(2 * 8 * 2 * 3) + BIG).astype(np.int64).reshape(2, 8, 2, 3)
    attrs = {} if mode is None else {"mode": mode}
    assert_exact("DepthToSpace", {"x": x}, opset=opset, blocksize=2, **attrs)


@pytest.mark.parametrize(("opset", "mode"), [(13, None), (28, "DCR"), (28, "CRD")])
def test_space_to_depth(opset, mode):
    x = np.arange(2 * 3 * 4 * 6, dtype=np.float32).reshape(2, 3, 4, 6)
    attrs = {} if mode is None else {"mode": mode}
    assert_exact("SpaceToDepth", {"x": x}, opset=opset, blocksize=2, **attrs)


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_depth_to_space_inverts_space_to_depth(mode):
    x = jnp.arange(2 * 3 * 4 * 6.0).reshape(2, 3, 4, 6)
    round_trip = jax.jit(lambda v: shape_ops.depth_to_space(shape_ops.space_to_depth(v, blocksize=2, mode=mode),
                                                            blocksize=2, mode=mode))
    np.testing.assert_array_equal(round_trip(x), x)


@pytest.mark.parametrize(
    "attrs",
    [{}, {"strides": [2, 1], "pads": [1, 0, 1, 2], "dilations": [1, 2]}, {"dilations": [2, 2]}],
)
def test_col2im(attrs):
    image, block = ints(6, 7), ints(2, 3)
    strides, dilations, pads = attrs.get("strides", [1, 1]), attrs.get("dilations", [1, 1]), attrs.get("pads", [0] * 4)
    counts = [(image[d] + pads[d] + pads[d + 2] - dilations[d] * (block[d] - 1) - 1) // strides[d] + 1 for d in (0, 1)]
    x = np.random.default_rng(0).normal(size=(2, 3 * 6, counts[0] * counts[1]))
    assert_exact("Col2Im", {"x": x, "image_shape": image, "block_shape": block}, **attrs)


def test_col2im_gradient_is_im2col():
    """Col2Im is linear, so its gradient at any point gathers the cotangent image into columns."""
    x = np.zeros((1, 4, 4))  # C=1, block 2x2 over a 3x3 image: 2x2 = 4 block positions
    g, w = grad(lambda v: shape_ops.col2im(v, ints(3, 3), ints(2, 2)), x)
    windows = np.lib.stride_tricks.sliding_window_view(w[0, 0], (2, 2))  # [2, 2, 2, 2]: position, offset
    np.testing.assert_array_equal(g[0], windows.reshape(4, 4).T)


# ---- builders ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("start", "limit", "delta", "dtype"),
    [(BIG, BIG + 10, 3, np.int64), (10, -3, -4, np.int32), (1.0, 2.0, 0.1, np.float32), (0.5, -1.0, -0.25, np.float64),
     (5, 5, 1, np.int16), (0.0, 100.0, 7.5, np.float16)],
)
def test_range(start, limit, delta, dtype):
    feeds = {"a": np.array(start, dtype), "b": np.array(limit, dtype), "c": np.array(delta, dtype)}
    assert_exact("Range", feeds)
    assert_exact("Range", feeds, opset=11)


def test_range_delta_zero_error():
    feeds = {"a": np.array(0, np.int64), "b": np.array(3, np.int64), "c": np.array(0, np.int64)}
    with pytest.raises(NodeError, match="delta cannot be 0"):
        run(node_model("Range", feeds), feeds)


@pytest.mark.parametrize("value", [None, np.array([BIG], np.int64), np.array([True]), np.array([0.5], np.float16)])
def test_constant_of_shape(value):
    attrs = {} if value is None else {"value": numpy_helper.from_array(value, "value")}
    assert_exact("ConstantOfShape", {"shape": ints(2, 0, 3)}, **attrs)
    assert_exact("ConstantOfShape", {"shape": ints(2, 3)}, opset=9, **attrs)


@pytest.mark.parametrize(
    ("attr", "value", "expected"),
    [
        ("value_int", BIG, np.array(BIG, np.int64)),
        ("value_ints", [BIG, -1], np.array([BIG, -1], np.int64)),
        ("value_float", 0.1, np.array(0.1, np.float32)),
        ("value_floats", [0.5, 2.0], np.array([0.5, 2.0], np.float32)),
        ("value", numpy_helper.from_array(np.array([[1, 2]], np.uint16)), np.array([[1, 2]], np.uint16)),
    ],
)
def test_constant_attributes(attr, value, expected):
    (out,), _ = run(node_model("Constant", {}, **{attr: value}), {})
    assert out.dtype == expected.dtype
    np.testing.assert_array_equal(out, expected)


def test_constant_strings():
    assert creation.constant(value_strings=["a", "bc"]).tolist() == ["a", "bc"]
    assert creation.constant(value_string="x").dtype == object


@pytest.mark.parametrize(("k", "dtype"), [(0, None), (1, TensorProto.INT64), (-2, TensorProto.DOUBLE), (5, None)])
def test_eye_like(k, dtype):
    attrs = {"k": k} if dtype is None else {"k": k, "dtype": dtype}
    assert_exact("EyeLike", {"x": np.zeros((3, 4), np.int32)}, **attrs)
    assert_exact("EyeLike", {"x": np.zeros((4, 2), np.float32)}, opset=9, **attrs)


@pytest.mark.parametrize("upper", [0, 1])
@pytest.mark.parametrize("k", [None, -1, 2, 10])
def test_trilu_batched(upper, k):
    feeds = {"x": (np.arange(2 * 3 * 4) + BIG).astype(np.int64).reshape(2, 3, 4)}
    if k is not None:
        feeds["k"] = np.array(k, np.int64)
    assert_exact("Trilu", feeds, upper=upper)


def test_reshape_size_mismatch_is_a_node_error():
    feeds = {"x": np.zeros((2, 3), np.float32), "shape": ints(4, 2)}
    with pytest.raises(NodeError, match="Reshape"):
        run(node_model("Reshape", feeds), feeds)


# ---- string tensors move like any other ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("op_type", "inputs", "n_outputs", "attrs"),
    [
        ("Reshape", {"shape": ints(3, -1)}, 1, {}),
        ("Transpose", {}, 1, {"perm": [1, 0]}),
        ("Slice", {"starts": ints(-1, 0), "ends": ints(INT64_MIN, 2), "axes": ints(1, 0), "steps": ints(-2, 1)}, 1, {}),
        ("Split", {}, 2, {"axis": 1, "num_outputs": 2}),
        ("Tile", {"repeats": ints(1, 2)}, 1, {}),
        ("Unsqueeze", {"axes": ints(0)}, 1, {}),
    ],
)
def test_string_tensors(op_type, inputs, n_outputs, attrs):
    text = np.array([["a", "bb", "ccc", "d"], ["e", "f", "", "h"], ["i", "j", "k", "l"]], dtype=object)
    ours, theirs = run_both(node_model(op_type, {"text": text, **inputs}, n_outputs, **attrs), {"text": text, **inputs})
    for mine, ref in zip(ours, theirs):
        assert mine.dtype == object
        assert mine.tolist() == ref.tolist()


def test_string_concat_of_several_inputs():
    a = np.array([["x", "y"]], dtype=object)
    b = np.array([["z", "w"], ["u", "v"]], dtype=object)
    (out,), _ = run(node_model("Concat", {"a": a, "b": b}, axis=0), {"a": a, "b": b})
    assert out.tolist() == [["x", "y"], ["z", "w"], ["u", "v"]]
