"""The per-call path of infer/train_step: feed checks remembered per signature, one compile per signature, the
matmul precision compiled in, static feeds still recompiled per value, static values computed on the host, and the
executable a loop calls again and again launched directly, whatever the loop feeds next."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import warnings

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


def test_the_eighth_signature_of_a_program_warns_once_how_to_stop_compiling():
    """A loop feeding ever new shapes compiles each (seconds) and would say nothing: the eighth says so, once."""
    engine = onnxtrain.load(matmul_model())
    for n in range(1, program.MANY_SIGNATURES + 3):
        feeds = {"a": np.ones((n, 3), np.float32), "b": np.ones((3, n), np.float32)}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            np.testing.assert_allclose(engine.infer(feeds)["y"], np.full((n, n), 3.0))
        said = [str(w.message) for w in caught if "compiled for" in str(w.message)]
        assert said == ([f"onnxtrain's 'infer' program has now been compiled for {program.MANY_SIGNATURES} "
                         "signatures, one per new shape of its feeds (or value of a feed it needs as a constant): "
                         "pad batches to a few shapes, e.g. text to a multiple of 8 tokens, so that the compiles "
                         "stop"] if n == program.MANY_SIGNATURES else []), n
    assert engine.trace_count == program.MANY_SIGNATURES + 2


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


@pytest.mark.parametrize("stored", [True, False], ids=["store", "no-store"])
def test_the_directly_launched_executable_gives_way_to_any_other_signature(monkeypatch, stored):
    """After SPLIT_AFTER_CALLS calls a program launches the executable of its last call directly (program.py,
    `recent`), whether or not it has a store of programs (the cache off: then jax.jit's own executable); a call
    with other shapes, dtypes, names or kinds of value takes the full path, with the feed checks, and every step
    is still NumPy's SGD step."""
    monkeypatch.setattr(program, "SPLIT_AFTER_CALLS", 2)
    engine = onnxtrain.load(sgd_model())
    if not stored:
        for compiled in (engine._infer, engine._train[0]):
            compiled.store = lambda: None
    rng = np.random.default_rng(0)
    w = np.asarray(engine.state["W"]).copy()
    for n in (4, 4, 4, 4, 2, 4, 2, 2, 4):
        x, t = rng.standard_normal((n, 3)).astype(np.float32), rng.standard_normal((n, 2)).astype(np.float32)
        feeds = {"x": x, "target": t} if n == 4 else {"x": jax.device_put(x), "target": jax.device_put(t)}
        engine.train_step(feeds)
        w = numpy_sgd(w, x, t)
        np.testing.assert_allclose(np.asarray(engine.state["W"]), w, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(engine.infer({"x": x})["y"]), x @ w, rtol=1e-5, atol=1e-6)
    assert engine._train[0].recent is not None and engine._infer.recent is not None
    with pytest.raises(FeedError, match="dtype"):
        engine.train_step({"x": x.astype(np.float64), "target": t})
    with pytest.raises(FeedError, match="'target': expected dtype float, got double"):
        engine.train_step({"x": x, "target": t.astype(np.float64)})
    with pytest.raises(FeedError, match="unknown"):
        engine.infer({"x": x, "z": x})
    np.testing.assert_allclose(np.asarray(engine.infer({"x": x})["y"]), x @ w, rtol=1e-5, atol=1e-6)


def identities(types: dict[str, tuple[int, list]]) -> onnx.ModelProto:
    """One Identity per input name, each input of its element type and shape."""
    graph = helper.make_graph(
        [helper.make_node("Identity", [n], [f"{n}_out"]) for n in types], "g",
        [helper.make_tensor_value_info(n, t, shape) for n, (t, shape) in types.items()],
        [helper.make_tensor_value_info(f"{n}_out", t, shape) for n, (t, shape) in types.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


WEAK_TYPES = {"f": (TensorProto.FLOAT, ["n"]), "h": (TensorProto.FLOAT16, []), "u": (TensorProto.UINT8, ["k"]),
              "i": (TensorProto.INT32, []), "b": (TensorProto.BOOL, ["m"]), "d": (TensorProto.DOUBLE, [])}


def test_python_numbers_take_the_declared_element_type():
    """NumPy's weak Python scalars (NEP 50): 0.01 fed for a float input is float32 0.01, not a refused double;
    nested lists too; ints widen to floats; the values are NumPy's conversions of them."""
    engine = onnxtrain.load(identities(WEAK_TYPES))
    feeds = {"f": [0.01, 2, 3.5, -1], "h": 0.1, "u": [0, 255, 7], "i": -5, "b": [True, False], "d": 1 / 3}
    outputs = engine.infer(feeds)
    for name, value in feeds.items():
        expected = np.asarray(value).astype(onnx.helper.tensor_dtype_to_np_dtype(WEAK_TYPES[name][0]))
        got = np.asarray(outputs[f"{name}_out"])
        assert got.dtype == expected.dtype
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("name, value, message", [
    ("u", [1, 300], "300 is out of the range of its declared type uint8"),
    ("u", -1, "-1 is out of the range of its declared type uint8"),
    ("h", 1e5, "100000.0 is out of the range of its declared type float16"),
    ("f", [1.0, 1e300], "1e[+]300 is out of the range of its declared type float"),
    ("i", 1.5, "expected dtype int32, got double"),  # never a float into an integer
    ("b", 1, "expected dtype bool, got int64"),
    ("f", np.float64(0.5), "expected dtype float, got double"),  # NumPy values keep their own type
    ("f", [np.float64(0.5)], "expected dtype float, got double"),
])
def test_python_numbers_that_the_declared_type_cannot_hold_are_refused(name: str, value, message: str):
    engine = onnxtrain.load(identities(WEAK_TYPES))
    feeds = {"f": [0.0], "h": 0.0, "u": [0], "i": 0, "b": [False], "d": 0.0, name: value}
    with pytest.raises(FeedError, match=f"feed '{name}': {message}"):
        engine.infer(feeds)


def test_a_python_number_for_a_string_input_is_refused_by_type():
    """A string type has no number kind: the number keeps NumPy's type and the type check names both (it had
    raised a TypeError from comparing no kind with the number's)."""
    engine = onnxtrain.load(identities({"s": (TensorProto.STRING, ["k"])}))
    with pytest.raises(FeedError, match="feed 's': expected dtype string, got int64"):
        engine.infer({"s": [3]})
    assert list(np.asarray(engine.infer({"s": ["a"]})["s_out"])) == ["a"]


def test_a_python_learning_rate_trains_as_numpy_does():
    """`train_step({..., "learning_rate": 0.01})`, as a PyTorch user writes a rate: NumPy's SGD step at 0.01."""
    engine = onnxtrain.load(sgd_model())
    x, t = np.ones((2, 3), np.float32), np.full((2, 2), 2.0, np.float32)
    w = np.asarray(engine.state["W"]).copy()
    engine.train_step({"x": x.tolist(), "target": t.tolist(), "learning_rate": 0.01})
    expected = w - 0.01 * x.T @ (2 * (x @ w - t) / t.size)
    np.testing.assert_allclose(np.asarray(engine.state["W"]), expected, rtol=1e-6)
