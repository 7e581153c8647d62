"""The convolutions of ResNet-18's stride-1 layers on XLA-CPU against PyTorch's: the floor under its CPU ratio.

    python benchmarks/convolutions.py [--batch 2] [--steps 45] [--layers 64x56,128x28]

A ResNet-18 train step spends much of its time in the 3x3 stride-1 convolutions of its first two stages, which
onnxtrain hands to XLA's own convolution (the deeper, strided and 1x1 ones are products of their patches,
onnxtrain/lower/ops/conv.py). This times the three convolutions of one such layer (forward, input gradient,
kernel gradient), channels-last as onnxtrain lowers them and compiled with the options onnxtrain gives a
program with convolutions (`onnxtrain.program.convolution_options`), against PyTorch's (oneDNN) in channels-last,
in alternating rounds in one process, float32 on the CPU.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from jax import lax  # noqa: E402

from products import median_ms  # noqa: E402

from onnxtrain.program import convolution_options  # noqa: E402

NUMBERS = ("NHWC", "HWIO", "NHWC")  # onnxtrain's channels-last activations and (*K, I, O) kernels


def convolve(x: jax.Array, w: jax.Array) -> jax.Array:
    return lax.conv_general_dilated(x, w, (1, 1), [(1, 1), (1, 1)], dimension_numbers=NUMBERS)


FORMS = {  # name -> (XLA's, on x, w, g; PyTorch's convolution_backward output mask, or None for the forward)
    "forward": (lambda x, w, g: convolve(x, w), None),
    "input gradient": (lambda x, w, g: jax.vjp(lambda x: convolve(x, w), x)[1](g)[0], (True, False, False)),
    "kernel gradient": (lambda x, w, g: jax.vjp(lambda w: convolve(x, w), w)[1](g)[0], (False, True, False)),
}


def main(argv: list[str]) -> None:
    args = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    args.add_argument("--batch", type=int, default=2)
    args.add_argument("--steps", type=int, default=45)
    args.add_argument("--layers", default="64x56,128x28", help="channels x side of each layer, comma-separated")
    opts = args.parse_args(argv)
    options = convolution_options()
    rng = np.random.default_rng(0)
    print(f"jax {jax.__version__}, torch {torch.__version__}, {os.cpu_count()} cores; median ms of {opts.steps}\n")
    print("| convolution | layer (batch, channels, side) | XLA (ms) | PyTorch (ms) | XLA ÷ PyTorch |\n"
          "|---|---|---:|---:|---:|")
    for layer in opts.layers.split(","):
        channels, side = (int(v) for v in layer.split("x"))
        x, g = (rng.standard_normal((opts.batch, side, side, channels), np.float32) for _ in range(2))
        w = (rng.standard_normal((3, 3, channels, channels), np.float32) * 0.05).astype(np.float32)
        xla_operands = [jax.device_put(v) for v in (x, w, g)]
        # PyTorch's operands channels-last in memory (its fastest CPU layout for these), kernel (O, I, *K)
        tx, tg = (torch.from_numpy(v).permute(0, 3, 1, 2) for v in (x, g))
        tw = torch.from_numpy(w).permute(3, 2, 0, 1).contiguous()
        for form, (expression, mask) in FORMS.items():
            compiled = jax.jit(expression).lower(*xla_operands).compile(compiler_options=options)

            def theirs(mask=mask):
                if mask is None:
                    return torch.nn.functional.conv2d(tx, tw, padding=1)
                return torch.ops.aten.convolution_backward(tg, tx, tw, None, [1, 1], [1, 1], [1, 1], False, [0, 0],
                                                           1, list(mask))

            ms = median_ms({"xla": lambda: jax.block_until_ready(compiled(*xla_operands)), "torch": theirs},
                           opts.steps)
            print(f"| {form} | {opts.batch}, {channels}, {side} | {ms['xla']:.3f} | {ms['torch']:.3f} | "
                  f"{ms['xla'] / ms['torch']:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
