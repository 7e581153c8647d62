"""Activations and the softmax family: dtypes, attributes, legacy versions, gradients, errors."""

from __future__ import annotations

import math

import jax
import numpy as np
import onnx
import pytest

import onnxtrain
from nodes import assert_matches_reference, node_model, lowering
from onnxtrain.errors import NodeError
from onnxtrain.lower.registry import schema_for

X = np.array([[-3.0, -1.0, -0.25, 0.0], [0.25, 1.0, 2.5, 40.0]])


def ours(op_type: str, inputs: dict[str, np.ndarray], opset: int | None = None, **attrs) -> np.ndarray:
    model = node_model(op_type, inputs, opset=opset, **attrs)
    return np.asarray(onnxtrain.load(model, check=False).infer(inputs)["out0"])


CASES = [
    ("LeakyRelu", {}), ("LeakyRelu", {"alpha": 0.3}), ("Elu", {}), ("Elu", {"alpha": 2.0}), ("Selu", {}),
    ("Selu", {"alpha": 2.0, "gamma": 3.0}), ("Celu", {}), ("Celu", {"alpha": 2.0}), ("HardSigmoid", {}),
    ("HardSigmoid", {"alpha": 0.5, "beta": 0.6}), ("HardSwish", {}), ("Softplus", {}), ("ThresholdedRelu", {}),
    ("ThresholdedRelu", {"alpha": 0.5}), ("Shrink", {}), ("Shrink", {"lambd": 1.5, "bias": 0.5}), ("Gelu", {}),
    ("Gelu", {"approximate": "tanh"}), ("Mish", {}), ("Swish", {}), ("Swish", {"alpha": 0.5}),
]


@pytest.mark.parametrize(("op_type", "attrs", "dtype"),
                         [(op_type, attrs, np.float64) for op_type, attrs in CASES]
                         + [(op_type, attrs, np.float32) for op_type, attrs in CASES if not attrs])
def test_activation_matches_reference(op_type, attrs, dtype):
    assert_matches_reference(op_type, {"x": X.astype(dtype)}, rtol=1e-5 if dtype == np.float32 else 1e-12, **attrs)


@pytest.mark.parametrize("op_type", ["LeakyRelu", "Elu", "Selu", "HardSigmoid", "HardSwish", "Gelu", "Mish"])
def test_float16_stays_float16(op_type):
    got = ours(op_type, {"x": X.astype(np.float16)})
    assert got.dtype == np.float16
    assert np.isfinite(got).all()


@pytest.mark.parametrize("dtype", [np.int32, np.uint8])
def test_shrink_on_integers(dtype):
    x = np.array([0, 1, 2, 3, 9], dtype)
    got = ours("Shrink", {"x": x}, lambd=1.5, bias=1.0)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, np.array([0, 0, 1, 2, 8], dtype))


@pytest.mark.parametrize("opset", [1, 6])
def test_legacy_versions(opset):
    """consumed_inputs (version 1) is accepted and ignored; the math is unchanged."""
    legacy = {"consumed_inputs": [0]} if opset == 1 else {}
    x = X.astype(np.float32)
    np.testing.assert_allclose(ours("Elu", {"x": x}, opset=opset, **legacy), np.where(x >= 0, x, np.expm1(x)),
                               rtol=1e-6)
    np.testing.assert_allclose(
        ours("LeakyRelu", {"x": x}, opset=opset, alpha=0.1, **legacy), np.where(x >= 0, x, 0.1 * x), rtol=1e-6
    )


def test_gelu_bad_approximate_is_a_node_error():
    with pytest.raises(NodeError, match="Gelu.*approximate"):
        ours("Gelu", {"x": X}, approximate="erf")


@pytest.mark.parametrize("slope_shape", [(1,), (4,), (2, 4), (2, 1)])
def test_prelu_broadcasts_slope(slope_shape):
    slope = np.linspace(0.1, 0.8, math.prod(slope_shape)).reshape(slope_shape)
    assert_matches_reference("PRelu", {"x": X, "slope": slope})


def test_prelu_integers():
    x = np.array([[-4, 3], [5, -6]], np.int64)
    got = ours("PRelu", {"x": x, "slope": np.array([2, 3], np.int64)})
    np.testing.assert_array_equal(got, [[-8, 3], [5, -18]])


@pytest.mark.parametrize("opset", [1, 6])
def test_prelu_before_7_has_one_slope_per_channel(opset):
    x = np.arange(-12, 12, dtype=np.float32).reshape(2, 3, 4)
    slope = np.array([0.1, 0.2, 0.3], np.float32)
    legacy = {"consumed_inputs": [0, 0]} if opset == 1 else {}
    got = ours("PRelu", {"x": x, "slope": slope}, opset=opset, **legacy)
    np.testing.assert_allclose(got, np.where(x < 0, x * slope[:, None], x), rtol=1e-6)


def softmax(x: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    e = np.exp(x - x.max(axis=axes, keepdims=True))
    return e / e.sum(axis=axes, keepdims=True)


def hardmax(x: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    """One at the first maximum over the flattened `axes` (which are trailing)."""
    lead = x.shape[: axes[0]]
    flat = x.reshape(math.prod(lead), -1)
    out = np.zeros_like(flat)
    out[np.arange(flat.shape[0]), flat.argmax(axis=1)] = 1
    return out.reshape(x.shape)


NORMALIZERS = {
    "Softmax": softmax,
    "LogSoftmax": lambda x, axes: np.log(softmax(x, axes)),
    "Hardmax": hardmax,
}
X3 = np.random.default_rng(0).normal(size=(2, 3, 4))


@pytest.mark.parametrize("op_type", NORMALIZERS)
@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_normalizers_along_one_axis(op_type, axis):
    assert_matches_reference(op_type, {"x": X3}, axis=axis, rtol=1e-10)


@pytest.mark.parametrize("op_type", NORMALIZERS)
@pytest.mark.parametrize(("opset", "axis"), [(1, None), (1, 0), (1, 2), (11, -2), (11, 1)])
def test_normalizers_before_13_flatten_the_tail(op_type, opset, axis):
    """Versions 1 and 11 coerce the input to 2-D at `axis` (default 1): every dim from `axis` on together."""
    attrs = {} if axis is None else {"axis": axis}
    start = (1 if axis is None else axis) % X3.ndim
    got = ours(op_type, {"x": X3}, opset=opset, **attrs)
    np.testing.assert_allclose(got, NORMALIZERS[op_type](X3, tuple(range(start, X3.ndim))), rtol=1e-10)


def test_hardmax_picks_the_first_of_ties():
    x = np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0]], np.float32)
    np.testing.assert_array_equal(ours("Hardmax", {"x": x}), [[0, 1, 0], [1, 0, 0]])


def test_softmax_large_values_and_float16():
    x = np.array([[1000.0, 1000.0, -1000.0]], np.float32)
    np.testing.assert_allclose(ours("Softmax", {"x": x}), [[0.5, 0.5, 0.0]])
    log2 = math.log(2)
    np.testing.assert_allclose(ours("LogSoftmax", {"x": x}), [[-log2, -log2, -2000 - log2]], rtol=1e-6)
    half = ours("Softmax", {"x": X3.astype(np.float16)})
    assert half.dtype == np.float16
    np.testing.assert_allclose(half, softmax(X3, (2,)), atol=2e-3)


def test_softmax_gradient():
    x = X3[0]
    weights = np.arange(12.0).reshape(3, 4)
    with jax.enable_x64(True):  # as the engine runs
        grad = jax.jit(jax.grad(lambda v: (lowering("Softmax")(v, axis=-1) * weights).sum()))(x)
    s = softmax(x, (1,))
    expected = s * (weights - (s * weights).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(grad, expected, rtol=1e-10)


@pytest.mark.parametrize(("op_type", "derivative"), [
    ("Elu", lambda x: np.where(x >= 0, 1.0, np.exp(x))),
    ("Selu", lambda x: 1.05070102214813232421875 * np.where(x > 0, 1.0, 1.67326319217681884765625 * np.exp(x))),
    ("Softplus", lambda x: 1 / (1 + np.exp(-x))),
    ("LeakyRelu", lambda x: np.where(x >= 0, 1.0, 0.01)),
    ("HardSigmoid", lambda x: np.where(np.abs(0.2 * x + 0.5 - 0.5) < 0.5, 0.2, 0.0)),
])
def test_activation_gradients_are_finite_and_exact(op_type, derivative):
    """Large inputs must not overflow into the gradient of the branch jnp.where discards."""
    x = np.array([-30.0, -1.0, -0.5, 0.5, 1.0, 800.0])
    fn = lowering(op_type)
    defaults = {name: onnx.helper.get_attribute_value(a.default_value)
                for name, a in schema_for("", op_type, onnx.defs.onnx_opset_version()).attributes.items()}
    with jax.enable_x64(True):
        grad = jax.jit(jax.grad(lambda v: fn(v, **defaults).sum()))(x)
    assert np.isfinite(grad).all()
    with np.errstate(over="ignore"):
        np.testing.assert_allclose(grad, derivative(x), rtol=1e-6, atol=1e-15)
