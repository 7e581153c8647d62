"""Train step only: onnxtrain (an ONNX training model with Gradient + Adam) against the same math hand-written in
JAX + optax and in PyTorch eager, in one process, interleaved. Prints the median time per step and the ratios, for
a loop that waits for each step and for one that launches LAUNCHED steps back to back and waits for the last (a
training loop that does not read every loss: on a GPU the difference is host time the device waited for).

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
from peers import PEERS, interleaved, make_batch  # noqa: E402

TRAINERS = ("onnxtrain", "jax", "torch")
LAUNCHED = 10


def bench(name: str, steps: int, batch: int) -> None:
    model = build(name)
    data = make_batch(model, batch)
    peers = {peer: PEERS[peer](model, data) for peer in TRAINERS}
    calls = {(peer, "waiting"): p.train for peer, p in peers.items()}
    calls |= {(peer, "launched"): p.launched(LAUNCHED) for peer, p in peers.items()}
    for call in calls.values():  # the first call compiles, and the first steps after it run slower
        for _ in range(4):
            call()
    median = interleaved(calls, steps, rounds=min(10, steps))
    for mode, per_call in (("waiting", 1), ("launched", LAUNCHED)):
        ms = {peer: median[peer, mode] * 1e3 / per_call for peer in TRAINERS}
        print(f"{name:<11} {mode:<8} onnxtrain {ms['onnxtrain']:8.3f} ms/step   jax+optax {ms['jax']:8.3f}   "
              f"pytorch {ms['torch']:8.3f}   ratio vs jax {ms['onnxtrain'] / ms['jax']:5.2f}   vs pytorch "
              f"{ms['onnxtrain'] / ms['torch']:5.2f}")


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args.add_argument("--steps", type=int, default=200, help="timed calls per peer and mode")
    args.add_argument("--batch", type=int, default=64)
    args.add_argument("--models", default="mlp,cnn", help=f"comma-separated subset of {','.join(MODELS)}")
    opts = args.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}, batch {opts.batch}, median of {opts.steps}")
    for name in opts.models.split(","):
        bench(name, opts.steps, opts.batch)


if __name__ == "__main__":
    main()
