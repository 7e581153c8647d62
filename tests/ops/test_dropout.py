"""Dropout: identity at inference (ReferenceEvaluator), and in training mode checked statistically (the
conformance cases draw from NumPy's global RNG, which no other generator can match): the keep-probability,
the 1 / (1 - ratio) scaling, the mask, seeds, traced training_mode, train_step and gradients."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import pytest
from onnx import helper

import onnxtrain
from nodes import assert_matches_reference, node_model
from onnxtrain.lower.ops.dropout import dropout
from training_models import model as training_model
from training_models import vi

rng = np.random.default_rng(0)


def dropout_model(opset=22, dtype=np.float32, with_training_input=True, **attrs) -> onnx.ModelProto:
    inputs = {"x": np.zeros((1,), dtype), "r": np.float32(0), "t": np.bool_(True)}
    if not with_training_input:
        inputs = {"x": inputs["x"]}
    model = node_model("Dropout", inputs, n_outputs=2, opset=opset, **attrs)
    for graph_input in model.graph.input:  # any shape, so one model serves every test
        graph_input.type.tensor_type.ClearField("shape")
    return model


def run_engine(engine, **feeds):
    out = engine.infer(feeds)
    return [np.asarray(out[n]) for n in engine.output_names]


@pytest.mark.parametrize("opset", [12, 13, 22])
def test_inference_is_identity_with_all_true_mask(opset):
    x = rng.standard_normal((3, 4)).astype(np.float32)
    y, mask = assert_matches_reference("Dropout", {"x": x}, n_outputs=2, opset=opset)
    np.testing.assert_array_equal(y, x)
    assert mask.dtype == np.bool_ and mask.all()


@pytest.mark.parametrize("opset, mask_dtype", [(6, np.float64), (7, np.float64), (10, np.bool_)])
def test_old_opsets_mask_dtype(opset, mask_dtype):
    """Before opset 10 the mask has the data's type T, not bool."""
    x = rng.standard_normal((2, 3))
    attrs = {"is_test": 1} if opset == 6 else {}
    engine = onnxtrain.load(node_model("Dropout", {"x": x}, n_outputs=2, opset=opset, ratio=0.3, **attrs), check=False)
    y, mask = run_engine(engine, x=x)
    np.testing.assert_array_equal(y, x)
    assert mask.dtype == mask_dtype and np.all(mask == 1)


@pytest.mark.parametrize("dtype, ratio", [(np.float16, 0.25), (np.float32, 0.75), (np.float64, 0.5)])
def test_training_mode_keep_probability_and_scale(dtype, ratio):
    x = rng.uniform(1, 2, (200, 500)).astype(dtype)
    engine = onnxtrain.load(dropout_model(dtype=dtype), check=False)
    y, mask = run_engine(engine, x=x, r=np.float32(ratio), t=np.bool_(True))
    assert y.dtype == dtype and mask.dtype == np.bool_
    keep = 1 - ratio
    assert abs(mask.mean() - keep) < 0.01  # 100k Bernoulli draws: the standard deviation is ~0.0014
    scale = np.asarray(1 / keep, dtype)
    np.testing.assert_array_equal(y[mask], x[mask] * scale)
    np.testing.assert_array_equal(y[~mask], 0)


def test_traced_training_mode_switches_without_recompiling():
    x = rng.uniform(1, 2, (50, 40)).astype(np.float32)
    engine = onnxtrain.load(dropout_model(), check=False)
    dropped, mask = run_engine(engine, x=x, r=np.float32(0.5), t=np.bool_(True))
    traces = engine.trace_count
    same, all_kept = run_engine(engine, x=x, r=np.float32(0.5), t=np.bool_(False))
    assert engine.trace_count == traces
    assert not mask.all() and all_kept.all()
    np.testing.assert_array_equal(same, x)


def test_skipped_ratio_defaults_to_half():
    x = np.ones((100, 100), np.float32)
    model = node_model("Dropout", {"x": x, "t": np.bool_(True)}, n_outputs=2)
    model.graph.node[0].input[:] = ["x", "", "t"]
    y, mask = run_engine(onnxtrain.load(model, check=False), x=x, t=np.bool_(True))
    assert abs(mask.mean() - 0.5) < 0.03
    np.testing.assert_array_equal(np.unique(y), [0.0, 2.0])


def test_ratio_one_drops_everything_without_nan():
    x = rng.standard_normal((10, 10)).astype(np.float32)
    y, mask = run_engine(onnxtrain.load(dropout_model(), check=False), x=x, r=np.float32(1.0), t=np.bool_(True))
    assert not mask.any()
    np.testing.assert_array_equal(y, 0)


def masks(model, seed=0):
    x = np.ones((64, 64), np.float32)
    return run_engine(onnxtrain.load(model, seed=seed, check=False), x=x, r=np.float32(0.5), t=np.bool_(True))[1]


def test_seed_attribute_fixes_the_mask():
    first = masks(dropout_model(seed=3), seed=0)
    np.testing.assert_array_equal(first, masks(dropout_model(seed=3), seed=1))  # the node's seed wins
    assert not np.array_equal(first, masks(dropout_model(seed=4)))


def test_without_seed_the_engine_seed_decides():
    first = masks(dropout_model(), seed=1)
    np.testing.assert_array_equal(first, masks(dropout_model(), seed=1))
    assert not np.array_equal(first, masks(dropout_model(), seed=2))


def dropout_training_model(opset: int) -> onnx.ModelProto:
    """Y = Dropout(X) (no training_mode input) plus an algorithm that only reports Y."""
    graph = helper.make_graph(
        [helper.make_node("Dropout", ["X"], ["Y", "M"], ratio=0.5)] if opset < 12 else
        [helper.make_node("Dropout", ["X"], ["Y", "M"])],
        "dropout",
        [vi("X", onnx.TensorProto.FLOAT, [32, 32])],
        [vi("Y", onnx.TensorProto.FLOAT, [32, 32]), vi("M", onnx.TensorProto.BOOL, [32, 32])],
    )
    algorithm = helper.make_graph(
        [helper.make_node("Identity", ["Y"], ["Y2"])], "report", [], [vi("Y2", onnx.TensorProto.FLOAT, None)]
    )
    return training_model(graph, [helper.make_training_info(algorithm, [], None, None)], opset=opset)


def loop_draw_training_model(seed: float | None) -> onnx.ModelProto:
    """A deterministic inference graph, and an algorithm whose only random op sits in a Loop body."""
    graph = helper.make_graph([helper.make_node("Identity", ["X"], ["Y"])], "main",
                              [vi("X", onnx.TensorProto.FLOAT, [3])], [vi("Y", onnx.TensorProto.FLOAT, [3])])
    draw = helper.make_node("RandomUniform", [], ["draw"], shape=[3], **({} if seed is None else {"seed": seed}))
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]), draw], "body",
        [vi("i", onnx.TensorProto.INT64, []), vi("cond_in", onnx.TensorProto.BOOL, [])],
        [vi("cond_out", onnx.TensorProto.BOOL, []), vi("draw", onnx.TensorProto.FLOAT, [3])],
    )
    algorithm = helper.make_graph(
        [helper.make_node("Constant", [], ["two"], value=helper.make_tensor("two", onnx.TensorProto.INT64, [], [2])),
         helper.make_node("Loop", ["two", ""], ["draws"], body=body)],
        "draw", [], [vi("draws", onnx.TensorProto.FLOAT, None)],
    )
    return training_model(graph, [helper.make_training_info(algorithm, [], None, None)], opset=17)


@pytest.mark.parametrize("seed", [None, 5.0])
def test_a_draw_nested_in_a_subgraph_is_fresh_every_train_step(seed):
    """The step count seeds the random streams of a train step, and only a step that draws advances it: a draw
    inside a Loop body (or from a seeded node, which the count advances as a generator would) must count."""
    engine = onnxtrain.load(loop_draw_training_model(seed), check=False)
    steps = [np.asarray(engine.train_step({"X": np.zeros(3, np.float32)})["draws"]) for _ in range(3)]
    assert len({row.tobytes() for draws in steps for row in draws}) == 6  # 3 steps x 2 iterations, all different


@pytest.mark.parametrize("opset", [10, 13])
def test_train_step_drops_and_infer_does_not(opset):
    engine = onnxtrain.load(dropout_training_model(opset), check=False)
    x = np.ones((32, 32), np.float32)
    first = np.asarray(engine.train_step({"X": x})["M"])
    second = np.asarray(engine.train_step({"X": x})["M"])
    assert 0.4 < first.mean() < 0.6
    assert not np.array_equal(first, second)  # a fresh mask each step
    out = engine.infer({"X": x})
    np.testing.assert_array_equal(out["Y"], x)
    assert np.asarray(out["M"]).all()


def test_gradient_flows_through_kept_elements_only():
    ctx = SimpleNamespace(trace=SimpleNamespace(training=True), rng=lambda seed=None: jax.random.key(7))
    x = jnp.asarray(rng.standard_normal((20, 20)), jnp.float32)
    weight = jnp.arange(400, dtype=jnp.float32).reshape(20, 20)
    grad = jax.jit(jax.grad(lambda v: jnp.sum(dropout(v, 0.2, ctx=ctx)[0] * weight)))(x)
    _, mask = dropout(x, 0.2, ctx=ctx)
    np.testing.assert_allclose(grad, np.where(mask, weight / 0.8, 0), rtol=1e-6)
