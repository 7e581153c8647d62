"""The per-call path of infer/train_step: feed checks remembered per signature, one compile per signature, the
matmul precision compiled in, static feeds still recompiled per value, static values computed on the host, and the
executable a loop calls again and again launched directly, whatever the loop feeds next."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import jax
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import onnxtrain
from onnxtrain.errors import FeedError
from onnxtrain import program
from onnxtrain.program import gc_paused


def matmul_model() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "b"], ["y"])], "g",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["n", 3]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, [3, "n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "n"])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_remembered_signature_still_rejects_wrong_feeds():
    engine = onnxtrain.load(matmul_model())
    a, b = np.ones((2, 3), np.float32), np.ones((3, 2), np.float32)
    np.testing.assert_allclose(engine.infer({"a": a, "b": b})["y"], np.full((2, 2), 3.0))
    with pytest.raises(FeedError, match="dtype"):
        engine.infer({"a": a.astype(np.float64), "b": b})
    with pytest.raises(FeedError, match="'n'"):
        engine.infer({"a": np.ones((4, 3), np.float32), "b": b})
    with pytest.raises(FeedError, match="missing"):
        engine.infer({"a": a})
    np.testing.assert_allclose(engine.infer({"a": a, "b": b})["y"], np.full((2, 2), 3.0))


def test_one_trace_per_signature():
    engine = onnxtrain.load(matmul_model())
    for n in (2, 2, 2, 5, 5, 2):
        a, b = jax.numpy.ones((n, 3)), jax.numpy.ones((3, n))
        np.testing.assert_allclose(engine.infer({"a": a, "b": b})["y"], np.full((n, n), 3.0))
    assert engine.trace_count == 2


@pytest.mark.parametrize("precision, expected", [("highest", "HIGHEST"), ("default", "DEFAULT")])
def test_matmul_precision_is_compiled_in(precision: str, expected: str):
    """Set while tracing, not around each call: the StableHLO must carry it."""
    engine = onnxtrain.load(matmul_model(), matmul_precision=precision)
    feeds = {"a": np.ones((2, 3), np.float32), "b": np.ones((3, 2), np.float32)}
    text = engine.lower(feeds).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert dots and all(f"precision = [{expected}, {expected}]" in line for line in dots)


def test_a_static_feed_is_still_compiled_per_value_after_the_fast_path_warmed_up():
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6]),
         helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, None])],
    )
    engine = onnxtrain.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    x = np.arange(6, dtype=np.float32)
    with pytest.warns(UserWarning, match="compiled in as constants"):
        assert engine.infer({"x": x, "shape": np.array([2, 3])})["y"].shape == (2, 3)
    assert engine.infer({"x": x, "shape": np.array([3, 2])})["y"].shape == (3, 2)
    assert engine.infer({"x": x, "shape": np.array([2, 3])})["y"].shape == (2, 3)
    assert engine.trace_count == 2  # one per distinct shape value; the trace that found the static feed stopped


STATIC_ON_HOST = """
import jax, jax.numpy as jnp
from onnxtrain.lower.values import host_device, static_evaluation
with jax.default_device(jax.devices()[1]):
    with static_evaluation():
        static = jnp.arange(3) * 2
    staged = jnp.arange(3) * 2
print(host_device().platform, static.devices() == {host_device()}, staged.devices() == {jax.devices()[1]})
"""


def test_static_values_are_computed_on_the_host_whatever_the_default_device():
    """Trace-time arithmetic compiles a small program per distinct computation: on the CPU that takes
    milliseconds, on a GPU tens of them (two CPU devices stand in for a CPU and an accelerator here)."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-c", STATIC_ON_HOST], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["cpu", "True", "True"]


@pytest.mark.parametrize("enabled", [True, False])
def test_tracing_pauses_the_garbage_collector_and_restores_it(enabled: bool):
    """Collections during a trace scanned the whole heap (a third of the transformer's trace time); the user's
    setting comes back afterwards, an exception included."""
    (gc.enable if enabled else gc.disable)()
    try:
        seen = []
        with pytest.raises(ZeroDivisionError), gc_paused():
            seen.append(gc.isenabled())
            1 / 0
        assert seen == [False] and gc.isenabled() == enabled
        onnxtrain.load(matmul_model()).infer({"a": np.ones((2, 3), np.float32), "b": np.ones((3, 2), np.float32)})
        assert gc.isenabled() == enabled
    finally:
        gc.enable()


def sgd_model() -> onnx.ModelProto:
    """y = x @ W; loss = mean((y - t)^2); W -= 0.1 * dloss/dW, as a TrainingInfoProto."""
    w = np.arange(6, dtype=np.float32).reshape(3, 2) / 10
    model = helper.make_model(helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 2])],
        [onnx.numpy_helper.from_array(w, "W")]), opset_imports=[helper.make_opsetid("", 17)])
    return onnxtrain.make_trainable(model, loss="mse", optimizer="sgd", learning_rate=0.1)


def numpy_sgd(w: np.ndarray, x: np.ndarray, t: np.ndarray) -> np.ndarray:
    return w - 0.1 * x.T @ (2 * (x @ w - t) / t.size)


def test_the_directly_launched_executable_gives_way_to_any_other_signature(monkeypatch):
    """After SPLIT_AFTER_CALLS calls a program launches the executable of its last call directly (program.py,
    `recent`); a call with other shapes, dtypes, names or kinds of value takes the full path, with the feed
    checks, and every step is still NumPy's SGD step."""
    monkeypatch.setattr(program, "SPLIT_AFTER_CALLS", 2)
    engine = onnxtrain.load(sgd_model())
    rng = np.random.default_rng(0)
    w = np.asarray(engine.state["W"]).copy()
    for n in (4, 4, 4, 4, 2, 4, 2, 2, 4):
        x, t = rng.standard_normal((n, 3)).astype(np.float32), rng.standard_normal((n, 2)).astype(np.float32)
        feeds = {"x": x, "target": t} if n == 4 else {"x": jax.device_put(x), "target": jax.device_put(t)}
        engine.train_step(feeds)
        w = numpy_sgd(w, x, t)
        np.testing.assert_allclose(np.asarray(engine.state["W"]), w, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(engine.infer({"x": x})["y"]), x @ w, rtol=1e-5, atol=1e-6)
    assert engine._train[0].recent is not None or engine._train[0].store is None
    with pytest.raises(FeedError, match="dtype"):
        engine.train_step({"x": x.astype(np.float64), "target": t})
    with pytest.raises(FeedError, match="'target': expected dtype float, got double"):
        engine.train_step({"x": x, "target": t.tolist()})
    with pytest.raises(FeedError, match="unknown"):
        engine.infer({"x": x, "z": x})
    np.testing.assert_allclose(np.asarray(engine.infer({"x": x})["y"]), x @ w, rtol=1e-5, atol=1e-6)
