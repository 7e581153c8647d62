"""A run whose loss or state turns NaN stops with DivergenceError naming the step, and writes nothing."""

from __future__ import annotations

import subprocess
import sys
from typing import Iterator

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import onnxtrain
from onnxtrain.errors import DivergenceError
from training_models import matmul_sgd

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
