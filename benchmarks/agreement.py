"""Real-size models train as PyTorch trains them: onnxtrain's numbers against PyTorch's, both against float64.

    python benchmarks/agreement.py [--models bert-base,gpt2,...] [--optimizers sgd,adam] [--steps 3] [--write]

Each model of benchmarks/realsize_models.py (random weights) is exported by `onnxtrain.from_torch` (the
module's own parameters, names kept) and trained `--steps` steps on one batch of 2 by onnxtrain, by PyTorch in
float32 and by PyTorch in float64, from the same weights, with the same optimizer (torch.optim's; learning rate
1e-3). Two float32 runs of one model never agree to the last bit (another summation order is another rounding),
and an optimizer can magnify that: Adam's first step moves every weight by about the learning rate whatever its
gradient's size, so a gradient that is float noise (a key bias's, which softmax makes 0) moves by noise. The
measure is therefore each float32 run's distance to the float64 one: the losses' largest relative error, and the
updates' (weights after minus before, over all parameters) relative error in norm. onnxtrain is as exact as
PyTorch where its distance is no larger than PyTorch's own; the script exits non-zero where onnxtrain's update
error is more than 3x PyTorch's (plus 1e-6, the float32 floor), as a wrong gradient or update would be.
`--write` puts the table into benchmarks/README.md between the agreement markers.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from host import cpu_name  # noqa: E402

README = Path(__file__).parent / "README.md"
LR = 1e-3
TOLERANCE = 3.0  # onnxtrain's update error may be this many times PyTorch's (plus FLOOR) before the run fails
FLOOR = 1e-6


def torch_run(module, args: list, target, optimizer: str, steps: int) -> list[float]:
    from realsize_models import cross_entropy

    import torch

    update = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[optimizer](module.parameters(), lr=LR)
    losses = []
    for _ in range(steps):
        update.zero_grad()
        loss = cross_entropy(module(*args), target)
        loss.backward()
        update.step()
        losses.append(loss.item())
    return losses


def update_error(after: dict[str, np.ndarray], exact: dict[str, np.ndarray], before: dict[str, np.ndarray]) -> float:
    """|Δ - Δ_exact| / |Δ_exact| over all parameters together: a weight's own relative error is noise where its
    update is (a key bias's), while this weighs each by its share of the step."""
    miss = sum(float(np.sum(((after[k] - before[k]) - (exact[k] - before[k])) ** 2)) for k in exact)
    size = sum(float(np.sum((exact[k] - before[k]) ** 2)) for k in exact)
    return (miss / size) ** 0.5


def measure(name: str, optimizer: str, steps: int) -> dict[str, float]:
    import torch
    from realsize_models import CASES, build

    import onnxtrain

    case = CASES[name]
    rng = np.random.default_rng(1)
    inputs = case.inputs(2, rng)
    labels = case.labels(2, rng)
    args, target = [torch.from_numpy(v) for v in inputs.values()], torch.from_numpy(labels)
    module = build(name)
    # every name of a tied parameter (GPT-2's embedding is also lm_head.weight): the engine holds it under one
    before = {k: p.detach().numpy().copy() for k, p in module.named_parameters(remove_duplicate=False)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        model = onnxtrain.from_torch(module, args, input_names=list(inputs), loss="cross_entropy",
                                     class_axis=-1, optimizer=optimizer, learning_rate=LR)
    engine = onnxtrain.load(model)
    ours = [float(engine.train_step({**inputs, "target": labels})["loss"]) for _ in range(steps)]
    theirs = torch_run(module, args, target, optimizer, steps)
    exact_module = build(name).double()
    exact = torch_run(exact_module, [a.double() if a.is_floating_point() else a for a in args], target, optimizer,
                      steps)
    exact_weights = {k: p.detach().numpy() for k, p in exact_module.named_parameters(remove_duplicate=False)}
    compared = {k: exact_weights[k] for k in engine.state if k in exact_weights}
    ours_weights = {k: np.asarray(engine.state[k], np.float64) for k in compared}
    theirs_weights = {k: p.detach().numpy().astype(np.float64)
                      for k, p in module.named_parameters(remove_duplicate=False) if k in compared}
    loss_error = lambda losses: max(abs(a - b) / abs(b) for a, b in zip(losses, exact))  # noqa: E731
    return {"loss ours": loss_error(ours), "loss torch": loss_error(theirs),
            "update ours": update_error(ours_weights, compared, before),
            "update torch": update_error(theirs_weights, compared, before), "parameters": len(compared)}


def table(rows: list[tuple[str, str, dict[str, float]]]) -> str:
    lines = ["| model | optimizer | parameters | loss error, onnxtrain | loss error, PyTorch | update error, "
             "onnxtrain | update error, PyTorch | ÷ PyTorch |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, optimizer, m in rows:
        lines.append(f"| {name} | {optimizer} | {m['parameters']} | {m['loss ours']:.1e} | {m['loss torch']:.1e} | "
                     f"{m['update ours']:.1e} | {m['update torch']:.1e} | {m['update ours'] / m['update torch']:.2f} |")
    return "\n".join(lines)


def write_readme(text: str) -> None:
    begin, end = "<!-- agreement:begin -->", "<!-- agreement:end -->"
    current = README.read_text()
    head, rest = current.split(begin, 1)
    README.write_text(f"{head}{begin}\n{text}\n{end}{rest.split(end, 1)[1]}")


def main(argv: list[str]) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from realsize_models import CASES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(CASES), help="a comma-separated subset of realsize_models.py's")
    parser.add_argument("--optimizers", default="sgd,adam", help="sgd, adam or both")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="update the agreement table in benchmarks/README.md")
    opts = parser.parse_args(argv)
    unknown = set(opts.models.split(",")) - set(CASES) | set(opts.optimizers.split(",")) - {"sgd", "adam"}
    if unknown:
        parser.error(f"unknown model(s) or optimizer(s) {sorted(unknown)}")
    rows = []
    for name in opts.models.split(","):
        for optimizer in opts.optimizers.split(","):
            print(f"# {name}, {optimizer} ...", flush=True)
            rows.append((name, optimizer, measure(name, optimizer, opts.steps)))
            print(table(rows).splitlines()[-1], flush=True)  # each row as it comes: a run cut short keeps them
    import jax
    import torch

    device = jax.devices()[0]  # onnxtrain's (JAX_PLATFORMS=cuda puts it on a GPU); PyTorch's peers on the CPU
    where = cpu_name() if device.platform == "cpu" else f"{device.device_kind} (PyTorch on {cpu_name()})"
    text = (f"Measured {time.strftime('%Y-%m-%d')} on {where}, jax {jax.__version__}, torch {torch.__version__}, "
            f"batch 2, {opts.steps} steps, learning rate {LR}.\n\nCommand: `python benchmarks/agreement.py"
            f"{''.join(' ' + a for a in argv)}`\n\n{table(rows)}")
    print(text)
    if opts.write:
        write_readme(text)
    failed = [f"{name} ({optimizer})" for name, optimizer, m in rows
              if m["update ours"] > TOLERANCE * m["update torch"] + FLOOR]
    if failed:
        print(f"onnxtrain's update is further from float64 than {TOLERANCE}x PyTorch's: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
