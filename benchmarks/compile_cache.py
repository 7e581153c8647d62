"""First-call time of a train step in a fresh process, with an empty and then a warm persistent cache.

    python benchmarks/compile_cache.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

CHILD = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np, jax, onnxtrain
from models import cnn
model, _, _, _ = cnn(np.random.default_rng(0))
engine = onnxtrain.load(onnxtrain.make_trainable(model, loss="cross_entropy", optimizer="adam"))
x = np.zeros((64, 1, 28, 28), np.float32); y = np.zeros(64, np.int64)
start = time.perf_counter()
jax.block_until_ready(engine.train_step({"X": x, "target": y}))
print(f"{time.perf_counter() - start:.3f}")
"""


def first_call(cache: str) -> float:
    env = {**os.environ, "ONNXTRAIN_CACHE_DIR": cache}
    out = subprocess.run([sys.executable, "-c", CHILD, os.path.dirname(os.path.abspath(__file__))], env=env,
                         capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as cache:
        cold = first_call(cache)
        warm = first_call(cache)
    print(f"CNN train step, first call in a new process: cold cache {cold:.2f} s, warm cache {warm:.2f} s "
          f"({cold / warm:.1f}x faster)")
