"""Train step: onnxtrain (an ONNX training model with Gradient + Adam) against the same math hand-written in
JAX + optax, in one process, interleaved. Prints median ms/step and the ratio (target: <= 1.10).

    python benchmarks/train_step.py [--steps 200] [--batch 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).parent))
import onnxtrain  # noqa: E402
from models import cnn, mlp  # noqa: E402
from onnxtrain.authoring import make_trainable  # noqa: E402

LR, BETA1, BETA2, EPS = 1e-3, 0.9, 0.999, 1e-6


def jax_optax_step(forward):
    optimizer = optax.adam(LR, b1=BETA1, b2=BETA2, eps=EPS)

    def loss_fn(params, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(forward(params, x), y).mean()

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return optimizer, step


def time_calls(call, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - start)
    return times


def bench(name: str, build, steps: int, batch: int) -> None:
    rng = np.random.default_rng(0)
    model, weights, forward, input_shape = build(rng)
    x = rng.normal(size=(batch, *input_shape)).astype(np.float32)
    y = rng.integers(0, 10, size=batch).astype(np.int64)

    engine = onnxtrain.load(make_trainable(model, loss="cross_entropy", optimizer="adam", learning_rate=LR,
                                           alpha=BETA1, beta=BETA2, epsilon=EPS))
    feeds = {"X": x, "target": y}
    start = time.perf_counter()
    jax.block_until_ready(engine.train_step(feeds))
    ours_compile = time.perf_counter() - start

    optimizer, step = jax_optax_step(forward)
    params = {k: jax.numpy.asarray(v) for k, v in weights.items()}
    state = {"params": params, "opt": optimizer.init(params)}
    xj, yj = jax.numpy.asarray(x), jax.numpy.asarray(y.astype(np.int32))

    def peer_call():
        state["params"], state["opt"], loss = step(state["params"], state["opt"], xj, yj)
        return loss

    start = time.perf_counter()
    jax.block_until_ready(peer_call())
    peer_compile = time.perf_counter() - start

    ours, peer = [], []
    for _ in range(4):  # interleaved rounds so drift on the machine hits both alike
        ours += time_calls(lambda: engine.train_step(feeds), steps // 4)
        peer += time_calls(peer_call, steps // 4)
    o, p = statistics.median(ours) * 1e3, statistics.median(peer) * 1e3
    print(f"{name:<5} onnxtrain {o:8.3f} ms/step   jax+optax {p:8.3f} ms/step   ratio {o / p:5.2f}   "
          f"first call {ours_compile:5.2f} s vs {peer_compile:5.2f} s")


def main() -> None:
    args = argparse.ArgumentParser()
    args.add_argument("--steps", type=int, default=200)
    args.add_argument("--batch", type=int, default=64)
    args.add_argument("--models", default="mlp,cnn")
    opts = args.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}, batch {opts.batch}, median of {opts.steps}")
    for name in opts.models.split(","):
        bench(name, {"mlp": mlp, "cnn": cnn}[name], opts.steps, opts.batch)


if __name__ == "__main__":
    main()
