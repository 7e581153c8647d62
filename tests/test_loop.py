"""fit: schedules fed as the learning_rate input, evaluation callbacks, checkpoints, loss history."""

from __future__ import annotations

import errno
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain.errors import CheckpointError
from training_models import matmul_sgd


def test_schedule_evaluation_and_checkpoint(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 2)).astype(np.float32)
    t = (x @ np.array([[1.0], [-3.0]])).astype(np.float32)
    engine = onnxtrain.load(matmul_sgd(0.5))
    rates = [0.1 * 0.5**step for step in range(6)]
    history = onnxtrain.fit(
        engine, onnxtrain.array_batches({"X": x, "target": t}, shuffle=False), steps=6, log_every=1,
        progress=False, learning_rate=lambda step: rates[step],
        evaluate=lambda e: {"mse": float(np.mean((np.asarray(e.infer({"X": x})["Y"]) - t) ** 2))}, eval_every=3,
        checkpoint=tmp_path / "ckpt.onnx", checkpoint_every=4,
    )
    w = np.zeros((2, 1))
    for rate in rates:  # plain SGD on mean squared error, by hand
        w = w - rate * 2 * x.T @ (x @ w - t) / len(x)
    np.testing.assert_allclose(np.asarray(engine.state["W"]), w, rtol=1e-5)
    assert history.steps == list(range(6)) and len(history.losses) == 6
    assert history.eval_steps == [2, 5]
    np.testing.assert_allclose(history.metrics[-1]["mse"], np.mean((x @ w - t) ** 2), rtol=1e-4)
    saved = {i.name: numpy_helper.to_array(i) for i in onnx.load(tmp_path / "ckpt.onnx").graph.initializer}
    np.testing.assert_array_equal(saved["W"], np.asarray(engine.state["W"]))
    assert engine.trace_count == 2  # one train step compile for six different rates, one infer compile


def test_a_graph_output_that_is_already_the_loss():
    """loss="output:L": L = sum((W - 3)^2) is computed by the model itself; SGD drives W to 3."""
    graph = helper.make_graph(
        [helper.make_node("Sub", ["W", "Three"], ["D"]), helper.make_node("Mul", ["D", "D"], ["D2"]),
         helper.make_node("ReduceSum", ["D2"], ["L"], keepdims=0)],
        "quadratic", [], [helper.make_tensor_value_info("L", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(np.zeros(2, np.float32), "W"), numpy_helper.from_array(np.float32(3), "Three")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    engine = onnxtrain.load(onnxtrain.make_trainable(model, loss="output:L", optimizer="sgd", learning_rate=0.1,
                                                     trainable=["W"]))
    w = np.zeros(2)
    for _ in range(5):
        engine.train_step({})
        w = w - 0.1 * 2 * (w - 3)  # d/dW sum((W - 3)^2)
    np.testing.assert_allclose(np.asarray(engine.state["W"]), w, rtol=1e-6)
    assert "Three" not in engine.state  # not trainable: frozen


def test_array_batches_from_a_start_are_those_the_whole_stream_takes_there():
    """start=k (a resumed run's step count) passes over k batches without building them: the rest of the stream is
    the same batches, across an epoch's end (its next order drawn as before) and without shuffling too."""
    rows = {"X": np.arange(20, dtype=np.float32).reshape(10, 2), "target": np.arange(10, dtype=np.float32)}
    for shuffle in (True, False):
        whole = onnxtrain.array_batches(rows, 3, shuffle=shuffle, seed=5)  # 3 batches an epoch, a row left over
        expected = [next(whole) for _ in range(12)][7:]
        resumed = onnxtrain.array_batches(rows, 3, shuffle=shuffle, seed=5, start=7)
        for want in expected:
            got = next(resumed)
            for name in rows:
                np.testing.assert_array_equal(got[name], want[name])


def test_a_resumed_fit_logs_evaluates_and_checkpoints_at_the_uninterrupted_runs_steps(tmp_path):
    """fit numbers its steps as the engine counts them (what a checkpoint restores): a run resumed at step 5 writes
    its checkpoints at steps 8 and 10, as the uninterrupted run does (the phases had restarted at 0: 9 and 10),
    and History's steps go on from 5 with the uninterrupted run's losses."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(12, 2)).astype(np.float32)
    data = {"X": x, "target": (x @ np.array([[1.0], [-3.0]])).astype(np.float32)}
    path = tmp_path / "ckpt.onnx"

    def run(engine: onnxtrain.Engine, steps: int) -> tuple[onnxtrain.History, list[int]]:
        written, export = [], engine.export
        engine.export = lambda target: (written.append(engine.step_count), export(target))  # the steps it saves at
        batches = onnxtrain.array_batches(data, 4, seed=3, start=engine.step_count)
        history = onnxtrain.fit(engine, batches, steps, log_every=3, progress=False,
                                evaluate=lambda e: {"steps": e.step_count}, eval_every=4,
                                checkpoint=path, checkpoint_every=4)
        return history, written

    whole, saved = run(onnxtrain.load(matmul_sgd(0.1)), 10)
    assert saved == [4, 8, 10] and whole.steps == [0, 3, 6, 9] and whole.eval_steps == [3, 7, 9]
    _, saved = run(onnxtrain.load(matmul_sgd(0.1)), 5)
    assert saved == [4, 5]
    resumed, saved = run(onnxtrain.load(path), 5)
    assert saved == [8, 10]
    assert resumed.steps == [5, 6, 9]  # a call's first step is logged too
    assert resumed.eval_steps == [7, 9] and resumed.metrics == [{"steps": 8}, {"steps": 10}]
    np.testing.assert_array_equal(resumed.losses[1:], whole.losses[2:])


def test_a_history_passed_in_keeps_what_an_interrupted_fit_logged():
    """fit(history=h) appends to h as it goes, so a run stopped by Ctrl-C (here raised by `evaluate` after step 4)
    leaves its losses with the caller; on_log saw each logged step as it happened. The losses are NumPy's SGD."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(8, 2)).astype(np.float32)
    t = (x @ np.array([[2.0], [1.0]])).astype(np.float32)
    engine = onnxtrain.load(matmul_sgd(0.1))
    history, seen = onnxtrain.History(), []

    def stop_after_step_4(e):
        if e.step_count == 5:
            raise KeyboardInterrupt
        return {}

    try:
        onnxtrain.fit(engine, onnxtrain.array_batches({"X": x, "target": t}, shuffle=False), steps=10, log_every=2,
                      progress=False, evaluate=stop_after_step_4, eval_every=1, history=history,
                      on_log=lambda step, loss: seen.append((step, loss)))
    except KeyboardInterrupt:
        pass
    w, expected = np.zeros((2, 1)), []
    for _ in range(5):
        expected.append(float(np.mean((x @ w - t) ** 2)))
        w = w - 0.1 * 2 * x.T @ (x @ w - t) / len(x)
    assert history.steps == [0, 2, 4] and seen == list(zip(history.steps, history.losses))
    np.testing.assert_allclose(history.losses, expected[::2], rtol=1e-5)


def test_a_checkpoint_the_disk_refuses_is_a_warning_and_the_last_ones_a_checkpoint_error(tmp_path, monkeypatch):
    """Every checkpoint of this call fails (ENOSPC): each but the last is a RuntimeWarning and training goes on; the
    last raises CheckpointError. A History passed in with an earlier call's checkpoint (to another file) does not
    count as one this file holds. The engine keeps the trained state: SGD's, by hand, after 4 steps."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 2)).astype(np.float32)
    t = (x @ np.array([[1.0], [-3.0]])).astype(np.float32)
    engine = onnxtrain.load(matmul_sgd(0.1))
    history = onnxtrain.History(checkpoints=[7])

    def full(descriptor):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.warns(RuntimeWarning, match=r"checkpoint after 2 train steps not written \(cannot export to "
                      r".*ckpt\.onnx': .*No space left on device\); .*ckpt\.onnx' is as it was when training started; "
                      r"training goes on, and writes the next one after 4 train steps"), \
            pytest.raises(CheckpointError, match=r"checkpoint after 4 train steps not written .*No space left on "
                          r"device.*the engine holds the trained state") as raised:
        onnxtrain.fit(engine, onnxtrain.array_batches({"X": x, "target": t}, shuffle=False), steps=4,
                      progress=False, checkpoint=tmp_path / "ckpt.onnx", checkpoint_every=2, history=history)
    monkeypatch.undo()
    assert raised.value.written is None and history.checkpoints == [7] and os.listdir(tmp_path) == []
    w = np.zeros((2, 1))
    for _ in range(4):
        w = w - 0.1 * 2 * x.T @ (x @ w - t) / len(x)
    np.testing.assert_allclose(np.asarray(engine.state["W"]), w, rtol=1e-5)


def test_batches_that_end_before_steps_end_the_call_as_its_last_step(tmp_path):
    """Three batches for steps=5: the third step is the call's last, so its loss is logged, it is evaluated and
    the checkpoint written (they had not been: the loop ended when the batches did, checkpoint_every far off),
    holding SGD's weights by hand after 3 steps; the iterator is not read past its end."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(4, 2)).astype(np.float32)
    t = (x @ np.array([[2.0], [0.5]])).astype(np.float32)
    engine = onnxtrain.load(matmul_sgd(0.1))
    history = onnxtrain.fit(engine, [{"X": x, "target": t}] * 3, steps=5, log_every=100, progress=False,
                            evaluate=lambda e: {"steps": e.step_count}, eval_every=100,
                            checkpoint=tmp_path / "ckpt.onnx", checkpoint_every=100)
    w, losses = np.zeros((2, 1)), []
    for _ in range(3):
        losses.append(np.mean((x @ w - t) ** 2))  # the loss a step returns: before its update
        w = w - 0.1 * 2 * x.T @ (x @ w - t) / len(x)
    assert engine.step_count == 3 and history.steps == [0, 2] and history.eval_steps == [2]
    assert history.metrics == [{"steps": 3}] and history.checkpoints == [3]
    np.testing.assert_allclose(history.losses, [losses[0], losses[2]], rtol=1e-5)
    saved = {i.name: numpy_helper.to_array(i) for i in onnx.load(tmp_path / "ckpt.onnx").graph.initializer}
    np.testing.assert_allclose(saved["W"], w, rtol=1e-5)
