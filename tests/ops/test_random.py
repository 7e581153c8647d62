"""Random ops: deterministic per seed, the right shape and dtype, and the right distribution (moments)."""

import numpy as np
import pytest

import onnxtrain
from nodes import node_model
from onnx import TensorProto


def run(op_type, inputs=None, engine_seed=0, **attrs):
    inputs = inputs or {}
    engine = onnxtrain.load(node_model(op_type, inputs, **attrs), seed=engine_seed, check=False)
    return np.asarray(engine.infer(inputs)["out0"])


def test_random_normal_moments_shape_dtype_and_determinism():
    x = run("RandomNormal", shape=[400, 250], mean=2.0, scale=3.0, dtype=TensorProto.DOUBLE)
    assert x.shape == (400, 250) and x.dtype == np.float64
    assert x.mean() == pytest.approx(2.0, abs=0.05) and x.std() == pytest.approx(3.0, rel=0.02)
    np.testing.assert_array_equal(x, run("RandomNormal", shape=[400, 250], mean=2.0, scale=3.0,
                                         dtype=TensorProto.DOUBLE))
    assert not np.array_equal(x, run("RandomNormal", engine_seed=1, shape=[400, 250], mean=2.0, scale=3.0,
                                     dtype=TensorProto.DOUBLE))


def test_seed_attribute_wins_over_the_engine_seed():
    a = run("RandomUniform", engine_seed=0, shape=[50], seed=5.0)
    b = run("RandomUniform", engine_seed=9, shape=[50], seed=5.0)
    np.testing.assert_array_equal(a, b)


def test_random_uniform_like_takes_shape_and_dtype_of_its_input():
    x = run("RandomUniformLike", {"x": np.zeros((300, 300), np.float16)}, low=-1.0, high=3.0)
    assert x.shape == (300, 300) and x.dtype == np.float16
    assert x.min() >= -1.0 and x.max() <= 3.0
    assert x.astype(np.float64).mean() == pytest.approx(1.0, abs=0.02)


def test_random_normal_like_with_dtype_attribute():
    x = run("RandomNormalLike", {"x": np.zeros((200, 200), np.int32)}, dtype=TensorProto.FLOAT)
    assert x.dtype == np.float32 and abs(x.mean()) < 0.03 and x.std() == pytest.approx(1.0, rel=0.03)


def test_bernoulli_frequency_matches_probability():
    p = np.tile(np.array([0.1, 0.5, 0.9], np.float64), (20000, 1))
    x = run("Bernoulli", {"p": p})
    assert x.dtype == np.float64 and set(np.unique(x)) <= {0.0, 1.0}
    np.testing.assert_allclose(x.mean(axis=0), [0.1, 0.5, 0.9], atol=0.01)


def test_multinomial_frequencies_follow_the_softmax_of_the_logits():
    probabilities = np.array([[0.2, 0.3, 0.5]])
    x = run("Multinomial", {"logits": np.log(probabilities).astype(np.float32)}, sample_size=30000)
    assert x.shape == (1, 30000) and x.dtype == np.int32
    np.testing.assert_allclose(np.bincount(x[0], minlength=3) / 30000, probabilities[0], atol=0.01)


def test_random_op_inside_a_loop_draws_fresh_numbers_each_iteration():
    from onnx import helper

    from nodes import graph_model, run_outputs, value

    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("RandomUniform", [], ["draw"], shape=[3])],
        "body",
        [value("i", TensorProto.INT64, []), value("cond_in", TensorProto.BOOL, [])],
        [value("cond_out", TensorProto.BOOL, []), value("draw", TensorProto.FLOAT, [3])],
    )
    model = graph_model([helper.make_node("Loop", ["M", ""], ["draws"], body=body)],
                        [value("M", TensorProto.INT64, [])], ["draws"])
    (draws,) = run_outputs(model, {"M": np.array(4, np.int64)})
    assert draws.shape == (4, 3)
    assert len({tuple(row) for row in draws.tolist()}) == 4  # four different iterations, four different draws
