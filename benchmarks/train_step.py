"""Train step only: onnxtrain (an ONNX training model with Gradient + Adam) against the same math hand-written in
JAX + optax and in PyTorch eager, in one process, interleaved. Prints median ms/step and the ratios.

    python benchmarks/train_step.py [--steps 200] [--batch 64] [--models mlp,cnn]

A smaller entry point to benchmarks/run.py, which also times inference, first calls, memory and dispatch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).parent))
from models import MODELS, build  # noqa: E402
from peers import PEERS, first_call, interleaved, make_batch  # noqa: E402

TRAINERS = ("onnxtrain", "jax", "torch")


def bench(name: str, steps: int, batch: int) -> None:
    model = build(name)
    data = make_batch(model, batch)
    calls = {peer: PEERS[peer](model, data).train for peer in TRAINERS}
    first = {peer: first_call(call) for peer, call in calls.items()}
    for call in calls.values():  # warm-up: the first steps after compiling are slower
        for _ in range(3):
            call()
    median = interleaved(calls, steps, rounds=min(10, steps))
    ms = {peer: seconds * 1e3 for peer, seconds in median.items()}
    print(f"{name:<11} onnxtrain {ms['onnxtrain']:8.3f} ms/step   jax+optax {ms['jax']:8.3f}   pytorch "
          f"{ms['torch']:8.3f}   ratio vs jax {ms['onnxtrain'] / ms['jax']:5.2f}   vs pytorch "
          f"{ms['onnxtrain'] / ms['torch']:5.2f}   first call {first['onnxtrain']:5.2f} s vs {first['jax']:5.2f} s")


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args.add_argument("--steps", type=int, default=200)
    args.add_argument("--batch", type=int, default=64)
    args.add_argument("--models", default="mlp,cnn", help=f"comma-separated subset of {','.join(MODELS)}")
    opts = args.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}, batch {opts.batch}, median of {opts.steps}")
    for name in opts.models.split(","):
        bench(name, opts.steps, opts.batch)


if __name__ == "__main__":
    main()
