"""Resuming in a fresh process from a checkpoint (the exported .onnx, or an .npz state) continues bit for bit as
the uninterrupted run does: same losses, same state, random streams included."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

import onnxtrain
from training_models import F, TRAINING, model, tensor, vi

EXAMPLE = Path(onnxtrain.__file__).parent / "examples"
FIRST, THEN = 5, 7  # steps before the checkpoint, steps after it


def batch(step: int) -> dict[str, np.ndarray]:
    """The feeds of train step `step` (0-based), the same in every process."""
    rng = np.random.default_rng(step)
    x = rng.normal(size=(16, 2)).astype(np.float32)
    return {"X": x, "target": (x @ np.array([[1.5], [-2.0]]) + 0.5).astype(np.float32)}


def run(engine: onnxtrain.Engine, start: int, count: int, pattern: list[int]) -> np.ndarray:
    """`count` train steps from step `start`, the algorithm of step i being pattern[i % len(pattern)]; the
    losses (each algorithm's first output)."""
    losses = []
    for step in range(start, start + count):
        algorithm = pattern[step % len(pattern)]
        outputs = engine.train_step(batch(step), algorithm=algorithm)
        losses.append(np.asarray(outputs[engine.algorithms[algorithm].graph.outputs[0].name]))
    return np.stack(losses)


# The child: resume from the exported model, and from the base model plus the .npz state, THEN steps each.
CHILD = """
import sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import onnxtrain
from test_resume import FIRST, THEN, run
base, exported, state, pattern, out = sys.argv[2:7]
pattern = [int(a) for a in pattern.split(",")]
from_onnx = onnxtrain.load(exported)
from_npz = onnxtrain.load(base)
from_npz.load_state(state)
results = {}
for tag, engine in (("onnx", from_onnx), ("npz", from_npz)):
    results[tag + ":losses"] = run(engine, FIRST, THEN, pattern)
    results.update({f"{tag}:{n}": np.asarray(v) for n, v in engine.state.items()})
np.savez(out, **results)
"""


def noisy_two_algorithms() -> onnx.ModelProto:
    """Y = X @ W + B. training_info[0]: SGD on W over mean((Y - target)^2); training_info[1]: SGD on B over the
    same loss with a Dropout (ratio 0.5, so a new random mask each step) on the residual."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["XW"]), helper.make_node("Add", ["XW", "B"], ["Y"])],
        "linear", [vi("X", F, ["N", 2])], [vi("Y", F, ["N", 1])],
        [tensor("W", np.zeros((2, 1), np.float32)), tensor("B", np.zeros(1, np.float32))],
    )

    def sgd(var: str, dropout: bool) -> onnx.TrainingInfoProto:
        residual = [helper.make_node("Sub", ["Y", "target"], ["D0"])]
        residual.append(helper.make_node("Dropout", ["D0"], ["D"]) if dropout else
                        helper.make_node("Identity", ["D0"], ["D"]))
        algorithm = helper.make_graph(
            residual + [
                helper.make_node("Mul", ["D", "D"], ["D2"]),
                helper.make_node("ReduceMean", ["D2"], [f"Loss_{var}"], keepdims=0),
                helper.make_node("Gradient", [var], ["G"], domain=TRAINING, xs=[var], y=f"Loss_{var}"),
                helper.make_node("Mul", ["LR", "G"], ["S"]),
                helper.make_node("Sub", [var, "S"], [f"{var}_new"]),
            ],
            f"sgd_{var}", [vi("target", F, ["N", 1])], [vi(f"Loss_{var}", F, []), vi(f"{var}_new")],
            [tensor("LR", np.float32(0.1))],
        )
        return helper.make_training_info(algorithm, [(var, f"{var}_new")], None, None)

    return model(graph, [sgd("W", dropout=False), sgd("B", dropout=True)])


def check_resume(tmp_path: Path, base: Path, pattern: list[int]) -> None:
    whole = onnxtrain.load(base)
    whole.init()
    expected = run(whole, 0, FIRST + THEN, pattern)[FIRST:]
    first = onnxtrain.load(base)
    first.init()
    run(first, 0, FIRST, pattern)
    first.export(tmp_path / "checkpoint.onnx")
    first.save_state(tmp_path / "checkpoint.npz")
    args = [Path(__file__).parent, base, tmp_path / "checkpoint.onnx", tmp_path / "checkpoint.npz",
            ",".join(map(str, pattern)), tmp_path / "resumed.npz"]
    result = subprocess.run([sys.executable, "-c", CHILD, *map(str, args)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = np.load(tmp_path / "resumed.npz")
    for tag in ("onnx", "npz"):
        np.testing.assert_array_equal(resumed[f"{tag}:losses"], expected, err_msg=f"losses resumed from .{tag}")
        for name, value in whole.state.items():
            np.testing.assert_array_equal(resumed[f"{tag}:{name}"], np.asarray(value), err_msg=f"{tag}: {name}")


def test_resume_one_algorithm_with_adam(tmp_path):
    check_resume(tmp_path, EXAMPLE / "regression.onnx", [0])


def test_resume_two_interleaved_algorithms_one_drawing_random_numbers(tmp_path):
    base = tmp_path / "noisy.onnx"
    onnx.save(noisy_two_algorithms(), base)
    engine = onnxtrain.load(base)
    # the Dropout draws: at W = 0, B = 0 the loss without it would be mean(target^2)
    loss = float(run(engine, 0, 1, [1])[0])
    assert not np.isclose(loss, np.mean(batch(0)["target"] ** 2))
    check_resume(tmp_path, base, [0, 0, 1])
