"""A run whose loss or state turns NaN stops with DivergenceError naming the step, and writes nothing; load_state
restores the last good checkpoint in the same process."""

from __future__ import annotations

import subprocess
import sys
from typing import Iterator

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import onnxtrain
from onnxtrain.errors import DivergenceError, StateError
from training_models import linear_regression, matmul_sgd

RNG = np.random.default_rng(0)


def data() -> dict[str, np.ndarray]:
    x = RNG.normal(size=(16, 2)).astype(np.float32)
    return {"X": x, "target": (x @ np.array([[1.0], [-3.0]])).astype(np.float32)}


def nan_from(engine: onnxtrain.Engine, batches: Iterator[dict], step: int) -> Iterator[dict]:
    """`batches` with the rate fed in each: 0.1 until engine step `step` and NaN from there, so that step's update
    makes W NaN (its own loss, computed before the update, is still finite) and every later loss is NaN. Fed in
    the batches, not as fit's learning_rate, which refuses a NaN rate before its step."""
    for batch in batches:
        yield {**batch, "learning_rate": np.float32(np.nan if engine.step_count >= step else 0.1)}


def test_a_nan_loss_stops_fit_at_its_step():
    engine = onnxtrain.load(matmul_sgd(0.1))
    with pytest.raises(DivergenceError, match=r"loss 'loss' is nan after train step 8 \(step 7 of this fit\)"):
        onnxtrain.fit(engine, nan_from(engine, onnxtrain.array_batches(data()), 6), steps=20, log_every=1,
                      progress=False)


def test_a_diverged_run_never_overwrites_the_checkpoint(tmp_path):
    engine = onnxtrain.load(matmul_sgd(0.1))
    path = tmp_path / "ckpt.onnx"
    batches = onnxtrain.array_batches(data())
    onnxtrain.fit(engine, batches, steps=4, progress=False, checkpoint=path)
    good = path.read_bytes()
    w = {t.name: numpy_helper.to_array(t) for t in onnx.load(path).graph.initializer}["W"]
    assert np.isfinite(w).all() and np.abs(w).sum() > 0
    # the NaN update is engine step 6, the 2nd of this fit, where the checkpoint falls: its loss is finite,
    # the state is not
    with pytest.raises(DivergenceError, match=r"state variable\(s\) \['W'\] hold NaN or infinity after train step 6"):
        onnxtrain.fit(engine, nan_from(engine, batches, 5), steps=10, progress=False, log_every=100,
                      checkpoint=path, checkpoint_every=2)
    assert path.read_bytes() == good
    # going on from the NaN state: the first (logged) step's loss says it
    with pytest.raises(DivergenceError, match=r"loss 'loss' is nan after train step 7 \(step 0 of this fit\)"):
        onnxtrain.fit(engine, batches, steps=10, progress=False, checkpoint=path)
    assert path.read_bytes() == good


def test_the_cli_refuses_to_write_a_diverged_model(tmp_path):
    onnx.save(matmul_sgd(1e30), tmp_path / "wild.onnx")
    np.savez(tmp_path / "d.npz", **data())
    out = tmp_path / "out.onnx"
    result = subprocess.run([sys.executable, "-m", "onnxtrain.cli", "train", str(tmp_path / "wild.onnx"), "--data",
                             str(tmp_path / "d.npz"), "--steps", "10", "-o", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result
    last = result.stderr.strip().splitlines()[-1]  # after the progress bar
    assert last.startswith("onnxtrain: error: training diverged: loss 'loss' is"), result.stderr
    assert "Traceback" not in result.stderr and not out.exists()


def state_of(engine: onnxtrain.Engine) -> dict[str, np.ndarray]:
    return {name: np.array(value) for name, value in engine.state.items()}


def test_load_state_restores_the_last_good_checkpoint_in_the_same_process(tmp_path):
    """After a DivergenceError, load_state(checkpoint.onnx) (fit's checkpoints are exported models) restores the
    checkpoint's state (W in the main graph; Adam's moments and step counter in the training graph) and step
    count, and training on from it equals training a fresh load of the checkpoint: no new load needed."""
    engine = onnxtrain.load(matmul_sgd(0.1, "adam"))
    path, arrays = tmp_path / "ckpt.onnx", data()
    with pytest.raises(DivergenceError, match="loss 'loss' is inf after train step 7"):  # rate 1e30 at step 5
        onnxtrain.fit(engine, onnxtrain.array_batches(arrays), steps=20, progress=False, log_every=1,
                      learning_rate=lambda step: 0.1 if step < 5 else 1e30, checkpoint=path, checkpoint_every=5)
    fresh = onnxtrain.load(path)
    assert fresh.step_count == 5 and state_of(engine).keys() == state_of(fresh).keys()
    assert np.abs(state_of(engine)["W"]).min() > 1e20  # the diverged state: Adam's steps are about the rate
    engine.load_state(path)
    assert engine.step_count == 5
    for name, value in state_of(fresh).items():
        np.testing.assert_array_equal(state_of(engine)[name], value, err_msg=name)
    histories = [onnxtrain.fit(e, onnxtrain.array_batches(arrays, start=5), steps=3, progress=False, log_every=1,
                               learning_rate=0.01) for e in (engine, fresh)]
    assert histories[0] == histories[1] and engine.step_count == fresh.step_count == 8
    for name, value in state_of(fresh).items():
        np.testing.assert_array_equal(state_of(engine)[name], value, err_msg=name)


def test_load_state_refuses_the_checkpoint_of_another_model(tmp_path):
    engine = onnxtrain.load(matmul_sgd(0.1, "adam"))
    onnxtrain.fit(engine, onnxtrain.array_batches(data()), steps=2, progress=False)
    before = state_of(engine)
    other = onnxtrain.load(linear_regression(np.zeros((3, 1), np.float32), np.zeros(1, np.float32), 0.1))
    other.export(tmp_path / "other.onnx")
    with pytest.raises(StateError) as caught:
        engine.load_state(tmp_path / "other.onnx")
    assert str(caught.value) == (
        f"checkpoint {str(tmp_path / 'other.onnx')!r} does not fit this model: lacks state variables "
        "['W.adam_m', 'W.adam_v', 'train.step']; holds unknown state variables ['B']; 'W' is float32[3, 1], the "
        "model's is float32[2, 1]")
    assert engine.step_count == 2
    for name, value in state_of(engine).items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)
