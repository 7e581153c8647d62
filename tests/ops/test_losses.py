"""NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss against the ReferenceEvaluator or NumPy: dtypes, int32
targets, opset 12, ignore_index outside [0, C), gradients and error messages."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import onnxtrain
from nodes import assert_matches_reference, node_model
from onnxtrain.lower.ops import losses
from onnxtrain.lower.target import targeting
from nodes import run_outputs as run

rng = np.random.default_rng(0)


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def scores_and_labels(dtype=np.float32, shape=(3, 5, 2), label_dtype=np.int64):
    scores = rng.standard_normal(shape).astype(dtype)
    labels = rng.integers(0, shape[1], (shape[0], *shape[2:])).astype(label_dtype)
    return scores, labels


def numpy_loss(log_prob, labels, weights=None, reduction="mean", ignore_index=None):
    """PyTorch's definition: 'mean' divides by the total weight of the samples that are not ignored."""
    classes = log_prob.shape[1]
    safe = np.clip(labels, 0, classes - 1)
    picked = np.take_along_axis(log_prob, safe[:, None], axis=1)[:, 0]
    w = np.ones(labels.shape) if weights is None else weights[safe]
    if ignore_index is not None:
        w = np.where(labels == ignore_index, 0.0, w)
    loss = -picked * w
    return {"none": loss, "sum": loss.sum(), "mean": loss.sum() / w.sum()}[reduction]


def log_softmax(x):
    shifted = x - x.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_sce_dtypes_and_reductions(reduction, dtype):
    scores, labels = scores_and_labels(dtype, label_dtype=np.int32)
    weights = rng.uniform(0.5, 2, 5).astype(dtype)
    tol = 5e-3 if dtype == np.float16 else 1e-10
    assert_matches_reference(
        "SoftmaxCrossEntropyLoss",
        {"scores": scores, "labels": labels, "weights": weights},
        n_outputs=2,
        reduction=reduction,
        rtol=tol,
        atol=tol,
    )


@pytest.mark.parametrize("opset", [12, 13])
def test_sce_old_opsets_with_ignore_index(opset):
    scores, labels = scores_and_labels(np.float64, shape=(4, 3))
    labels[1] = -100
    inputs = {"scores": scores, "labels": labels}
    model = node_model("SoftmaxCrossEntropyLoss", inputs, opset=opset, ignore_index=-100)
    (loss,) = run(model, inputs)
    np.testing.assert_allclose(loss, numpy_loss(log_softmax(scores), labels, ignore_index=-100), rtol=1e-12)


@pytest.mark.parametrize("opset", [12, 13, 22])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_nll_weights_and_out_of_range_ignore_index(opset, reduction):
    log_prob, labels = scores_and_labels(np.float64, shape=(4, 3, 2, 2))
    labels[0, 0, 1] = labels[2, 1, 0] = 7  # an ignored label may lie outside [0, C)
    weights = rng.uniform(0.5, 2, 3)
    inputs = {"x": log_prob, "t": labels, "w": weights}
    model = node_model("NegativeLogLikelihoodLoss", inputs, opset=opset, reduction=reduction, ignore_index=7)
    (loss,) = run(model, inputs)
    want = numpy_loss(log_prob, labels, weights, reduction, ignore_index=7)
    assert loss.dtype == np.float64 and loss.shape == np.shape(want)
    np.testing.assert_allclose(loss, want, rtol=1e-12)


def test_nll_mean_without_weights_skips_ignored_samples():
    """NumPy reference: the ReferenceEvaluator counts ignored samples in the mean when ignore_index is -1."""
    log_prob, labels = scores_and_labels(np.float32, shape=(6, 4))
    labels[[1, 4]] = -1
    inputs = {"x": log_prob, "t": labels}
    (loss,) = run(node_model("NegativeLogLikelihoodLoss", inputs, ignore_index=-1), inputs)
    # (atol: random log_prob of both signs cancel in the sum, and a GPU adds float32 in another order)
    np.testing.assert_allclose(loss, numpy_loss(log_prob, labels, ignore_index=-1), rtol=1e-6, atol=1e-6)


# the picked log-likelihood is a gather on the CPU and a one-hot sum elsewhere (losses.picked): both are traced here
PLATFORMS = pytest.mark.parametrize("platform", ["cpu", "gpu"])


@PLATFORMS
def test_sce_gradient_matches_softmax_minus_onehot(platform):
    scores, labels = scores_and_labels(np.float64, shape=(4, 3))
    labels[2] = 5  # ignored, and outside the classes
    with targeting(platform):
        grad = jax.jit(jax.grad(
            lambda s: losses.softmax_cross_entropy_loss(s, labels, reduction="sum", ignore_index=5)[0]))(scores)
    probs = np.exp(log_softmax(scores))
    onehot = np.eye(3)[np.clip(labels, 0, 2)]
    want = (probs - onehot) * (labels != 5)[:, None]
    np.testing.assert_allclose(grad, want, rtol=1e-10, atol=1e-12)


def test_every_sample_ignored_is_a_nan_mean_with_a_zero_gradient():
    """PyTorch's cross_entropy over labels that are all ignore_index: 0 / 0, a NaN loss, and a zero gradient (its
    backward writes nothing for ignored samples). The gradient had been NaN: 1 / 0 times the samples' zeros."""
    torch = pytest.importorskip("torch")
    scores, labels = rng.standard_normal((4, 3)), np.full(4, -100, np.int64)
    value, grad = jax.value_and_grad(
        lambda s: losses.softmax_cross_entropy_loss(s, labels, reduction="mean", ignore_index=-100)[0])(scores)
    torch_scores = torch.from_numpy(scores).requires_grad_()
    expected = torch.nn.functional.cross_entropy(torch_scores, torch.from_numpy(labels))
    expected.backward()
    assert np.isnan(float(value)) and np.isnan(expected.item())
    np.testing.assert_array_equal(grad, torch_scores.grad.numpy())


@PLATFORMS
def test_nll_gradient_with_weights_and_mean(platform):
    log_prob, labels = scores_and_labels(np.float64)
    weights = rng.uniform(0.5, 2, 5)
    fn = lambda x, w: losses.negative_log_likelihood_loss(x, labels, w, reduction="mean")  # noqa: E731
    with targeting(platform):
        np.testing.assert_allclose(fn(log_prob, weights), numpy_loss(log_prob, labels, weights), rtol=1e-12)
        check_grads(fn, (log_prob, weights), order=1, modes=["rev"])


def test_unknown_reduction_is_rejected_by_name():
    scores, labels = scores_and_labels(shape=(2, 3))
    inputs = {"s": scores, "l": labels}
    with pytest.raises(onnxtrain.errors.NodeError, match="reduction must be one of.*'avg'"):
        run(node_model("SoftmaxCrossEntropyLoss", inputs, reduction="avg"), inputs)


def test_label_shape_mismatch_is_reported():
    scores, _ = scores_and_labels(shape=(2, 3, 4))
    labels = np.zeros((2, 5), np.int64)
    with pytest.raises(onnxtrain.errors.NodeError, match=r"target shape \(2, 5\) does not fit input shape \(2, 3, 4\)"):
        run(node_model("NegativeLogLikelihoodLoss", {"s": scores, "l": labels}), {"s": scores, "l": labels})


@pytest.mark.parametrize("op_type", ["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"])
def test_a_float_target_is_refused_as_not_class_indices(op_type):
    """torch.onnx.export(dynamo=True) of F.cross_entropy(scores, probabilities) writes SoftmaxCrossEntropyLoss with
    the float probabilities as its target (ONNX Runtime refuses the model: Tind is int32 or int64). The error had
    been 'target shape (2, 3) does not fit input shape (2, 3)'."""
    scores, _ = scores_and_labels(shape=(2, 3))
    inputs = {"s": scores, "l": np.full((2, 3), 1 / 3, np.float32)}
    with pytest.raises(onnxtrain.errors.NodeError, match=rf"{op_type}.*target is float32, not class indices"):
        run(node_model(op_type, inputs), inputs)


def test_sce_is_usable_as_a_training_loss_under_jit():
    scores, labels = scores_and_labels(np.float32, shape=(8, 4))
    step = jax.jit(jax.value_and_grad(lambda s: losses.softmax_cross_entropy_loss(s, labels, reduction="mean")[0]))
    value, grad = step(jnp.asarray(scores))
    np.testing.assert_allclose(value, numpy_loss(log_softmax(scores), labels), rtol=1e-5)
    np.testing.assert_allclose(grad.sum(axis=1), 0, atol=1e-6)  # softmax minus one-hot sums to zero per row


@PLATFORMS
@pytest.mark.parametrize("ignore_index", [None, -100])
def test_a_label_outside_the_classes_is_a_nan_loss_not_the_clipped_class_s(ignore_index, platform):
    """A label outside [0, C) that is not ignore_index has no loss: PyTorch raises ('Target 7 is out of bounds'),
    ONNX Runtime too. It is NaN in the per-sample losses and their mean, where the clipped gather had computed
    class C - 1's loss; the other samples' losses and gradients are NumPy's."""
    scores, labels = scores_and_labels(np.float64, shape=(4, 3))
    labels[1] = 7
    with targeting(platform):
        loss, _ = losses.softmax_cross_entropy_loss(scores, labels, reduction="none", ignore_index=ignore_index)
        mean = losses.softmax_cross_entropy_loss(scores, labels, reduction="mean", ignore_index=ignore_index)[0]
        grad = jax.grad(lambda s: losses.softmax_cross_entropy_loss(s, labels, reduction="sum")[0])(scores)
    want = numpy_loss(log_softmax(scores), labels, reduction="none")
    assert np.isnan(loss[1]) and np.isnan(mean)
    np.testing.assert_allclose(np.delete(np.asarray(loss), 1), np.delete(want, 1), rtol=1e-12)
    probs = np.exp(log_softmax(scores))
    want_grad = (probs - np.eye(3)[np.clip(labels, 0, 2)]) * (labels != 7)[:, None]
    np.testing.assert_allclose(grad, want_grad, rtol=1e-10, atol=1e-12)


@PLATFORMS
def test_a_small_loss_and_its_gradient_are_torch_s_float32_numbers(platform):
    """Scores whose label is the largest by a wide margin: a loss of ~1e-3, as a model trained to fit gives. The
    logsumexp less the label's score cancelled there to the scores' ulp (1e-4 of the loss), and a model trained
    on it drifted from PyTorch's; torch's order (the scores less their maximum, less the log of the sum of their
    exponentials) keeps the digits, and so does its backward's softmax."""
    torch = pytest.importorskip("torch")
    scores = rng.normal(size=(6, 5)).astype(np.float32) + 5
    labels = np.argmax(scores, axis=1)
    scores[np.arange(6), labels] += 7
    with targeting(platform):
        value, grad = jax.jit(jax.value_and_grad(
            lambda s: losses.softmax_cross_entropy_loss(s, labels, reduction="mean")[0]))(scores)
    torch_scores = torch.from_numpy(scores).requires_grad_()
    expected = torch.nn.functional.cross_entropy(torch_scores, torch.from_numpy(labels))
    expected.backward()
    assert 1e-4 < expected.item() < 1e-2
    np.testing.assert_allclose(float(value), expected.item(), rtol=2e-6)
    np.testing.assert_allclose(grad, torch_scores.grad.numpy(), rtol=2e-6, atol=1e-9)
