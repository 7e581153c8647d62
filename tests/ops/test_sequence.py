"""Sequence and optional ops: positions (negative, traced), dtypes, SequenceMap over mixed inputs, and sequences
flowing through a traced graph. Reference: onnx's ReferenceEvaluator."""

import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import onnxtrain
from onnxtrain.errors import NodeError
from nodes import value as info, graph_model as model

F, I64 = TensorProto.FLOAT, TensorProto.INT64
OPSET = 21


def flat(values):
    """Outputs with sequences spread out, so sequences and tensors compare alike."""
    out = []
    for v in values:
        if isinstance(v, list):
            out.append(("sequence", len(v)))
            out.extend(flat(v))
        else:
            out.append(np.asarray(v))
    return out


def check(m, feeds, engine=None):
    """Run `m` both ways and compare every value (dtype, shape, data); returns the engine for reuse."""
    engine = engine or onnxtrain.load(m, check=False)
    got = engine.infer(feeds)
    ours = flat([got[n] for n in engine.output_names])
    theirs = flat(ReferenceEvaluator(m).run(None, feeds))
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        if isinstance(b, tuple):
            assert a == b
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
        np.testing.assert_array_equal(a, b)
    return engine


def three(dtype=np.float32):
    """A sequence of three tensors of different lengths built from feeds a, b, c."""
    feeds = {"a": np.arange(2, dtype=dtype), "b": np.arange(3, dtype=dtype) + 10, "c": np.arange(4, dtype=dtype) - 7}
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inputs = [info(n, elem, [len(v)]) for n, v in feeds.items()]
    return helper.make_node("SequenceConstruct", list(feeds), ["seq"]), inputs, feeds


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.float16])
@pytest.mark.parametrize("position", [0, 2, -1, -3])
def test_sequence_at_static_positions(dtype, position):
    construct, inputs, feeds = three(dtype)
    at = helper.make_node("SequenceAt", ["seq", "pos"], ["y"])
    check(model([construct, at], inputs, ["y"], initializers={"pos": np.array(position, np.int64)}), feeds)


def test_sequence_at_traced_position_on_uniform_tensors_compiles_once():
    construct = helper.make_node("SequenceConstruct", ["a", "b", "c"], ["seq"])
    at = helper.make_node("SequenceAt", ["seq", "pos"], ["y"])
    m = model([construct, at], [info(n, F, [2]) for n in "abc"] + [info("pos", I64, [])], ["y"])
    engine = None
    for position in (0, 2, -1, -2):
        feeds = {"a": np.float32([1, 2]), "b": np.float32([3, 4]), "c": np.float32([5, 6]),
                 "pos": np.array(position, np.int64)}
        engine = check(m, feeds, engine)
    assert engine.trace_count == 1


def test_sequence_at_traced_position_on_ragged_tensors_specialises():
    construct, inputs, feeds = three()
    at = helper.make_node("SequenceAt", ["seq", "pos"], ["y"])
    m = model([construct, at], inputs + [info("pos", TensorProto.INT32, [])], ["y"])
    engine = None
    for position in (1, -1):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = check(m, {**feeds, "pos": np.array(position, np.int32)}, engine)


@pytest.mark.parametrize("position", [None, 0, 1, -1, -3])
def test_sequence_insert(position):
    construct, inputs, feeds = three()
    args = ["seq", "t"] + (["pos"] if position is not None else [])
    insert = helper.make_node("SequenceInsert", args, ["out"])
    consts = {} if position is None else {"pos": np.array(position, np.int64)}
    m = model([construct, insert], inputs + [info("t", F, [1])], ["out"], initializers=consts)
    check(m, {**feeds, "t": np.float32([42])})


@pytest.mark.parametrize("position", [None, 0, 2, -1, -3])
def test_sequence_erase_and_length(position):
    construct, inputs, feeds = three(np.int64)
    erase = helper.make_node("SequenceErase", ["seq"] + (["pos"] if position is not None else []), ["out"])
    length = helper.make_node("SequenceLength", ["out"], ["n"])
    consts = {} if position is None else {"pos": np.array(position, np.int32)}
    check(model([construct, erase, length], inputs, ["out", "n"], initializers=consts), feeds)


def test_sequence_insert_at_n_appends():
    # the spec's range for insertion is [-n, n]; ReferenceEvaluator wraps n to the front, so NumPy checks it
    construct, inputs, feeds = three()
    insert = helper.make_node("SequenceInsert", ["seq", "t", "pos"], ["out"])
    m = model([construct, insert], inputs + [info("t", F, [1])], ["out"], initializers={"pos": np.array(3, np.int64)})
    got = onnxtrain.load(m, check=False).infer({**feeds, "t": np.float32([42])})["out"]
    assert [np.asarray(v).tolist() for v in got] == [v.tolist() for v in feeds.values()] + [[42.0]]


def test_sequence_positions_out_of_range_are_errors():
    construct, inputs, feeds = three()
    insert = helper.make_node("SequenceInsert", ["seq", "a", "pos"], ["out"])
    m = model([construct, insert], inputs, ["out"], initializers={"pos": np.array(4, np.int64)})
    with pytest.raises(NodeError, match="position 4 is out of range"):
        onnxtrain.load(m, check=False).infer(feeds)


def test_sequence_empty_then_insert():
    empty = helper.make_node("SequenceEmpty", [], ["s0"], dtype=TensorProto.INT64)
    insert = helper.make_node("SequenceInsert", ["s0", "x"], ["s1"])
    insert2 = helper.make_node("SequenceInsert", ["s1", "x", "zero"], ["s2"])
    length = helper.make_node("SequenceLength", ["s2"], ["n"])
    m = model([empty, insert, insert2, length], [info("x", I64, [2])], ["s2", "n"],
              initializers={"zero": np.array(0, np.int64)})
    check(m, {"x": np.array([2**40 + 1, -3], np.int64)})


@pytest.mark.parametrize(("axis", "new_axis"), [(0, 0), (1, 0), (-1, 0), (0, 1), (1, 1), (-1, 1), (2, 1)])
def test_concat_from_sequence(axis, new_axis):
    construct = helper.make_node("SequenceConstruct", ["a", "b"], ["seq"])
    concat = helper.make_node("ConcatFromSequence", ["seq"], ["y"], axis=axis, new_axis=new_axis)
    m = model([construct, concat], [info("a", F, [2, 3]), info("b", F, [2, 3])], ["y"])
    check(m, {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": -np.arange(6, dtype=np.float32).reshape(2, 3)})


@pytest.mark.parametrize(
    ("split", "axis", "keepdims"),
    [(None, 0, 1), (None, 1, 0), (None, -1, 0), (np.array(2, np.int64), 1, 1), (np.array(3, np.int32), -1, 0),
     (np.array([1, 3, 1], np.int64), 1, 1), (np.array([2, 1], np.int64), 0, 0)],
)
def test_split_to_sequence(split, axis, keepdims):
    args = ["x"] + (["split"] if split is not None else [])
    node = helper.make_node("SplitToSequence", args, ["seq"], axis=axis, keepdims=keepdims)
    consts = {} if split is None else {"split": split}
    m = model([node], [info("x", F, [3, 5])], ["seq"], initializers=consts)
    check(m, {"x": np.arange(15, dtype=np.float32).reshape(3, 5)})


def test_split_to_sequence_bad_split_is_an_error():
    node = helper.make_node("SplitToSequence", ["x", "split"], ["seq"], axis=0)
    m = model([node], [info("x", F, [3])], ["seq"], initializers={"split": np.array([1, 1], np.int64)})
    with pytest.raises(NodeError, match="does not sum"):
        onnxtrain.load(m, check=False).infer({"x": np.zeros(3, np.float32)})


def test_sequence_map_with_a_sequence_and_a_tensor_and_two_outputs():
    body = helper.make_graph(
        [helper.make_node("Add", ["x", "k"], ["y"]), helper.make_node("Shape", ["x"], ["shape"])],
        "body", [info("x", F, None), info("k", F, [1])], [info("y", F, None), info("shape", I64, None)],
    )
    construct, inputs, feeds = three()
    node = helper.make_node("SequenceMap", ["seq", "k"], ["ys", "shapes"], body=body)
    m = model([construct, node], inputs + [info("k", F, [1])], ["ys", "shapes"])
    check(m, {**feeds, "k": np.float32([0.5])})


def test_sequence_map_over_two_sequences_reads_the_outer_scope():
    body = helper.make_graph(
        [helper.make_node("Mul", ["x", "y"], ["xy"]), helper.make_node("Add", ["xy", "outer"], ["z"])],
        "body", [info("x", F, None), info("y", F, None)], [info("z", F, None)],
    )
    construct, inputs, feeds = three()
    other = helper.make_node("SequenceConstruct", ["c", "b", "a"], ["rev"])
    split = helper.make_node("SplitToSequence", ["flat"], ["pieces"], axis=0)
    reshape = helper.make_node("SequenceConstruct", ["a", "a", "a"], ["twins"])
    node = helper.make_node("SequenceMap", ["twins", "pieces"], ["zs"], body=body)
    m = model([construct, other, split, reshape, node], inputs + [info("flat", F, [3, 2]), info("outer", F, [])],
              ["zs"])
    flat_ = np.arange(6, dtype=np.float32).reshape(3, 2)
    got = onnxtrain.load(m, check=False).infer({**feeds, "flat": flat_, "outer": np.float32(100)})["zs"]
    # ReferenceEvaluator's SequenceMap does not pass the outer scope to its body: NumPy is the reference
    for z, row in zip(got, flat_):
        np.testing.assert_array_equal(z, feeds["a"] * row[None] + 100)
        assert z.dtype == np.float32 and z.shape == (1, 2)


def test_sequence_through_a_traced_graph_keeps_dtypes():
    # a sequence of traced int64 tensors survives jit as a list, values exact beyond float64's range
    construct = helper.make_node("SequenceConstruct", ["a", "b"], ["seq"])
    insert = helper.make_node("SequenceInsert", ["seq", "a", "one"], ["seq2"])
    concat = helper.make_node("ConcatFromSequence", ["seq2"], ["y"], axis=0)
    m = model([construct, insert, concat], [info("a", I64, [2]), info("b", I64, [1])], ["seq2", "y"],
              initializers={"one": np.array(1, np.int64)})
    check(m, {"a": np.array([2**53 + 1, 7], np.int64), "b": np.array([-(2**60)], np.int64)})


# ---- optionals -------------------------------------------------------------------------------------------------
# ReferenceEvaluator's Optional wraps its value in a list (and an empty optional in [None]), so these tests state
# the expected values themselves.


def infer(m, feeds):
    engine = onnxtrain.load(m, check=False)
    got = engine.infer(feeds)
    return [got[n] for n in engine.output_names]


def test_optional_of_a_tensor_and_an_empty_optional():
    tensor_type = helper.make_tensor_type_proto(F, [2])
    nodes = [
        helper.make_node("Optional", ["x"], ["full"]),
        helper.make_node("Optional", [], ["empty"], type=tensor_type),
        helper.make_node("OptionalHasElement", ["full"], ["has_full"]),
        helper.make_node("OptionalHasElement", ["empty"], ["has_empty"]),
        helper.make_node("OptionalHasElement", [], ["has_nothing"]),
        helper.make_node("OptionalGetElement", ["full"], ["got"]),
        helper.make_node("OptionalGetElement", ["x"], ["got_tensor"]),  # opset 18+: a plain tensor passes through
    ]
    m = model(nodes, [info("x", F, [2])], ["has_full", "has_empty", "has_nothing", "got", "got_tensor", "empty"])
    has_full, has_empty, has_nothing, got, got_tensor, empty = infer(m, {"x": np.float32([1, 2])})
    assert [bool(has_full), bool(has_empty), bool(has_nothing)] == [True, False, False]
    assert np.asarray(has_full).dtype == np.bool_ and np.shape(has_full) == ()
    np.testing.assert_array_equal(got, [1, 2])
    np.testing.assert_array_equal(got_tensor, [1, 2])
    assert empty is None


def test_optional_of_a_sequence_and_of_an_empty_sequence():
    nodes = [
        helper.make_node("SequenceConstruct", ["x"], ["seq"]),
        helper.make_node("Optional", ["seq"], ["opt"]),
        helper.make_node("OptionalGetElement", ["opt"], ["got"]),
        helper.make_node("OptionalHasElement", ["opt"], ["has"]),
        helper.make_node("SequenceErase", ["seq"], ["nothing_left"]),
        helper.make_node("Optional", ["nothing_left"], ["opt_empty_seq"]),
        helper.make_node("OptionalHasElement", ["opt_empty_seq"], ["has_empty_seq"]),
    ]
    got, has, has_empty_seq = infer(model(nodes, [info("x", F, [2])], ["got", "has", "has_empty_seq"]),
                                    {"x": np.float32([1, 2])})
    assert len(got) == 1 and np.asarray(got[0]).tolist() == [1, 2]
    assert bool(has) and bool(has_empty_seq)  # an optional holding an empty sequence is not empty


def test_optional_get_element_of_an_empty_optional_is_an_error():
    nodes = [helper.make_node("Optional", [], ["empty"], type=helper.make_tensor_type_proto(F, [2])),
             helper.make_node("OptionalGetElement", ["empty"], ["y"])]
    with pytest.raises(NodeError, match="empty"):
        infer(model(nodes, [], ["y"]), {})


def test_an_empty_optional_is_a_value_for_a_required_input():
    """An empty optional (None) fed for a required input is a value: OptionalHasElement-15 says False and Identity-16
    passes it on, as ONNX Runtime does (onnx's reference cannot return None); the trace refused it as an input a
    function call left out (that check runs in function bodies only, where a left-out input is None too)."""
    ort = pytest.importorskip("onnxruntime")
    optional = helper.make_optional_type_proto(helper.make_tensor_type_proto(F, [2]))
    nodes = [helper.make_node("OptionalHasElement", ["o"], ["has"]), helper.make_node("Identity", ["o"], ["same"])]
    m = model(nodes, [helper.make_value_info("o", optional)], ["has", "same"], opset=16)
    m.graph.output[1].type.CopyFrom(optional)  # ONNX Runtime's inference wants the optional declared
    has, same = infer(m, {"o": None})
    expected_has, expected_same = ort.InferenceSession(m.SerializeToString()).run(None, {"o": None})
    assert bool(has) is bool(expected_has) is False and np.shape(has) == ()
    assert same is expected_same is None


@pytest.mark.parametrize("opset", [15, 18])
def test_optional_has_element_old_opsets(opset):
    nodes = [helper.make_node("Optional", ["x"], ["opt"]), helper.make_node("OptionalHasElement", ["opt"], ["has"])]
    assert bool(infer(model(nodes, [info("x", F, [2])], ["has"], opset=opset), {"x": np.float32([1, 2])})[0])
