"""Training models checked against NumPy loops written independently of the engine."""

from __future__ import annotations

import numpy as np
import pytest

import onnxtrain
from onnxtrain.steps import main_nodes_read
from training_models import linear_regression

RNG = np.random.default_rng(0)


def numpy_linear_sgd(x, t, w, b, lr, steps):
    """Hand-derived: d/dW mean((XW+B-T)^2) = 2 X^T (XW+B-T) / size."""
    losses = []
    for _ in range(steps):
        d = x @ w + b - t
        losses.append(np.mean(d * d))
        w = w - lr * 2 * x.T @ d / d.size
        b = b - lr * 2 * d.sum(axis=0) / d.size
    return w, b, losses


def test_linear_regression_with_gradient_and_sgd_matches_numpy():
    x = RNG.normal(size=(16, 3)).astype(np.float32)
    t = (x @ np.array([[1.0], [-2.0], [0.5]]) + 0.3).astype(np.float32)
    w0, b0 = np.zeros((3, 1), np.float32), np.zeros((1,), np.float32)
    engine = onnxtrain.load(linear_regression(w0, b0, lr=0.1))
    losses = [float(engine.train_step({"X": x, "T": t})["Loss"]) for _ in range(20)]
    w, b, expected_losses = numpy_linear_sgd(x.astype(np.float64), t, w0, b0, 0.1, 20)
    np.testing.assert_allclose(np.asarray(engine.state["W"]), w, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(engine.state["B"]), b, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-4)
    assert engine.trace_count == 1  # twenty steps, one compile
    # infer uses the trained state and changes nothing
    np.testing.assert_allclose(np.asarray(engine.infer({"X": x})["Y"]), x @ w + b, rtol=1e-4, atol=1e-5)


def numpy_mlp_grads(p, x, t):
    z = x @ p["W1"] + p["B1"]
    h = np.maximum(z, 0)
    y = h @ p["W2"] + p["B2"]
    dy = 2 * (y - t) / y.size
    dz = (dy @ p["W2"].T) * (z > 0)
    loss = np.mean((y - t) ** 2)
    return loss, {"W1": x.T @ dz, "B1": dz.sum(0), "W2": h.T @ dy, "B2": dy.sum(0)}


def numpy_adam(x, g, v, h, r, t, alpha, beta, eps):
    """The Adam schema's pseudo code (bias correction only when T > 0, epsilon outside the sqrt)."""
    v = alpha * v + (1 - alpha) * g
    h = beta * h + (1 - beta) * g * g
    r_adj = r * np.sqrt(1 - beta**t) / (1 - alpha**t) if t > 0 else r
    return x - r_adj * v / (np.sqrt(h) + eps), v, h


def mlp_params():
    rng = np.random.default_rng(1)
    return {
        "W1": rng.normal(scale=0.5, size=(4, 8)).astype(np.float32),
        "B1": np.zeros(8, np.float32),
        "W2": rng.normal(scale=0.5, size=(8, 2)).astype(np.float32),
        "B2": np.zeros(2, np.float32),
    }


def test_mlp_with_adam_and_step_counter_matches_numpy():
    from training_models import mlp_adam

    p0 = mlp_params()
    x = RNG.normal(size=(32, 4)).astype(np.float32)
    t = np.stack([x[:, 0] * x[:, 1], np.sin(x[:, 2])], axis=1).astype(np.float32)
    engine = onnxtrain.load(mlp_adam(p0, lr=0.01))
    engine.init()
    p = {k: v.astype(np.float64) for k, v in p0.items()}
    v = {k: np.zeros_like(a) for k, a in p.items()}
    h = {k: np.zeros_like(a) for k, a in p.items()}
    for step in range(15):
        got = float(engine.train_step({"X": x, "Target": t})["Loss"])
        loss, grads = numpy_mlp_grads(p, x, t)
        assert got == pytest.approx(loss, rel=1e-4)
        for k in p:
            p[k], v[k], h[k] = numpy_adam(p[k], grads[k], v[k], h[k], 0.01, step, 0.9, 0.999, 1e-6)
    assert int(engine.state["T"]) == 15
    for k in p:
        np.testing.assert_allclose(np.asarray(engine.state[k]), p[k], rtol=1e-3, atol=1e-5)
        np.testing.assert_allclose(np.asarray(engine.state[f"V_{k}"]), v[k], rtol=1e-3, atol=1e-6)
    engine.init()  # resets the optimizer state (and, being a reset first, the weights too)
    assert int(engine.state["T"]) == 0
    np.testing.assert_array_equal(np.asarray(engine.state["W1"]), p0["W1"])
    assert not np.asarray(engine.state["V_W1"]).any()


def test_two_algorithms_interleaved_by_the_caller():
    from training_models import scaled_model_two_algorithms

    w0, b0 = np.full(3, 0.5, np.float32), np.zeros(3, np.float32)
    x = RNG.normal(size=(8, 3)).astype(np.float32)
    t = (2.0 * x - 1.0).astype(np.float32)
    engine = onnxtrain.load(scaled_model_two_algorithms(w0, b0, lr_w=0.1, lr_b=0.5))
    w, b = w0.astype(np.float64), b0.astype(np.float64)
    n = x.shape[0]
    for algorithm in [0, 1, 0, 1, 1, 0]:
        engine.train_step({"X": x, "T": t}, algorithm=algorithm)
        d = w * x + b - t
        if algorithm == 0:
            w = w - 0.1 * 2 * (d * x).sum(0) / (n * 3)
        else:
            b = b - 0.5 * 2 * d.sum(0) / (n * 3)
    np.testing.assert_allclose(np.asarray(engine.state["W"]), w, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(engine.state["B"]), b, rtol=1e-5, atol=1e-6)


def counter_model(with_initialization: bool):
    """A main-graph output (C_next = C + 1) is the update_binding value; the algorithm graph has no nodes."""
    from onnx import TensorProto, helper

    from training_models import model, tensor, vi

    graph = helper.make_graph(
        [helper.make_node("Add", ["C", "One"], ["C_next"]), helper.make_node("Mul", ["X", "S"], ["Y"])],
        "counter",
        [vi("X", TensorProto.FLOAT, [2])],
        [vi("Y", TensorProto.FLOAT, [2]), vi("C_next", TensorProto.INT64, [])],
        [tensor("C", np.int64(5)), tensor("One", np.int64(1)), tensor("S", np.float32(3.0))],
    )
    algorithm = helper.make_graph([], "empty", [], [])
    initialization, bindings = None, None
    if with_initialization:
        initialization = helper.make_graph(
            [helper.make_node("Constant", [], ["C0"], value=tensor("c0", np.int64(100)))],
            "init", [], [vi("C0", TensorProto.INT64, [])],
        )
        bindings = [("C", "C0")]
    return model(graph, [helper.make_training_info(algorithm, [("C", "C_next")], initialization, bindings)])


def test_update_binding_to_a_main_graph_output_and_infer_has_no_side_effects():
    engine = onnxtrain.load(counter_model(with_initialization=True))
    x = np.ones(2, np.float32)
    assert int(engine.infer({"X": x})["C_next"]) == 6
    assert int(engine.infer({"X": x})["C_next"]) == 6  # infer changes nothing
    engine.train_step({"X": x})
    engine.train_step({"X": x})
    assert int(engine.state["C"]) == 7
    engine.init()
    assert int(engine.state["C"]) == 100
    engine.reset()
    assert int(engine.state["C"]) == 5


def test_model_without_initialization_graph_init_resets_to_initializers():
    engine = onnxtrain.load(counter_model(with_initialization=False))
    engine.train_step({"X": np.ones(2, np.float32)})
    assert int(engine.state["C"]) == 6
    engine.init()
    assert int(engine.state["C"]) == 5


def test_second_order_gradient():
    """O = sum(W^3): dO/dW = 3 W^2, and the Gradient of that (summed) is 6 W."""
    from onnx import TensorProto, helper

    from training_models import TRAINING, model, tensor, vi

    w = np.array([1.0, -2.0, 0.5], np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["W", "W"], ["W2"]),
            helper.make_node("Mul", ["W2", "W"], ["W3"]),
            helper.make_node("ReduceSum", ["W3"], ["O"], keepdims=0),
        ],
        "cube", [], [vi("O", TensorProto.FLOAT, [])], [tensor("W", w)],
    )
    algorithm = helper.make_graph(
        [
            helper.make_node("Gradient", ["W"], ["G"], domain=TRAINING, xs=["W"], y="O"),
            helper.make_node("Gradient", ["W"], ["H"], domain=TRAINING, xs=["W"], y="G"),
        ],
        "second_order", [], [vi("G", TensorProto.FLOAT, [3]), vi("H", TensorProto.FLOAT, [3])],
    )
    engine = onnxtrain.load(model(graph, [helper.make_training_info(algorithm, [], None, None)]))
    out = engine.train_step({})
    np.testing.assert_allclose(np.asarray(out["G"]), 3 * w**2, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out["H"]), 6 * w, rtol=1e-6)


def test_gradient_of_a_value_only_its_y_attribute_names():
    """A train step walks the main graph's nodes it reads alone (ir.live). Gradient names what it differentiates in
    its attributes, not its inputs: here y is a main-graph value that no input and no output reads, whose nodes the
    step walks all the same (H, the output, needs none of them). Checked against the hand-derived gradient, and an
    unread main-graph node (R) is left out."""
    from onnx import TensorProto, helper

    from training_models import TRAINING, model, tensor, vi

    x = RNG.normal(size=(4, 3)).astype(np.float32)
    w = RNG.normal(size=(3, 2)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["X", "W"], ["H"]),
            helper.make_node("Mul", ["H", "H"], ["S"]),
            helper.make_node("ReduceSum", ["S"], ["L"], keepdims=0),
            helper.make_node("Relu", ["H"], ["R"]),  # read by nothing
        ],
        "squares", [vi("X", TensorProto.FLOAT, [4, 3])], [vi("H", TensorProto.FLOAT, [4, 2])], [tensor("W", w)],
    )
    algorithm = helper.make_graph(
        [
            helper.make_node("Gradient", ["W"], ["dW"], domain=TRAINING, xs=["W"], y="L"),
            helper.make_node("Mul", ["LR", "dW"], ["step"]),
            helper.make_node("Sub", ["W", "step"], ["W_new"]),
        ],
        "sgd", [], [vi("W_new", TensorProto.FLOAT, [3, 2])], [tensor("LR", np.float32(0.1))],
    )
    engine = onnxtrain.load(model(graph, [helper.make_training_info(algorithm, [("W", "W_new")], None, None)]))
    walked = [node.op_type for node in main_nodes_read(engine._model, 0, {})]
    assert walked == ["MatMul", "Mul", "ReduceSum"]
    out = engine.train_step({"X": x})
    h = x.astype(np.float64) @ w
    np.testing.assert_allclose(np.asarray(out["H"]), h, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(engine.state["W"]), w - 0.1 * x.T @ (2 * h), rtol=1e-5, atol=1e-6)


def random_init_model(seed_attr: float | None = None):
    from onnx import TensorProto, helper

    from training_models import model, tensor, vi

    graph = helper.make_graph(
        [helper.make_node("Add", ["X", "W"], ["Y"])], "g",
        [vi("X", TensorProto.FLOAT, [500, 40])], [vi("Y", TensorProto.FLOAT, [500, 40])],
        [tensor("W", np.zeros((500, 40), np.float32))],
    )
    extra = {} if seed_attr is None else {"seed": seed_attr}
    initialization = helper.make_graph(
        [helper.make_node("RandomNormal", [], ["W0"], shape=[500, 40], mean=1.0, scale=2.0, **extra)],
        "init", [], [vi("W0", TensorProto.FLOAT, [500, 40])],
    )
    info = helper.make_training_info(helper.make_graph([], "a", [], []), [], initialization, [("W", "W0")])
    return model(graph, [info])


def test_init_random_is_deterministic_per_seed_and_node_seed_wins():
    engine = onnxtrain.load(random_init_model())
    engine.init(seed=1)
    first = np.array(engine.state["W"])
    engine.init(seed=1)
    np.testing.assert_array_equal(np.asarray(engine.state["W"]), first)
    engine.init(seed=2)
    assert not np.array_equal(np.asarray(engine.state["W"]), first)
    assert first.mean() == pytest.approx(1.0, abs=0.05) and first.std() == pytest.approx(2.0, rel=0.03)
    seeded = onnxtrain.load(random_init_model(seed_attr=7.0))
    seeded.init(seed=1)
    a = np.array(seeded.state["W"])
    seeded.init(seed=2)
    np.testing.assert_array_equal(np.asarray(seeded.state["W"]), a)


def test_lower_gives_the_program_a_step_runs_without_running_it():
    """Engine.lower: the compiled train step holds every state variable (and the engine's uint32 step count) as
    a donated argument aliased to its output, so a step updates the state in place; lowering changes nothing."""
    from training_models import mlp_adam

    engine = onnxtrain.load(mlp_adam(mlp_params(), lr=0.01))
    feeds = {"X": np.ones((3, 4), np.float32), "Target": np.zeros((3, 2), np.float32)}
    before = {name: np.asarray(value) for name, value in engine.state.items()}
    stats = engine.lower(feeds, algorithm=0).compile().memory_analysis()
    assert stats.alias_size_in_bytes == sum(v.nbytes for v in before.values()) + 4
    assert "dot_general" in engine.lower({"X": feeds["X"]}).as_text()
    assert engine.step_count == 0
    for name, value in engine.state.items():
        np.testing.assert_array_equal(np.asarray(value), before[name])
