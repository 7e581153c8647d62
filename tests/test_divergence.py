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
    with pytest.raises(DivergenceError,
                       match=r"loss 'loss' is nan after train step 8 \(step 7 of this fit\)") as caught:
        onnxtrain.fit(engine, nan_from(engine, onnxtrain.array_batches(data()), 6), steps=20, log_every=1,
                      progress=False)
    assert "every state variable is finite" not in str(caught.value)  # W is NaN: the old advice


def test_a_nan_loss_over_finite_weights_names_the_labels_before_the_learning_rate():
    """A micro-batch whose labels are all -100 (a Hugging Face batch of prompts alone) in an accumulate=3 window:
    its loss is torch's 0 / 0, NaN, its gradient zero, so the weights stay finite and the update is the other
    micro-batches' (as torch's num_items_in_batch loop's); fit still stops on the NaN, but says what the data can
    do rather than only 'lower the learning rate'."""
    torch = pytest.importorskip("torch")
    from onnx import TensorProto, helper

    rng = np.random.default_rng(1)
    w = rng.normal(size=(4, 3)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["X", "W"], ["Y"])], "scores",
                              [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 3])],
                              [numpy_helper.from_array(w, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    engine = onnxtrain.load(onnxtrain.make_trainable(model, loss="cross_entropy", optimizer="sgd",
                                                     learning_rate=0.5, accumulate=3))
    batches = [{"X": rng.normal(size=(4, 4)).astype(np.float32), "target": np.array(t, np.int64)}
               for t in ([0, 1, 2, -100], [-100] * 4, [2, -100, 0, 1])]
    with pytest.raises(DivergenceError, match=r"loss 'loss' is nan after train step 2 \(step 1 of this fit\); "
                                              r"nothing was written: every state variable is finite.*all ignore_index"):
        onnxtrain.fit(engine, batches * 2, steps=6, log_every=1, progress=False)
    onnxtrain.fit(engine, batches[2:], steps=1, log_every=2, progress=False)  # the window's last: unlogged
    weight = torch.tensor(w, requires_grad=True)
    for batch in batches:  # torch: each summed loss over the update's 6 labels; the empty one adds nothing
        torch.nn.functional.cross_entropy(torch.tensor(batch["X"]) @ weight, torch.tensor(batch["target"]),
                                          reduction="sum").div(6).backward()
    assert torch.nn.functional.cross_entropy(weight[:1], torch.tensor([-100])).isnan()  # torch's NaN too
    np.testing.assert_allclose(np.asarray(engine.state["W"]), (weight - 0.5 * weight.grad).detach().numpy(),
                               rtol=1e-6, atol=1e-7)


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
    # the API's advice (engine.load_state), and the command line's
    assert last.endswith(f"on the command line: the same command with --resume goes on from {out} (the last "
                         "checkpoint before it, where one was written), and make-trainable's --lr sets a lower "
                         "rate"), last
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
