"""Normalization ops against onnx's ReferenceEvaluator or NumPy: dtypes, old opsets, training-mode batch
statistics and gradients (checked against finite differences)."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from onnx import TensorProto, helper

import onnxtrain
from nodes import assert_matches_reference, node_model
from onnxtrain.lower.ops import normalization as norm
from onnxtrain.lower.layout import channels_first
from training_models import model as training_model
from training_models import tensor, vi
from nodes import run_outputs as run

rng = np.random.default_rng(0)


@pytest.fixture(autouse=True)
def x64():
    """Direct calls to the lowerings need what the engine sets around its traces."""
    with jax.enable_x64(True):
        yield


def randn(*shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def bn_inputs(dtype=np.float32, channels=3, shape=(2, 3, 4, 5)):
    return {
        "x": randn(*shape, dtype=dtype),
        "scale": randn(channels, dtype=dtype),
        "bias": randn(channels, dtype=dtype),
        "mean": randn(channels, dtype=dtype),
        "var": rng.uniform(0.5, 2.0, channels).astype(dtype),
    }


def numpy_batch_norm(x, scale, bias, mean, var, epsilon=1e-5, axes=(0, 2, 3)):
    shape = [1] * x.ndim
    shape[1] = -1
    r = lambda v: np.reshape(v, shape)  # noqa: E731
    return (x - r(mean)) / np.sqrt(r(var) + epsilon) * r(scale) + r(bias)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_batch_norm_inference_keeps_dtype(dtype):
    rtol = 2e-3 if dtype == np.float16 else 1e-5
    assert_matches_reference("BatchNormalization", bn_inputs(dtype), rtol=rtol, atol=rtol)


@pytest.mark.parametrize("opset", [6, 7, 9, 14])
def test_batch_norm_old_opsets_inference(opset):
    inputs = bn_inputs()
    attrs = {"is_test": 1} if opset == 6 else {}
    model = node_model("BatchNormalization", inputs, opset=opset, **attrs)
    (y,) = run(model, inputs)
    np.testing.assert_allclose(y, numpy_batch_norm(*inputs.values()), rtol=1e-5, atol=1e-5)


def expected_training(inputs, momentum=0.9, epsilon=1e-5, axes=(0, 2, 3)):
    momentum = float(np.float32(momentum))  # an ONNX float attribute
    x = inputs["x"].astype(np.float64)
    mean, var = x.mean(axis=axes), x.var(axis=axes)
    y = numpy_batch_norm(x, inputs["scale"], inputs["bias"], mean, var, epsilon)
    running_mean = inputs["mean"] * momentum + mean * (1 - momentum)
    running_var = inputs["var"] * momentum + var * (1 - momentum)
    return y, running_mean, running_var, mean, var


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_batch_norm_training_mode_batch_statistics(dtype):
    inputs = bn_inputs(dtype)
    model = node_model("BatchNormalization", inputs, n_outputs=3, training_mode=1, momentum=0.8)
    ours = run(model, inputs)
    tol = 3e-3 if dtype == np.float16 else 1e-12
    for mine, want in zip(ours, expected_training(inputs, momentum=0.8)):
        assert mine.dtype == dtype
        np.testing.assert_allclose(mine.astype(np.float64), want, rtol=tol, atol=tol)


def test_batch_norm_15_mixed_dtypes():
    inputs = bn_inputs(np.float16)
    inputs["scale"] = inputs["scale"].astype(np.float32)
    inputs["bias"] = inputs["bias"].astype(np.float32)
    inputs["mean"] = inputs["mean"].astype(np.float64)
    inputs["var"] = inputs["var"].astype(np.float64)
    model = node_model("BatchNormalization", inputs, n_outputs=3, training_mode=1)
    y, running_mean, running_var = run(model, inputs)
    assert (y.dtype, running_mean.dtype, running_var.dtype) == (np.float16, np.float64, np.float64)
    want = expected_training(inputs)
    np.testing.assert_allclose(y, want[0], rtol=3e-3, atol=3e-3)
    np.testing.assert_allclose(running_var, want[2], rtol=1e-3)  # statistics of float16 data


def test_batch_norm_legacy_training_via_extra_outputs():
    """Opsets 7/9 have no mode attribute: asking for the running statistics means training."""
    inputs = bn_inputs(np.float64)
    model = node_model("BatchNormalization", inputs, n_outputs=5, opset=9)
    for mine, want in zip(run(model, inputs), expected_training(inputs)):
        np.testing.assert_allclose(mine, want, rtol=1e-12, atol=1e-12)


def test_batch_norm_opset6_is_test_0_is_training():
    inputs = bn_inputs(np.float64)
    (y,) = run(node_model("BatchNormalization", inputs, opset=6, is_test=0), inputs)
    np.testing.assert_allclose(y, expected_training(inputs)[0], rtol=1e-12, atol=1e-12)


def test_batch_norm_opset7_non_spatial():
    """spatial=0: one statistic per (channel, position), reduced over the batch only."""
    x = randn(4, 3, 2, dtype=np.float64)
    params = {n: rng.uniform(0.5, 2, (3, 2)) for n in ("scale", "bias", "mean", "var")}
    inputs = {"x": x, **params}
    model = node_model("BatchNormalization", inputs, n_outputs=5, opset=7, spatial=0)
    y, running_mean, *_ = run(model, inputs)
    mean, var = x.mean(axis=0), x.var(axis=0)
    epsilon = float(np.float32(1e-5))  # a float attribute is a float32
    want = (x - mean) / np.sqrt(var + epsilon) * params["scale"] + params["bias"]
    np.testing.assert_allclose(y, want, rtol=1e-12)
    momentum = float(np.float32(0.9))
    np.testing.assert_allclose(running_mean, params["mean"] * momentum + mean * (1 - momentum), rtol=1e-12)


def test_batch_norm_training_gradient():
    inputs = {k: v.astype(np.float64) for k, v in bn_inputs().items()}

    def loss(x, scale):
        y = channels_first(norm.batch_normalization(
            x, scale, inputs["bias"], inputs["mean"], inputs["var"], epsilon=1e-5, momentum=0.9, training_mode=1,
            ctx=SimpleNamespace(node=SimpleNamespace(metadata={})),  # a node without make_trainable's records
        )[0])
        return jnp.sum(y * jnp.arange(y.size).reshape(y.shape))

    check_grads(loss, (inputs["x"], inputs["scale"]), order=1, modes=["rev"])


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_instance_norm(dtype):
    x = randn(2, 3, 4, 5, dtype=dtype)
    tol = 3e-3 if dtype == np.float16 else 1e-5
    assert_matches_reference(
        "InstanceNormalization", {"x": x, "s": randn(3, dtype=dtype), "b": randn(3, dtype=dtype)}, rtol=tol, atol=tol
    )


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_layer_norm_outputs_and_stash_dtype(axis):
    x = randn(3, 4, 5)
    scale = randn(*x.shape[axis % 3 :])
    assert_matches_reference("LayerNormalization", {"x": x, "s": scale, "b": scale + 1}, n_outputs=3, axis=axis)


def test_layer_norm_float16_keeps_float32_statistics():
    x = randn(3, 8, dtype=np.float16)
    inputs = {"x": x, "s": np.ones(8, np.float16)}
    y, mean, inv_std = run(node_model("LayerNormalization", inputs, n_outputs=3), inputs)
    assert (y.dtype, mean.dtype, inv_std.dtype) == (np.float16, np.float32, np.float32)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(mean[:, 0], x64.mean(axis=1), rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(inv_std[:, 0], 1 / np.sqrt(x64.var(axis=1) + 1e-5), rtol=1e-3)


def test_layer_norm_float64_is_exact():
    x = randn(3, 8, dtype=np.float64) * 1e3 + 1e4
    inputs = {"x": x, "s": np.ones(8)}
    (y,) = run(node_model("LayerNormalization", inputs, stash_type=11), inputs)
    want = (x - x.mean(1, keepdims=True)) / np.sqrt(x.var(1, keepdims=True) + 1e-5)
    assert y.dtype == np.float64
    np.testing.assert_allclose(y, want, rtol=1e-10, atol=1e-10)


def test_layer_norm_gradient():
    x, scale = randn(3, 6, dtype=np.float64), randn(6, dtype=np.float64)
    fn = lambda x, s: norm.layer_normalization(x, s, axis=-1, epsilon=1e-5, stash_type=11)[0] ** 2  # noqa: E731
    check_grads(fn, (x, scale), order=1, modes=["rev"])


def numpy_group_norm(x, scale, bias, groups, epsilon=1e-5):
    grouped = x.reshape(x.shape[0], groups, -1)
    y = (grouped - grouped.mean(-1, keepdims=True)) / np.sqrt(grouped.var(-1, keepdims=True) + epsilon)
    shape = (1, -1) + (1,) * (x.ndim - 2)
    return y.reshape(x.shape) * scale.reshape(shape) + bias.reshape(shape)


def test_group_norm_21_per_channel():
    x, scale, bias = randn(2, 6, 3, dtype=np.float64), randn(6, dtype=np.float64), randn(6, dtype=np.float64)
    inputs = {"x": x, "s": scale, "b": bias}
    (y,) = run(node_model("GroupNormalization", inputs, num_groups=3, stash_type=11), inputs)
    np.testing.assert_allclose(y, numpy_group_norm(x, scale, bias, 3), rtol=1e-10, atol=1e-10)


def test_group_norm_18_per_group():
    x, scale, bias = randn(2, 6, 3), randn(3), randn(3)
    inputs = {"x": x, "s": scale, "b": bias}
    (y,) = run(node_model("GroupNormalization", inputs, opset=18, num_groups=3), inputs)
    want = numpy_group_norm(x, np.repeat(scale, 2), np.repeat(bias, 2), 3)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


def test_group_norm_rejects_indivisible_groups():
    inputs = {"x": randn(1, 5, 2), "s": randn(5), "b": randn(5)}
    with pytest.raises(onnxtrain.errors.NodeError, match="num_groups=2 does not divide the 5 channels"):
        run(node_model("GroupNormalization", inputs, num_groups=2), inputs)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_rms_norm(dtype):
    tol = 2e-3 if dtype == np.float16 else 1e-5
    x = randn(2, 3, 4, dtype=dtype)
    assert_matches_reference("RMSNormalization", {"x": x, "s": randn(3, 4, dtype=dtype)}, axis=1, rtol=tol, atol=tol)


def test_rms_norm_output_takes_scale_dtype():
    x, scale = randn(2, 8, dtype=np.float16), randn(8)
    inputs = {"x": x, "s": scale}
    (y,) = run(node_model("RMSNormalization", inputs), inputs)
    assert y.dtype == np.float32
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(y, x64 / np.sqrt((x64**2).mean(1, keepdims=True) + 1e-5) * scale, rtol=2e-3)


@pytest.mark.parametrize("size", [1, 2, 3, 5])
@pytest.mark.parametrize("opset", [1, 13])
def test_lrn_window_sizes(size, opset):
    """NumPy reference: the ReferenceEvaluator's LRN loops over the batch axis instead of the channels."""
    x = randn(2, 6, 3, 3, dtype=np.float64)
    model = node_model("LRN", {"x": x}, opset=opset, size=size, alpha=0.01, beta=0.75, bias=1.5)
    (y,) = run(model, {"x": x})
    square_sum = np.zeros_like(x)
    for c in range(x.shape[1]):
        window = slice(max(0, c - (size - 1) // 2), c + size // 2 + 1)
        square_sum[:, c] = (x[:, window] ** 2).sum(axis=1)
    alpha, beta = float(np.float32(0.01)), float(np.float32(0.75))
    np.testing.assert_allclose(y, x / (1.5 + alpha / size * square_sum) ** beta, rtol=1e-12)


@pytest.mark.parametrize("p", [1, 2])
def test_lp_norm_zero_rows_are_zero_with_finite_gradient(p):
    """NumPy reference: the ReferenceEvaluator's p=1 norm forgets the absolute value."""
    x = np.array([[3.0, -4.0], [0.0, 0.0]])
    (y,) = run(node_model("LpNormalization", {"x": x}, p=p, axis=1), {"x": x})
    norm_of_row = np.abs(x[0]).sum() if p == 1 else 5.0
    np.testing.assert_allclose(y, [x[0] / norm_of_row, [0.0, 0.0]], rtol=1e-12)
    grad = jax.grad(lambda v: jnp.sum(norm.lp_normalization(v, axis=1, p=p) * jnp.array([1.0, 2.0])))(x)
    assert np.all(np.isfinite(grad))


def test_mean_variance_normalization_axes():
    x = randn(2, 3, 4, dtype=np.float64)
    (y,) = run(node_model("MeanVarianceNormalization", {"x": x}, axes=[0, -1]), {"x": x})
    want = (x - x.mean((0, 2), keepdims=True)) / (x.std((0, 2), keepdims=True) + 1e-9)
    np.testing.assert_allclose(y, want, rtol=1e-10)


def test_running_statistics_bound_as_state_update_each_train_step():
    """A training model binds BatchNormalization's running_mean/running_var outputs to its mean/var inputs."""
    params = {k: v for k, v in bn_inputs().items() if k != "x"}
    node = helper.make_node(
        "BatchNormalization", ["X", *params], ["Y", "mean_new", "var_new"], training_mode=1, momentum=0.5
    )
    graph = helper.make_graph(
        [node],
        "bn",
        [vi("X", TensorProto.FLOAT, [2, 3, 4, 5])],
        [vi("Y"), vi("mean_new"), vi("var_new")],
        [tensor(name, value) for name, value in params.items()],
    )
    algorithm = helper.make_graph([helper.make_node("Identity", ["Y"], ["Y2"])], "report", [], [vi("Y2")])
    info = helper.make_training_info(algorithm, [("mean", "mean_new"), ("var", "var_new")], None, None)
    engine = onnxtrain.load(training_model(graph, [info], opset=15), check=False)
    x = randn(2, 3, 4, 5)
    for _ in range(2):
        engine.train_step({"X": x})
    batch_mean, batch_var = x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3))
    np.testing.assert_allclose(engine.state["mean"], params["mean"] * 0.25 + batch_mean * 0.75, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(engine.state["var"], params["var"] * 0.25 + batch_var * 0.75, rtol=1e-5, atol=1e-6)
