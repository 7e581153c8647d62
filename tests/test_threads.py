"""One engine shared between threads: steps are never lost or interleaved, infer sees the state of one moment."""

from __future__ import annotations

import threading

import numpy as np

import onnxtrain
from training_models import linear_regression

RNG = np.random.default_rng(0)
STEPS = 150
LR = 0.05


def sgd_states(x: np.ndarray, t: np.ndarray, steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(W, B) before each of `steps` plain SGD steps on mean((X W + B - T)^2) and after the last, in NumPy."""
    w, b = np.zeros((3, 1)), np.zeros(1)
    states = [(w, b)]
    for _ in range(steps):
        d = x @ w + b - t
        w, b = w - LR * 2 * x.T @ d / d.size, b - LR * 2 * d.sum(0) / d.size
        states.append((w, b))
    return states


def engine_and_batch() -> tuple[onnxtrain.Engine, dict[str, np.ndarray]]:
    engine = onnxtrain.load(linear_regression(np.zeros((3, 1), np.float32), np.zeros(1, np.float32), LR))
    x = RNG.normal(size=(8, 3)).astype(np.float32)
    return engine, {"X": x, "T": (x @ np.array([[1.0], [-2.0], [0.5]]) + 0.3).astype(np.float32)}


def in_threads(*targets) -> list[BaseException]:
    errors: list[BaseException] = []

    def guarded(target):
        try:
            target()
        except BaseException as exc:  # noqa: BLE001 - collected and reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(t,)) for t in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def test_two_threads_training_take_every_step():
    engine, feeds = engine_and_batch()

    def train():
        for _ in range(STEPS):
            engine.train_step(feeds)

    assert in_threads(train, train) == []
    assert engine.step_count == 2 * STEPS
    w, b = sgd_states(feeds["X"].astype(np.float64), feeds["T"], 2 * STEPS)[-1]
    np.testing.assert_allclose(np.asarray(engine.state["W"]), w, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(engine.state["B"]), b, rtol=1e-4, atol=1e-5)


def test_infer_while_another_thread_trains_sees_one_state():
    engine, feeds = engine_and_batch()
    done = threading.Event()
    predictions = []

    def train():
        for _ in range(STEPS):
            engine.train_step(feeds)
        done.set()

    def infer():
        while not done.is_set():
            predictions.append(np.asarray(engine.infer({"X": feeds["X"]})["Y"]))

    assert in_threads(train, infer) == []
    assert engine.step_count == STEPS and predictions
    # each prediction is the model's at some step: X W + B for one of the states SGD passes through
    candidates = np.stack([feeds["X"] @ w + b for w, b in sgd_states(feeds["X"].astype(np.float64), feeds["T"],
                                                                       STEPS)])
    for y in predictions:
        assert np.isclose(candidates, y, rtol=1e-4, atol=1e-5).all(axis=(1, 2)).any()
