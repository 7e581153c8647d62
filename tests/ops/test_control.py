"""If / Loop / Scan: what conformance leaves out (traced conditions and trip counts under jit, nested subgraphs
reading outer scopes, gradients, fallbacks). References: onnx's ReferenceEvaluator, or NumPy in the test."""

import copy
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxtrain.errors import StaticValueRequired
from onnxtrain.lower.build import build_graph, model_resolver
from onnxtrain.lower.ops import control
from onnxtrain.lower.walker import TraceContext, run_graph
from nodes import run_with_engine as run, value as info, graph_model as model

F, I64, BOOL = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL
OPSET = 21


def body(nodes, inputs, outputs, initializers=()):
    return helper.make_graph(
        nodes, "body", inputs, [info(o, 0) for o in outputs],
        [numpy_helper.from_array(v, n) for n, v in dict(initializers).items()],
    )


def reference(m, feeds):
    """ReferenceEvaluator's outputs. It runs no iteration of a Loop without `cond` (it tests `while cond`), so
    such loops get a constant true `cond` there, which the spec makes equivalent when the body passes it on."""
    m = copy.deepcopy(m)
    for node in m.graph.node:
        if node.op_type == "Loop" and len(node.input) > 1 and not node.input[1]:
            node.input[1] = "always"
            m.graph.initializer.append(numpy_helper.from_array(np.array(True), "always"))
    return [np.asarray(v) for v in ReferenceEvaluator(m).run(None, feeds)]


def assert_same(ours, theirs):
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
        np.testing.assert_allclose(a, b, rtol=1e-6)


def graph_function(m):
    """The main graph as a plain function of its inputs, for jax.grad (what training differentiates)."""
    resolver = model_resolver(m)
    graph = build_graph(m.graph, resolver)
    trace = TraceContext(jax.random.key(0), resolver.functions)

    def fn(*args):
        with jax.enable_x64(True):
            return run_graph(graph, list(args), trace)

    return fn


def primitives(m, *args):
    """The primitives of the main graph's jaxpr with every argument traced, looking into custom-derivative
    wrappers (a run-time Loop is a while loop inside a custom_vjp_call)."""
    with jax.enable_x64(True):
        jaxpr = jax.make_jaxpr(graph_function(m))(*args)
    return jaxpr_primitives(jaxpr.jaxpr)


def jaxpr_primitives(jaxpr) -> set[str]:
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        if eqn.primitive.name.startswith("custom_"):
            inner = eqn.params.get("call_jaxpr") or eqn.params.get("fun_jaxpr")
            names |= jaxpr_primitives(getattr(inner, "jaxpr", inner))
    return names


# ---- If --------------------------------------------------------------------------------------------------------


def if_model(then_extra=(), else_extra=()):
    """y = If(c) then x + a else x * b; both branches read x, a, b from the outer graph."""
    then_ = body([helper.make_node("Add", ["x", "a"], ["t"]), *then_extra], [], ["t"])
    else_ = body([helper.make_node("Mul", ["x", "b"], ["e"]), *else_extra], [], ["e"])
    node = helper.make_node("If", ["c"], ["y"], then_branch=then_, else_branch=else_)
    return model([node], [info("c", BOOL, []), info("x", F, [3]), info("a", F, [3]), info("b", F, [3])], ["y"])


def test_if_traced_condition_compiles_once():
    m = if_model()
    engine = None
    for c in (True, False, True):
        feeds = {"c": np.array(c), "x": np.array([1, 2, 3], np.float32), "a": np.float32([10, 20, 30]),
                 "b": np.float32([2, 3, 4])}
        ours, engine = run(m, feeds, engine)
        assert_same(ours, reference(m, feeds))
    assert engine.trace_count == 1  # the condition stayed traced: lax.cond, not one compilation per value
    assert "cond" in primitives(m, *feeds.values())


def test_if_mismatched_branches_specialise_on_a_fed_condition():
    concat = helper.make_node("Concat", ["e", "e"], ["e2"], axis=0)
    then_ = body([helper.make_node("Add", ["x", "a"], ["t"])], [], ["t"])
    else_ = body([helper.make_node("Mul", ["x", "b"], ["e"]), concat], [], ["e2"])
    node = helper.make_node("If", ["c"], ["y"], then_branch=then_, else_branch=else_)
    m = model([node], [info("c", BOOL, []), info("x", F, [3]), info("a", F, [3]), info("b", F, [3])], ["y"])
    engine = None
    for c in (True, False):
        feeds = {"c": np.array(c), "x": np.float32([1, 2, 3]), "a": np.float32([1, 1, 1]), "b": np.float32([2, 2, 2])}
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            ours, engine = run(m, feeds, engine)
        assert_same(ours, reference(m, feeds))


def test_if_mismatch_on_a_traced_condition_is_a_clear_error():
    ctx = types.SimpleNamespace(node=types.SimpleNamespace(inputs=("flag",), label="If 'pick'"))
    then_branch = lambda: [jnp.zeros(3)]  # noqa: E731
    else_branch = lambda: [jnp.zeros(4)]  # noqa: E731
    with pytest.raises(StaticValueRequired) as raised:
        jax.jit(lambda c: control.if_(c, then_branch=then_branch, else_branch=else_branch, ctx=ctx))(True)
    message = str(raised.value)
    assert "If 'pick'" in message and "'flag'" in message
    assert "output 0 is float32[3] in then_branch but float32[4] in else_branch" in message


def test_if_static_condition_allows_different_branch_shapes():
    concat = helper.make_node("Concat", ["e", "e"], ["e2"], axis=0)
    then_ = body([helper.make_node("Add", ["x", "a"], ["t"])], [], ["t"])
    else_ = body([helper.make_node("Mul", ["x", "a"], ["e"]), concat], [], ["e2"])
    node = helper.make_node("If", ["c"], ["y"], then_branch=then_, else_branch=else_)
    for c in (True, False):
        m = model([node], [info("x", F, [3]), info("a", F, [3])], ["y"], initializers={"c": np.array(c)})
        feeds = {"x": np.float32([1, 2, 3]), "a": np.float32([4, 5, 6])}
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a constant condition needs no specialisation
            ours, _ = run(m, feeds)
        assert_same(ours, reference(m, feeds))


@pytest.mark.parametrize("taken", [True, False])
def test_if_gradient_reaches_only_the_taken_branch(taken):
    f = graph_function(if_model())
    x = np.array([1.0, 2.0, 3.0], np.float32)
    loss = lambda a, b, c: jnp.sum(f(c, x, a, b)[0] * jnp.array([1.0, 10.0, 100.0]))  # noqa: E731
    a, b = np.ones(3, np.float32), np.full(3, 2.0, np.float32)
    ga, gb = jax.jit(jax.grad(loss, argnums=(0, 1)))(a, b, np.array(taken))
    weights = np.array([1.0, 10.0, 100.0])
    np.testing.assert_allclose(ga, weights if taken else 0)
    np.testing.assert_allclose(gb, 0 if taken else weights * x)


def test_if_with_sequence_and_optional_outputs_on_a_static_condition():
    then_ = body([helper.make_node("SequenceConstruct", ["x", "x"], ["s"])], [], ["s"])
    else_ = body([helper.make_node("SequenceConstruct", ["x"], ["s"])], [], ["s"])
    node = helper.make_node("If", ["c"], ["y"], then_branch=then_, else_branch=else_)
    m = model([node, helper.make_node("SequenceLength", ["y"], ["n"])], [info("x", F, [2])], ["n"],
              initializers={"c": np.array(False)})
    ours, _ = run(m, {"x": np.float32([1, 2])})
    assert ours[0] == 1 and ours[0].dtype == np.int64


# ---- Loop ------------------------------------------------------------------------------------------------------


def loop_body(nodes, carried=("y",), scans=(), cond_out="cond_in"):
    inputs = [info("i", I64, []), info("cond_in", BOOL, [])] + [info(f"{v}_in", F, None) for v in carried]
    outputs = [cond_out] + [f"{v}_out" for v in carried] + list(scans)
    return body(nodes, inputs, outputs)


def test_loop_static_trip_count_traced_state_uses_one_scan():
    # y <- y * w + x, scanning y; M is a constant and the state is fed: lax.scan, compiled once
    nodes = [helper.make_node("Mul", ["y_in", "w"], ["yw"]), helper.make_node("Add", ["yw", "x"], ["y_out"]),
             helper.make_node("Identity", ["y_out"], ["s"])]
    loop = helper.make_node("Loop", ["M", "", "y0"], ["y", "ys"], body=loop_body(nodes, scans=["s"]))
    m = model([loop], [info("y0", F, [2]), info("w", F, [2]), info("x", F, [2])], ["y", "ys"],
              initializers={"M": np.array(4, np.int64)})
    engine = None
    for scale in (1.0, 2.0):
        feeds = {"y0": np.float32([1, 2]) * scale, "w": np.float32([0.5, 2]), "x": np.float32([1, -1])}
        ours, engine = run(m, feeds, engine)
        assert_same(ours, reference(m, feeds))
    assert ours[1].shape == (4, 2) and engine.trace_count == 1
    assert "scan" in primitives(m, *feeds.values())


def test_loop_traced_condition_without_scan_outputs_is_a_while_loop():
    # while y < limit: y = y * 2 (limit is fed, so the trip count is only known at run time)
    nodes = [helper.make_node("Add", ["y_in", "y_in"], ["y_out"]),
             helper.make_node("ReduceMax", ["y_out"], ["top"], keepdims=0),
             helper.make_node("Less", ["top", "limit"], ["go"])]
    loop = helper.make_node("Loop", ["", "c0", "y0"], ["y"], body=loop_body(nodes, cond_out="go"))
    m = model([loop], [info("c0", BOOL, []), info("y0", F, [2]), info("limit", F, [])], ["y"])
    engine = None
    for limit in (5.0, 100.0, 1000.0):
        feeds = {"c0": np.array(True), "y0": np.float32([1, 3]), "limit": np.float32(limit)}
        ours, engine = run(m, feeds, engine)
        assert_same(ours, reference(m, feeds))
    assert engine.trace_count == 1
    assert "while" in primitives(m, *feeds.values())


def test_loop_traced_trip_count_without_scan_outputs_is_a_while_loop():
    nodes = [helper.make_node("Cast", ["i"], ["fi"], to=F), helper.make_node("Add", ["y_in", "fi"], ["y_out"])]
    loop = helper.make_node("Loop", ["M", "", "y0"], ["y"], body=loop_body(nodes))
    m = model([loop], [info("M", I64, []), info("y0", F, [2])], ["y"])
    engine = None
    for trips in (0, 3, 7):
        feeds = {"M": np.array(trips, np.int64), "y0": np.float32([1, 2])}
        ours, engine = run(m, feeds, engine)
        np.testing.assert_allclose(ours[0], feeds["y0"] + trips * (trips - 1) / 2)
    assert engine.trace_count == 1
    assert "while" in primitives(m, *feeds.values())


def test_loop_scan_outputs_with_a_fed_trip_count_specialise_on_it():
    nodes = [helper.make_node("Add", ["y_in", "y_in"], ["y_out"]), helper.make_node("Identity", ["y_in"], ["s"])]
    loop = helper.make_node("Loop", ["M", "", "y0"], ["y", "ys"], body=loop_body(nodes, scans=["s"]))
    m = model([loop], [info("M", I64, []), info("y0", F, [2])], ["y", "ys"])
    engine = None
    for trips in (2, 5):
        feeds = {"M": np.array(trips, np.int64), "y0": np.float32([1, -1])}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ours, engine = run(m, feeds, engine)
        assert_same(ours, reference(m, feeds))
        assert any("compiled in as constants" in str(w.message) for w in caught) == (trips == 2)
    assert engine.trace_count == 2  # one compilation per value of M (the trace that found M static stopped)


def test_loop_body_slicing_with_the_iteration_number_unrolls():
    # Slice needs its starts at compile time: inside lax.scan `i` is traced, so the loop unrolls instead
    nodes = [
        helper.make_node("Add", ["i", "one"], ["end"]),
        helper.make_node("Unsqueeze", ["i", "zero"], ["start1"]),
        helper.make_node("Unsqueeze", ["end", "zero"], ["end1"]),
        helper.make_node("Slice", ["x", "start1", "end1"], ["piece"]),
        helper.make_node("Add", ["y_in", "piece"], ["y_out"]),
        helper.make_node("Identity", ["y_out"], ["s"]),
    ]
    loop = helper.make_node("Loop", ["M", "", "y0"], ["y", "ys"], body=loop_body(nodes, scans=["s"]))
    consts = {"M": np.array(4, np.int64), "one": np.array(1, np.int64), "zero": np.array([0], np.int64)}
    m = model([loop], [info("y0", F, [1]), info("x", F, [4])], ["y", "ys"], initializers=consts)
    feeds = {"y0": np.float32([0.5]), "x": np.float32([1, 2, 3, 4])}
    ours, _ = run(m, feeds)
    assert_same(ours, reference(m, feeds))
    assert "scan" not in primitives(m, *feeds.values())


def test_loop_nested_if_reads_outer_scopes():
    # the If inside the body reads `x` from the main graph and `y_in` from the loop body; its condition
    # depends on the iteration number, so it is traced inside lax.scan
    then_ = body([helper.make_node("Add", ["y_in", "x"], ["t"])], [], ["t"])
    else_ = body([helper.make_node("Sub", ["y_in", "x"], ["e"])], [], ["e"])
    nodes = [helper.make_node("Less", ["i", "two"], ["small"]),
             helper.make_node("If", ["small"], ["y_out"], then_branch=then_, else_branch=else_),
             helper.make_node("Mul", ["y_out", "y_out"], ["s"])]
    loop = helper.make_node("Loop", ["M", "", "y0"], ["y", "ys"], body=loop_body(nodes, scans=["s"]))
    consts = {"M": np.array(5, np.int64), "two": np.array(2, np.int64)}
    m = model([loop], [info("y0", F, [2]), info("x", F, [2])], ["y", "ys"], initializers=consts)
    feeds = {"y0": np.float32([1, 2]), "x": np.float32([0.5, 3])}
    ours, _ = run(m, feeds)
    assert_same(ours, reference(m, feeds))
    assert "scan" in primitives(m, *feeds.values())


def test_loop_carried_sequence_that_grows_is_unrolled():
    nodes = [helper.make_node("Mul", ["x", "x"], ["xx"]), helper.make_node("SequenceInsert", ["y_in", "xx"], ["y_out"])]
    inputs = [info("i", I64, []), info("cond_in", BOOL, []),
              helper.make_tensor_sequence_value_info("y_in", F, None)]
    loop_graph = body(nodes, inputs, ["cond_in", "y_out"])
    m = model(
        [helper.make_node("SequenceConstruct", ["x"], ["seq0"]),
         helper.make_node("Loop", ["M", "", "seq0"], ["seq"], body=loop_graph),
         helper.make_node("ConcatFromSequence", ["seq"], ["y"], axis=0)],
        [info("x", F, [2])], ["y"], initializers={"M": np.array(3, np.int64)},
    )
    feeds = {"x": np.float32([1.5, -2])}
    ours, _ = run(m, feeds)
    assert_same(ours, reference(m, feeds))


def test_loop_carried_sequence_of_fixed_shape_stays_structured():
    # the carried sequence keeps its length and shapes, so it lives in the lax.scan carry
    nodes = [helper.make_node("SequenceAt", ["y_in", "zero"], ["head"]),
             helper.make_node("Add", ["head", "x"], ["head2"]),
             helper.make_node("SequenceConstruct", ["head2", "head"], ["y_out"])]
    inputs = [info("i", I64, []), info("cond_in", BOOL, []),
              helper.make_tensor_sequence_value_info("y_in", F, None)]
    loop_graph = body(nodes, inputs, ["cond_in", "y_out"])
    m = model(
        [helper.make_node("SequenceConstruct", ["x", "x"], ["seq0"]),
         helper.make_node("Loop", ["M", "", "seq0"], ["seq"], body=loop_graph),
         helper.make_node("ConcatFromSequence", ["seq"], ["y"], axis=0, new_axis=1)],
        [info("x", F, [2])], ["y"], initializers={"M": np.array(6, np.int64), "zero": np.array(0, np.int64)},
    )
    engine = None
    for x in ([1, 2], [3, -4]):
        feeds = {"x": np.float32(x)}
        ours, engine = run(m, feeds, engine)
        assert_same(ours, reference(m, feeds))
    assert engine.trace_count == 1
    assert "scan" in primitives(m, *feeds.values())


def test_loop_zero_iterations_gives_empty_scan_outputs():
    nodes = [helper.make_node("Add", ["y_in", "y_in"], ["y_out"]), helper.make_node("Identity", ["y_in"], ["s"])]
    loop = helper.make_node("Loop", ["M", "", "y0"], ["y", "ys"], body=loop_body(nodes, scans=["s"]))
    m = model([loop], [info("y0", F, [2])], ["y", "ys"], initializers={"M": np.array(0, np.int64)})
    (y, ys), _ = run(m, {"y0": np.float32([1, 2])})
    np.testing.assert_array_equal(y, [1, 2])
    assert ys.shape == (0, 2) and ys.dtype == np.float32


def test_loop_fully_static_runs_in_python_and_folds():
    # everything the loop reads is constant: its result is static, so it can feed a Reshape's shape
    nodes = [helper.make_node("Mul", ["y_in", "two"], ["y_out"])]
    inputs = [info("i", I64, []), info("cond_in", BOOL, []), info("y_in", I64, [1])]
    loop = helper.make_node("Loop", ["M", "", "n0"], ["n"], body=body(nodes, inputs, ["cond_in", "y_out"]))
    shape = helper.make_node("Concat", ["n", "minus1"], ["shape"], axis=0)
    reshape = helper.make_node("Reshape", ["x", "shape"], ["y"])
    consts = {"M": np.array(2, np.int64), "n0": np.array([1], np.int64), "two": np.array([2], np.int64),
              "minus1": np.array([-1], np.int64)}
    m = model([loop, shape, reshape], [info("x", F, [4, 3])], ["y"], initializers=consts)
    feeds = {"x": np.arange(12, dtype=np.float32).reshape(4, 3)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours, _ = run(m, feeds)
    assert ours[0].shape == (4, 3)


def test_loop_gradient_through_static_trip_count():
    nodes = [helper.make_node("Mul", ["y_in", "w"], ["y_out"]), helper.make_node("Identity", ["y_out"], ["s"])]
    loop = helper.make_node("Loop", ["M", "", "y0"], ["y", "ys"], body=loop_body(nodes, scans=["s"]))
    m = model([loop], [info("y0", F, [2]), info("w", F, [2])], ["y", "ys"], initializers={"M": np.array(3, np.int64)})
    f = graph_function(m)
    y0, w = np.float32([1, 2]), np.float32([0.5, 3])
    g = jax.jit(jax.grad(lambda w: jnp.sum(f(y0, w)[0]) + jnp.sum(f(y0, w)[1])))(w)
    expected = y0 * (3 * w**2 + 2 * w + 1)  # d/dw of y0 (w^3 + w^2 + w) summed over the scan, plus y0 w^3
    np.testing.assert_allclose(g, expected + y0 * 3 * w**2, rtol=1e-6)


def test_loop_condition_from_the_iteration_number_with_scan_outputs():
    # cond_out = i < 2 depends on i only: unrolled, it is static at every step, so the scan outputs' length is
    # known (3 iterations) even though M is 10 and the state is traced
    nodes = [helper.make_node("Less", ["i", "two"], ["go"]), helper.make_node("Add", ["y_in", "y_in"], ["y_out"]),
             helper.make_node("Identity", ["y_out"], ["s"])]
    loop = helper.make_node("Loop", ["M", "c0", "y0"], ["y", "ys"], body=loop_body(nodes, scans=["s"], cond_out="go"))
    consts = {"M": np.array(10, np.int64), "c0": np.array(True), "two": np.array(2, np.int64)}
    m = model([loop], [info("y0", F, [2])], ["y", "ys"], initializers=consts)
    feeds = {"y0": np.float32([1, 2])}
    ours, _ = run(m, feeds)
    assert_same(ours, reference(m, feeds))
    assert ours[1].shape == (3, 2)


# ---- Scan ------------------------------------------------------------------------------------------------------


def cumsum_body(n_in=1):
    """state s: s + x_0 (+ x_1 ...); scan output: the new state times 2."""
    nodes = [helper.make_node("Sum", ["s_in"] + [f"x{k}" for k in range(n_in)], ["s_out"]),
             helper.make_node("Add", ["s_out", "s_out"], ["o"])]
    return body(nodes, [info("s_in", F, None)] + [info(f"x{k}", F, None) for k in range(n_in)], ["s_out", "o"])


def test_scan_axes_and_directions_against_numpy():
    x0 = np.arange(12, dtype=np.float32).reshape(3, 4)  # scanned along axis 1 (4 steps), backwards
    x1 = np.arange(12, dtype=np.float32).reshape(4, 3) * 10  # scanned along axis 0, forwards
    s0 = np.zeros(3, np.float32)
    node = helper.make_node("Scan", ["s0", "x0", "x1"], ["s", "out"], body=cumsum_body(2), num_scan_inputs=2,
                            scan_input_axes=[1, 0], scan_input_directions=[1, 0], scan_output_axes=[-1],
                            scan_output_directions=[1])
    m = model([node], [info("s0", F, [3]), info("x0", F, [3, 4]), info("x1", F, [4, 3])], ["s", "out"])
    (s, out), engine = run(m, {"s0": s0, "x0": x0, "x1": x1})
    state, steps = s0.copy(), []
    for t in range(4):
        state = state + x0[:, 3 - t] + x1[t]
        steps.append(2 * state)
    np.testing.assert_allclose(s, state)
    np.testing.assert_allclose(out, np.stack(steps[::-1], axis=-1))  # prepended, on the last axis
    assert out.shape == (3, 4)


def test_scan_matches_reference_and_compiles_once():
    node = helper.make_node("Scan", ["s0", "x"], ["s", "out"], body=cumsum_body(), num_scan_inputs=1)
    m = model([node], [info("s0", F, [2]), info("x", F, [5, 2])], ["s", "out"], opset=16)
    engine = None
    for k in range(2):
        feeds = {"s0": np.float32([k, 1]), "x": np.arange(10, dtype=np.float32).reshape(5, 2) - k}
        ours, engine = run(m, feeds, engine)
        assert_same(ours, reference(m, feeds))
    assert engine.trace_count == 1
    assert "scan" in primitives(m, *feeds.values())


def test_scan_opset8_batch_and_sequence_lens():
    node = helper.make_node("Scan", ["lens", "s0", "x"], ["s", "out"], body=cumsum_body(), num_scan_inputs=1,
                            directions=[1])
    m = model([node], [info("s0", F, [2, 1]), info("x", F, [2, 4, 1])], ["s", "out"],
              initializers={"lens": np.array([4, 2], np.int64)}, opset=8)
    s0 = np.float32([[0], [100]])
    x = np.arange(8, dtype=np.float32).reshape(2, 4, 1)
    (s, out), _ = run(m, {"s0": s0, "x": x})
    expected_s, expected_out = np.zeros_like(s0), np.zeros_like(x)
    for b, n in enumerate([4, 2]):
        state = s0[b].copy()
        for t in range(n):  # backwards over the first n steps only
            state = state + x[b, n - 1 - t]
            expected_out[b, t] = 2 * state
        expected_s[b] = state
    np.testing.assert_allclose(s, expected_s)
    np.testing.assert_allclose(out, expected_out)


def test_scan_body_needing_static_elements_unrolls():
    # each scanned element is a Slice start: inside lax.scan it would be traced, so the scan unrolls
    nodes = [helper.make_node("Add", ["k", "one"], ["k1"]), helper.make_node("Slice", ["data", "k", "k1"], ["piece"]),
             helper.make_node("Add", ["s_in", "piece"], ["s_out"]), helper.make_node("Identity", ["piece"], ["o"])]
    scan_body = body(nodes, [info("s_in", F, [1]), info("k", I64, [1])], ["s_out", "o"])
    node = helper.make_node("Scan", ["s0", "ks"], ["s", "out"], body=scan_body, num_scan_inputs=1)
    consts = {"ks": np.array([[3], [0], [2]], np.int64), "one": np.array([1], np.int64)}
    m = model([node], [info("s0", F, [1]), info("data", F, [4])], ["s", "out"], initializers=consts)
    feeds = {"s0": np.float32([0.5]), "data": np.float32([1, 10, 100, 1000])}
    ours, _ = run(m, feeds)
    assert_same(ours, reference(m, feeds))


def test_scan_gradient():
    node = helper.make_node("Scan", ["s0", "x"], ["s", "out"], body=cumsum_body(), num_scan_inputs=1)
    m = model([node], [info("s0", F, [2]), info("x", F, [3, 2])], ["s", "out"])
    f = graph_function(m)
    s0, x = np.float32([1, 2]), np.arange(6, dtype=np.float32).reshape(3, 2)
    gx = jax.jit(jax.grad(lambda x: jnp.sum(f(s0, x)[1] * jnp.arange(1.0, 4.0)[:, None])))(x)
    # out[t] = 2 (s0 + x[0] + ... + x[t]), weighted by t + 1: d/dx[k] = 2 * sum_{t >= k} (t + 1)
    np.testing.assert_allclose(gx, np.repeat(np.float32([[12], [10], [6]]), 2, axis=1))
