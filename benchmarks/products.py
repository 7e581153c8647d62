"""The matrix products of a transformer layer on XLA-CPU against PyTorch's: the floor under onnxtrain's CPU ratios.

    python benchmarks/products.py [--tokens 256] [--width 768] [--steps 50]

A train step of BERT-base or GPT-2 spends most of its time in three products per weight: the forward x @ W, the
input gradient g @ W^T and the weight gradient x^T @ g. This times each of them for a layer's two weight shapes
(width x width, width x 4 width, and back) as `jax.jit` of the plain jax.numpy expression (what onnxtrain's lowering
hands XLA) and as the same PyTorch expression, in alternating rounds in one process, float32 on the CPU. Where
XLA's product is slower than PyTorch's, no lowering of the graph makes the step as fast as PyTorch's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

FORMS = {  # name -> (operand shapes from (tokens m, in k, out n), the expression on two operands)
    "forward x @ W": (lambda m, k, n: ((m, k), (k, n)), lambda a, b: a @ b),
    "input gradient g @ W^T": (lambda m, k, n: ((m, n), (k, n)), lambda a, b: a @ b.T),
    "weight gradient x^T @ g": (lambda m, k, n: ((m, k), (m, n)), lambda a, b: a.T @ b),
}


def median_ms(calls: dict[str, object], steps: int, rounds: int = 5) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(rounds):
        for key, call in calls.items():
            call()  # untimed: caches warm after the other peer's turn
            for _ in range(max(1, steps // rounds)):
                start = time.perf_counter()
                call()
                times[key].append(time.perf_counter() - start)
    return {k: float(np.median(v)) * 1e3 for k, v in times.items()}


def main(argv: list[str]) -> None:
    args = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    args.add_argument("--tokens", type=int, default=256, help="rows of the activations (batch x sequence)")
    args.add_argument("--width", type=int, default=768)
    args.add_argument("--steps", type=int, default=50)
    opts = args.parse_args(argv)
    m, d = opts.tokens, opts.width
    rng = np.random.default_rng(0)
    print(f"jax {jax.__version__}, torch {torch.__version__}, {os.cpu_count()} cores; median ms of {opts.steps}\n")
    print("| product | shape (m, k, n) | XLA (ms) | PyTorch (ms) | XLA ÷ PyTorch |\n|---|---|---:|---:|---:|")
    total = {"xla": 0.0, "torch": 0.0}
    for k, n in ((d, d), (d, 4 * d), (4 * d, d)):
        for form, (shapes, expression) in FORMS.items():
            a, b = (rng.standard_normal(s, np.float32) for s in shapes(m, k, n))
            xa, xb = jax.device_put(a), jax.device_put(b)
            ta, tb = torch.from_numpy(a), torch.from_numpy(b)
            jitted = jax.jit(expression)
            ms = median_ms({"xla": lambda: jitted(xa, xb).block_until_ready(),
                            "torch": lambda: expression(ta, tb)}, opts.steps)
            total = {p: total[p] + ms[p] for p in total}
            print(f"| {form} | {m}, {k}, {n} | {ms['xla']:.3f} | {ms['torch']:.3f} | {ms['xla'] / ms['torch']:.2f} |")
    print(f"| all nine | | {total['xla']:.2f} | {total['torch']:.2f} | {total['xla'] / total['torch']:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
