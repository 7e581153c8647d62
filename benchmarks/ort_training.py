"""ONNX Runtime training's train step on one benchmark model, timed the way run.py times its in-process peers.

    benchmarks/.ort-training/bin/python benchmarks/ort_training.py MODEL.onnx BATCH.npz [--steps 200]
        [--rounds 20] [--warmup 5] [--threads 0 1] [--lr 1e-3] [--betas 0.9 0.999] [--eps 1e-6]

MODEL.onnx is an inference model, X [N, ...] float32 -> logits Y [N, 10]; BATCH.npz holds x (float32) and
y (int64 labels). Prints one JSON line: {"median": s per step of the fastest thread setting, "threads": that
setting, "medians": {threads: s per step}, "first": s, "artifacts": s, "onnxruntime": version}. "first" is
creating the training session and its first step, in the first thread setting (ORT's counterpart of tracing and
compiling plus one run); "artifacts" is the generate_artifacts call before it.

Thread settings: each `--threads` value (intra-op threads of the training and optimizer sessions; 0 is ORT's
default, one per physical core) gets its own session on the same artifacts and its own timed run, and the fastest
is the result. Which is faster depends on the model and the load: on the quiet 2-core machine the default wins on
the cnn (8.4 ms against 10.1) and one thread on the transformer (141 against 217); with one core held by another
process the default's spinning workers wait on each other (cnn 18.3 ms against 9.9). This child runs apart from
the interleaved peers, so such a spell would land on ORT alone; the faster setting keeps ORT from looking slower
than it can be.

This runs under its own environment (onnxruntime-training-cpu, numpy<2, onnx 1.16: see README.md), never the
suite's, because that package installs the same `onnxruntime` module as the inference package run.py times. So
it imports neither onnxtrain nor JAX nor PyTorch, and run.py starts it as a child process.

What is timed: `generate_artifacts` adds SoftmaxCrossEntropyLoss (LossType.CrossEntropyLoss, mean over the batch)
and its gradient graph for every float32 initializer (onnxtrain's default trainables), then one step is
`module(x, labels)` (forward + backward), `optimizer.step()`, `module.lazy_reset_grad()`, on a batch already held
as OrtValues.

The optimizer: ORT's on-device training offers only AdamW and SGD (artifacts.OptimType). AdamW with weight decay 0
is Adam, so it is the closest; it is built as an `onnxblock.optim.AdamW` block rather than the OptimType enum only
to pass the suite's betas and epsilon explicitly. Its kernel runs in Hugging Face's mode (adam_mode 1, fixed by
onnxblock), which folds both bias corrections into the learning rate, lr·sqrt(1-beta2^t)/(1-beta1^t)·m/(sqrt(v)+eps):
the update of the ONNX Adam operator (PyTorch's Adam, which onnxtrain.make_trainable(optimizer="adam") writes,
adds eps to the corrected sqrt(v) instead, the same work per element).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnx
import onnxruntime
from onnxruntime.capi.onnxruntime_inference_collection import OrtValue

# onnxruntime.training's __init__ imports its PyTorch front end (ORTModule, amp, optim), which needs torch; the
# on-device API used here (artifacts, onnxblock, api) does not. Registering the package without running that
# __init__ keeps torch, a second copy of it of a gigabyte, out of this environment.
_training = types.ModuleType("onnxruntime.training")
_training.__path__ = [str(Path(onnxruntime.__file__).parent / "training")]
sys.modules.setdefault("onnxruntime.training", _training)

from onnxruntime.training import artifacts, onnxblock  # noqa: E402
from onnxruntime.training.api import CheckpointState, Module, Optimizer  # noqa: E402

SETTLE, WARM = 0.05, 0.05  # seconds slept, then of untimed steps, before each round: as peers.interleaved()


def trainable(model: onnx.ModelProto) -> list[str]:
    """Every float32 initializer, as onnxtrain.make_trainable trains by default (ORT's AdamW kernel is float32)."""
    return [t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]


def with_layer_norm_statistics(model: onnx.ModelProto) -> None:
    """Give every LayerNormalization its optional Mean and InvStdDev outputs. ORT 1.19's gradient builder for it
    reads them and fails on a node without them (`GradientBuilderBase::O ... i < node_->OutputDefs().size()`), as
    the TorchScript exporter writes it; its kernel computes both either way, so the graph does the same work."""
    for node in model.graph.node:
        if node.op_type == "LayerNormalization" and len(node.output) < 3:
            node.output.extend(f"{node.output[0]}.{name}" for name in ("mean", "inv_std_dev")[len(node.output) - 1:])


def make_artifacts(model_path: Path, folder: Path, betas: tuple[float, float], eps: float) -> None:
    model = onnx.load(model_path)
    # the suite's onnx writes its newest IR version, which this onnx and ORT 1.19 do not read; the benchmark graphs
    # use nothing newer than IR 10 (opsets 17 and 20)
    model.ir_version = min(model.ir_version, onnx.IR_VERSION)
    with_layer_norm_statistics(model)
    artifacts.generate_artifacts(model, requires_grad=trainable(model), loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=onnxblock.optim.AdamW(betas=betas, eps=eps, weight_decay=0.0),
                                 artifact_directory=folder)


def load(folder: Path, lr: float, threads: int) -> tuple[Module, Optimizer]:
    """The training session: where ORT optimizes and plans the graphs, its counterpart of tracing and compiling.
    Each load reads the checkpoint afresh, so every thread setting starts from the same weights."""
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    module = Module(folder / "training_model.onnx", CheckpointState.load_checkpoint(folder / "checkpoint"),
                    folder / "eval_model.onnx", device="cpu", session_options=options)
    optimizer = Optimizer(folder / "optimizer_model.onnx", module)
    optimizer.set_learning_rate(lr)
    return module, optimizer


def step_fn(module: Module, optimizer: Optimizer, x: np.ndarray, y: np.ndarray) -> Callable[[], Any]:
    # the loss block names its label input "labels"; feeding by name keeps the order right whatever it is
    held = {"X": OrtValue.ortvalue_from_numpy(x), "labels": OrtValue.ortvalue_from_numpy(y)}
    feeds = [held[name] for name in module.input_names()]
    module.train()

    def step() -> Any:
        loss = module(*feeds)
        optimizer.step()
        module.lazy_reset_grad()
        return loss

    return step


def timed(step: Callable[[], Any], steps: int, rounds: int) -> float:
    """Median seconds per step over `steps` steps in `rounds` rounds, each after a pause and WARM seconds of
    untimed steps, so the loop matches peers.interleaved() with this one callable."""
    times = []
    for _ in range(rounds):
        time.sleep(SETTLE)
        start = time.perf_counter()
        step()
        while time.perf_counter() - start < WARM:
            step()
        for _ in range(max(1, steps // rounds)):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str]) -> None:
    args = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args.add_argument("--version", action="version", version=onnxruntime.__version__)
    args.add_argument("model", type=Path, help="inference model: X -> logits Y")
    args.add_argument("batch", type=Path, help=".npz with x (float32) and y (int64 labels)")
    args.add_argument("--steps", type=int, default=200, help="timed steps")
    args.add_argument("--rounds", type=int, default=20)
    args.add_argument("--warmup", type=int, default=5, help="untimed steps after the first")
    args.add_argument("--threads", type=int, nargs="+", default=[0, 1],
                      help="intra-op thread settings to time, the first also for the first call (0: ORT's default)")
    args.add_argument("--lr", type=float, default=1e-3)
    args.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.999))
    args.add_argument("--eps", type=float, default=1e-6)
    opts = args.parse_args(argv)
    batch = np.load(opts.batch)
    x, y = np.ascontiguousarray(batch["x"], np.float32), np.ascontiguousarray(batch["y"], np.int64)
    medians: dict[int, float] = {}
    first = 0.0
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        make_artifacts(opts.model, Path(folder), tuple(opts.betas), opts.eps)
        made = time.perf_counter()
        for threads in opts.threads:
            loading = time.perf_counter()
            step = step_fn(*load(Path(folder), opts.lr, threads), x, y)
            step()
            first = first or time.perf_counter() - loading
            for _ in range(opts.warmup):
                step()
            medians[threads] = timed(step, opts.steps, opts.rounds)
            del step  # frees this setting's sessions, whose idle workers would otherwise share the cores
    best = min(medians, key=medians.__getitem__)
    print(json.dumps({"median": medians[best], "threads": best, "medians": medians, "first": first,
                      "artifacts": made - start, "onnxruntime": onnxruntime.__version__}))


if __name__ == "__main__":
    main(sys.argv[1:])
