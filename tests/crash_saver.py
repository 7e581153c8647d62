"""The process tests/test_crash_safety.py kills: trains a small MLP and, after every step, saves it three ways
(save_state, export in one file, export with external data), forever.

Before the saves of step s it records the digest of the state at step s in `<folder>/digests/<s>` (written to a
temporary name and renamed, so it is whole), so the test can tell which step a file holds and whether it holds
exactly that step's state. It resumes from the state checkpoint a killed predecessor left, and prints "saved"
after each round of saves.

    python crash_saver.py FOLDER
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path
from typing import Any, Mapping

import numpy as np

import onnxtrain
import onnxtrain.big_models
from training_models import mlp_adam

HIDDEN = 512  # W1 is 8 KiB: each save writes tens of KiB, enough for a kill to land inside a write
STATE, INLINE, EXTERNAL = "state.npz", "inline.onnx", "external.onnx"
RNG = np.random.default_rng(0)
X = RNG.normal(size=(16, 4)).astype(np.float32)
TARGET = RNG.normal(size=(16, 2)).astype(np.float32)


def model():
    rng = np.random.default_rng(1)
    return mlp_adam({
        "W1": rng.normal(scale=0.5, size=(4, HIDDEN)).astype(np.float32),
        "B1": np.zeros(HIDDEN, np.float32),
        "W2": rng.normal(scale=0.05, size=(HIDDEN, 2)).astype(np.float32),
        "B2": np.zeros(2, np.float32),
    }, lr=0.01)


def digest(state: Mapping[str, Any]) -> str:
    """Of every variable's name, dtype, shape and bytes: two states share it only if they are equal."""
    hasher = hashlib.sha256()
    for name in sorted(state):
        value = np.asarray(state[name])
        hasher.update(f"{name}:{value.dtype}:{value.shape}:".encode())
        hasher.update(value.tobytes())
    return hasher.hexdigest()


def record(folder: Path, step: int, state: Mapping[str, Any]) -> None:
    path = folder / "digests" / str(step)
    if not path.exists():  # a resumed run recomputes steps it already recorded
        staged = path.with_suffix(".tmp")
        staged.write_text(digest(state))
        os.replace(staged, path)


def main(folder: Path) -> None:
    (folder / "digests").mkdir(exist_ok=True)
    engine = onnxtrain.load(model())
    engine.init()
    if (folder / STATE).exists():
        engine.load_state(folder / STATE)
    while True:
        engine.train_step({"X": X, "Target": TARGET})
        record(folder, engine.step_count, engine.state)
        engine.save_state(folder / STATE)
        engine.export(folder / INLINE)
        engine.export(folder / EXTERNAL, external_data=True)
        print("saved", flush=True)


if __name__ == "__main__":
    onnxtrain.big_models.INLINE_BYTES = 64  # the MLP's tensors are small: send all but scalars to the data file
    main(Path(sys.argv[1]))
