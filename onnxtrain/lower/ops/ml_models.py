"""ai.onnx.ml linear models and support vector machines (shared helpers: ml.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .ml import (
    as_float, as_rows, class_labels, classifier_input, float_attr, matmul_weights, ml_op, pick, probit,
    transform_scores,
)
from ..values import Value


# ---- linear models -------------------------------------------------------------------------------------------


def _affine(x: Value, coefficients: Sequence[float], intercepts: Sequence[float] | None) -> Value:
    """x @ W.T + b for coefficients W flattened row-major as [outputs, features]."""
    weights = np.asarray(coefficients, dtype=x.dtype)
    if weights.size % x.shape[1]:
        raise ValueError(f"{weights.size} coefficients do not split into rows of {x.shape[1]} features")
    return matmul_weights(x, weights.reshape(-1, x.shape[1]).T) + float_attr(intercepts, x.dtype, [0.0])


@ml_op("LinearRegressor")
def linear_regressor(
    X: Value,
    *,
    coefficients: list[float] | None = None,
    intercepts: list[float] | None = None,
    targets: int = 1,
    post_transform: str = "NONE",
) -> Value:
    scores = _affine(as_rows(as_float(X)), coefficients or [], intercepts)
    if scores.shape[1] != targets:
        raise ValueError(f"the coefficients give {scores.shape[1]} targets, the targets attribute says {targets}")
    return transform_scores(scores, post_transform).astype(np.float32)


@ml_op("LinearClassifier")
def linear_classifier(
    X: Value,
    *,
    coefficients: list[float],
    classlabels_ints: list[int] | None = None,
    classlabels_strings: list[str] | None = None,
    intercepts: list[float] | None = None,
    multi_class: int = 0,
    post_transform: str = "NONE",
) -> tuple[Value, Value]:
    labels = class_labels(classlabels_ints, classlabels_strings)
    scores = _affine(as_rows(as_float(classifier_input(X, labels))), coefficients, intercepts)
    if scores.shape[1] == 1 and len(labels) == 2:  # one score for two classes: the first class scores its negation
        scores = jnp.concatenate([-scores, scores], axis=1)
    scores = transform_scores(scores, post_transform)
    if scores.shape[1] > 1:
        chosen = pick(labels, jnp.argmax(scores, axis=1)) if len(labels) else jnp.argmax(scores, axis=1)
    else:  # one class: it is chosen where the score passes the threshold, else 0 ("" for strings)
        passed = scores[:, 0] >= (0 if post_transform == "NONE" else 0.5)
        positive = labels[:1] if len(labels) else np.ones(1, np.int64)
        negative = np.asarray([""] if labels.dtype == object else [0], dtype=positive.dtype)
        chosen = pick(np.concatenate([negative, positive]), passed.astype(np.int64))
    return chosen, scores.astype(np.float32)


# ---- support vector machines ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kernel:
    kind: str
    gamma: float
    coef0: float
    degree: int

    @staticmethod
    def of(kernel_type: str, kernel_params: Sequence[float] | None) -> "Kernel":
        gamma, coef0, degree = (list(kernel_params) + [0.0, 0.0, 0.0])[:3] if kernel_params else (0.0, 0.0, 0.0)
        kind = kernel_type.upper()
        if kind not in ("LINEAR", "POLY", "RBF", "SIGMOID"):
            raise ValueError(f"unknown kernel_type {kernel_type!r}; expected LINEAR, POLY, RBF or SIGMOID")
        return Kernel(kind, float(gamma), float(coef0), int(degree))

    def __call__(self, x: Value, vectors: np.ndarray) -> Value:
        """[N, V]: the kernel of every sample with every support vector."""
        vectors = vectors.astype(x.dtype)
        if self.kind == "RBF":
            squared = (
                jnp.sum(x * x, axis=1, keepdims=True)
                - 2 * matmul_weights(x, vectors.T)
                + np.sum(vectors * vectors, axis=1)
            )
            return jnp.exp(-self.gamma * jnp.maximum(squared, 0))
        dot = matmul_weights(x, vectors.T)
        if self.kind == "POLY":
            return (dot * self.gamma + self.coef0) ** self.degree
        if self.kind == "SIGMOID":
            return jnp.tanh(dot * self.gamma + self.coef0)
        return dot


@ml_op("SVMRegressor")
def svm_regressor(
    X: Value,
    *,
    coefficients: list[float] | None = None,
    kernel_params: list[float] | None = None,
    kernel_type: str = "LINEAR",
    n_supports: int = 0,
    one_class: int = 0,
    post_transform: str = "NONE",
    rho: list[float] | None = None,
    support_vectors: list[float] | None = None,
) -> Value:
    x = as_rows(as_float(X))
    weights = np.asarray(coefficients or [], dtype=x.dtype)
    if n_supports > 0:
        vectors = np.asarray(support_vectors, dtype=x.dtype).reshape(n_supports, -1)
        features = Kernel.of(kernel_type, kernel_params)(x, vectors)
    else:  # a linear SVM: the coefficients are the weights of the features themselves
        features = x
    score = matmul_weights(features, weights.reshape(-1, 1)) + float_attr(rho, x.dtype, [0.0])[0]
    if one_class:
        score = jnp.where(score > 0, 1, -1).astype(x.dtype)
    return transform_scores(score, post_transform).astype(np.float32)


def _one_vs_one(
    x: Value, kernel: Value, weights: np.ndarray, offsets: np.ndarray, counts: np.ndarray, n_classes: int
) -> tuple[Value, Value, np.ndarray, np.ndarray]:
    """libsvm's SVC: (decision values [N, P], votes [N, C], first class [P], second class [P]). Pair (i, j) of
    the libsvm order weighs class i's support vectors with coefficient row j-1 and class j's with row i; all
    pairs are one matmul with the kernel values."""
    coefficients = weights.reshape(-1, int(counts.sum()))
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    pairs = [(i, j) for i in range(len(counts)) for j in range(i + 1, len(counts))]
    pair_weights = np.zeros((len(pairs), coefficients.shape[1]), x.dtype)
    for p, (i, j) in enumerate(pairs):
        own_i, own_j = slice(starts[i], starts[i] + counts[i]), slice(starts[j], starts[j] + counts[j])
        pair_weights[p, own_i] = coefficients[j - 1, own_i]
        pair_weights[p, own_j] = coefficients[i, own_j]
    first, second = (np.asarray([pair[k] for pair in pairs], dtype=np.int64) for k in (0, 1))
    decisions = matmul_weights(kernel, pair_weights.T) + offsets[: len(pairs)]
    wins = jnp.where(decisions > 0, first, second)
    votes = jnp.sum(wins[:, :, None] == jnp.arange(n_classes), axis=1).astype(x.dtype)
    return decisions, votes, first, second


def _pairwise_coupling(pairwise: Value, first: np.ndarray, second: np.ndarray, n_classes: int) -> Value:
    """Class probabilities [N, C] from pairwise ones [N, P]: libsvm's multiclass_probability (Wu, Lin and Weng),
    a Gauss-Seidel solve run per row until it converges or max(100, C) sweeps are done."""
    n = pairwise.shape[0]
    r = jnp.zeros((n, n_classes, n_classes), pairwise.dtype)
    r = r.at[:, first, second].set(pairwise).at[:, second, first].set(1 - pairwise)
    q = -r * jnp.swapaxes(r, 1, 2)  # Q[t, j] = -r[j, t] r[t, j] off the diagonal
    diagonal = jnp.arange(n_classes)
    q = q.at[:, diagonal, diagonal].set(jnp.sum(r * r, axis=1))  # Q[t, t] = sum over j of r[j, t]^2
    eps, sweeps = 0.005 / n_classes, max(100, n_classes)

    def converged(p: Value) -> Value:
        qp = jnp.einsum("nij,nj->ni", q, p)
        return jnp.max(jnp.abs(qp - jnp.sum(p * qp, axis=1, keepdims=True)), axis=1) < eps

    def sweep(state: tuple) -> tuple:
        p, done, count = state
        qp = jnp.einsum("nij,nj->ni", q, p)
        pqp = jnp.sum(p * qp, axis=1)

        def update(t: Value, carry: tuple) -> tuple:
            p, qp, pqp = carry
            q_tt, qp_t = q[:, t, t], qp[:, t]
            diff = (pqp - qp_t) / q_tt
            scale = 1 + diff
            pqp = (pqp + diff * (diff * q_tt + 2 * qp_t)) / (scale * scale)
            p = p.at[:, t].add(diff) / scale[:, None]
            qp = (qp + diff[:, None] * q[:, t, :]) / scale[:, None]
            return p, qp, pqp

        updated, _, _ = lax.fori_loop(0, n_classes, update, (p, qp, pqp))
        p = jnp.where(done[:, None], p, updated)  # a converged row stops, as libsvm's loop breaks
        return p, done | converged(p), count + 1

    p0 = jnp.full((n, n_classes), 1 / n_classes, pairwise.dtype)
    p, _, _ = lax.while_loop(lambda s: (s[2] < sweeps) & ~jnp.all(s[1]), sweep, (p0, converged(p0), 0))
    return p


@ml_op("SVMClassifier")
def svm_classifier(
    X: Value,
    *,
    classlabels_ints: list[int] | None = None,
    classlabels_strings: list[str] | None = None,
    coefficients: list[float] | None = None,
    kernel_params: list[float] | None = None,
    kernel_type: str = "LINEAR",
    post_transform: str = "NONE",
    prob_a: list[float] | None = None,
    prob_b: list[float] | None = None,
    rho: list[float] | None = None,
    support_vectors: list[float] | None = None,
    vectors_per_class: list[int] | None = None,
) -> tuple[Value, Value]:
    """libsvm's one-vs-one SVC over support vectors, or a liblinear model (no support vectors), with the
    labelling and score conventions that ONNX Runtime and ONNX's reference evaluator share."""
    labels = class_labels(classlabels_ints, classlabels_strings)
    n_classes = max(len(labels), 1)
    x = as_rows(as_float(classifier_input(X, labels)))
    weights = np.asarray(coefficients or [], dtype=x.dtype)
    offsets = float_attr(rho, x.dtype, [0.0])
    counts = np.asarray(vectors_per_class or [], dtype=np.int64)
    probabilities = False
    if counts.sum() > 0:
        vectors = np.asarray(support_vectors, dtype=x.dtype).reshape(int(counts.sum()), -1)
        kernel = Kernel.of(kernel_type, kernel_params)(x, vectors)
        scores, decided, first, second = _one_vs_one(x, kernel, weights, offsets, counts, n_classes)
        if prob_a:
            a, b = float_attr(prob_a, x.dtype), float_attr(prob_b, x.dtype)
            pairwise = jnp.clip(jax.nn.sigmoid(-(scores * a + b)), 1e-7, 1 - 1e-7)
            scores, probabilities = _pairwise_coupling(pairwise, first, second, n_classes), True
    else:
        scores = decided = _affine(x, weights, None) + offsets[0]
    best, best_weight = jnp.argmax(decided, axis=1), jnp.max(decided, axis=1)
    binary = offsets.size == 1 and len(labels) == 2
    if binary:
        # Only non-negative coefficients and no probabilities: a winning weight of 0.5 decides class 1.
        if not probabilities and weights.size and weights.min() >= 0:
            best = jnp.where(best_weight >= 0.5, 1, best)
        chosen = pick(labels, best)
    elif offsets.size == 1:  # one decision function without two labels: "class" 1 when positive, else 0
        positive = (best_weight > 0).astype(np.int64)
        chosen = pick(labels, positive) if labels.dtype == object else positive
    else:
        chosen = pick(labels, best) if len(labels) else best
    if scores.shape[1] == 1 and post_transform == "PROBIT":
        scores = probit(scores)
    elif scores.shape[1] == 1 and binary:  # one decision value for two classes: the first class scores its negation
        scores = transform_scores(jnp.concatenate([-scores, scores], axis=1), post_transform)
    elif scores.shape[1] > 1:
        scores = transform_scores(scores, post_transform)
    return chosen, scores.astype(np.float32)
