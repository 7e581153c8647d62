"""The same model trained on 1 and on 8 (virtual CPU) devices gives the same state within float tolerance, with the
state replicated or split over the devices (shard_state), and BatchNorm's batch statistics (train_mode) those of
the whole batch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import sys
import warnings
import numpy as np
import onnx
import jax
sys.path.insert(0, sys.argv[1])
import onnxtrain
from training_models import mlp_adam
from test_training import mlp_params

assert len(jax.devices()) == 8, jax.devices()
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 4)).astype(np.float32)
t = rng.normal(size=(64, 2)).astype(np.float32)
states = []
for devices in (jax.devices()[:1], jax.devices()):
    engine = onnxtrain.load(mlp_adam(mlp_params(), lr=0.01), devices=devices)
    engine.init()
    for _ in range(10):
        out = engine.train_step({"X": x, "Target": t})
    states.append({k: np.asarray(v) for k, v in engine.state.items()})
    sharding = engine.infer({"X": x})["Y"].sharding
    print(len(devices), "devices, output sharded over", len(sharding.device_set))
for name in states[0]:
    np.testing.assert_allclose(states[1][name], states[0][name], rtol=1e-5, atol=1e-6, err_msg=name)

# shard_state: each weight and moment split over the 8 devices along its longest axis that 8 divides
with warnings.catch_warnings():
    warnings.simplefilter("error")  # "donated buffers were not usable" would mean the state changed layout
    sharded = onnxtrain.load(mlp_adam(mlp_params(), lr=0.01), devices=jax.devices(), shard_state=True)
    sharded.init()
    for _ in range(10):
        sharded.train_step({"X": x, "Target": t})
for name, value in sharded.state.items():
    np.testing.assert_allclose(np.asarray(value), states[0][name], rtol=1e-5, atol=1e-6, err_msg=name)
    print("sharded", name, value.shape, value.sharding.shard_shape(value.shape))
np.testing.assert_allclose(np.asarray(sharded.infer({"X": x})["Y"]), np.asarray(engine.infer({"X": x})["Y"]),
                           rtol=1e-5, atol=1e-6)
sharded.export(sys.argv[2])
exported = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(sys.argv[2]).graph.initializer}
np.testing.assert_array_equal(exported["W1"], np.asarray(sharded.state["W1"]))
engine = onnxtrain.load(mlp_adam(mlp_params(), lr=0.01), devices=jax.devices())
try:
    engine.train_step({"X": x[:6], "Target": t[:6]})
except onnxtrain.errors.FeedError as exc:
    print("refused:", exc)
# a jax array on another device than a one-device engine's is moved there (the program had refused its sharding)
one = onnxtrain.load(mlp_adam(mlp_params(), lr=0.01), devices=jax.devices()[:1])
elsewhere = jax.device_put(x, jax.devices()[3])
np.testing.assert_array_equal(np.asarray(one.infer({"X": elsewhere})["Y"]), np.asarray(one.infer({"X": x})["Y"]))
one.train_step({"X": elsewhere, "Target": jax.device_put(t, jax.devices()[5])})

# make_trainable(train_mode=True): BatchNorm normalizes with the statistics of the whole batch, not each device's
# rows (torch's SyncBatchNorm, not DDP's BatchNorm), so 8 devices train as one; rows offset per device's share,
# each device's own variance would be far from the whole batch's
from onnx import TensorProto, helper, numpy_helper
params = mlp_params()
bn = {"scale": np.full(8, 1.5, np.float32), "shift": np.full(8, 0.1, np.float32),
      "mean": np.full(8, 0.2, np.float32), "var": np.full(8, 0.7, np.float32)}
graph = helper.make_graph(
    [helper.make_node("MatMul", ["X", "W1"], ["h"]),
     helper.make_node("BatchNormalization", ["h", "scale", "shift", "mean", "var"], ["n"], momentum=0.9),
     helper.make_node("Relu", ["n"], ["r"]), helper.make_node("MatMul", ["r", "W2"], ["Y"])], "bn",
    [helper.make_tensor_value_info("X", onnx.TensorProto.FLOAT, ["N", 4])],
    [helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, ["N", 2])],
    [numpy_helper.from_array(v, n) for n, v in {"W1": params["W1"], "W2": params["W2"], **bn}.items()])
model = onnxtrain.make_trainable(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)]), loss="mse",
                                 optimizer="sgd", learning_rate=0.1, train_mode=True)
shifted = x + np.repeat(np.arange(8, dtype=np.float32), 8)[:, None]
bn_states = []
for devices in (jax.devices()[:1], jax.devices()):
    engine = onnxtrain.load(model, devices=devices)
    engine.train_step({"X": shifted, "target": t})
    h = shifted.astype(np.float64) @ params["W1"]  # the step's forward reads the weights before its update
    np.testing.assert_allclose(np.asarray(engine.state["mean"]), 0.9 * 0.2 + 0.1 * h.mean(0), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(engine.state["var"]), 0.9 * 0.7 + 0.1 * h.var(0, ddof=1), rtol=1e-5)
    engine.train_step({"X": shifted, "target": t})
    bn_states.append({k: np.asarray(v) for k, v in engine.state.items()})
for name in bn_states[0]:
    np.testing.assert_allclose(bn_states[1][name], bn_states[0][name], rtol=1e-5, atol=1e-6, err_msg=name)

# int64 labels stay int64 when split over the devices: device_put outside x64 mode had made them int32, and the
# smoothed cross-entropy's mask of the labels that are not -100 was refused as comparing int32 with int64; the
# count of those labels, which accumulate_by="items" weighs micro-batches by, is the whole batch's on 8 devices
graph = helper.make_graph(
    [helper.make_node("MatMul", ["X", "W1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
     helper.make_node("MatMul", ["r", "W2"], ["Y"])], "mlp",
    [helper.make_tensor_value_info("X", onnx.TensorProto.FLOAT, ["N", 4])],
    [helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, ["N", 2])],
    [numpy_helper.from_array(params[n], n) for n in ("W1", "W2")])
model = onnxtrain.make_trainable(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)]),
                                 loss="cross_entropy", label_smoothing=0.1, optimizer="sgd", learning_rate=0.1,
                                 accumulate=2)
labels = rng.integers(0, 2, 64)
labels[rng.permutation(32)[:20]] = -100  # micro-batches of 12 and 32 labels that count
ce_states = []
for devices in (jax.devices()[:1], jax.devices()):
    engine = onnxtrain.load(model, devices=devices)
    for rows in (slice(0, 32), slice(32, 64)):
        engine.train_step({"X": x[rows], "target": labels[rows]})
    ce_states.append({k: np.asarray(v) for k, v in engine.state.items()})
for name in ce_states[0]:
    np.testing.assert_allclose(ce_states[1][name], ce_states[0][name], rtol=1e-5, atol=1e-6, err_msg=name)
print("EQUAL")
"""


def test_one_and_eight_devices_train_to_the_same_state(tmp_path: Path):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(Path(__file__).parent), str(tmp_path / "t.onnx")],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "8 devices, output sharded over 8" in result.stdout
    assert "refused: feed 'X': batch size 6 is not divisible by the 8 devices" in result.stdout
    assert result.stdout.strip().endswith("EQUAL")
    # W1 [4, 8] split along its columns, W2 [8, 2] along its rows; the step count T (a scalar) stays whole
    assert "sharded W1 (4, 8) (4, 1)" in result.stdout
    assert "sharded W2 (8, 2) (1, 2)" in result.stdout
    assert "sharded T () ()" in result.stdout
