"""A GPT-2 past protobuf's 2 GiB, end to end: load with validation, train, export, reload in onnxtrain and ONNX
Runtime; and its train step against PyTorch eager's, each peer in a fresh process of its own (first step, step
time, peak resident memory). The model is built at run time from a config with random weights (nothing is
downloaded or kept).

    python benchmarks/big_model.py                     # ~2.7 GB of float32 weights; needs ~16 GB of memory
    python benchmarks/big_model.py --layers 2 --embd 256 --protobuf-limit 4000000   # rehearsal, small model

`--protobuf-limit` lowers the limit onnxtrain assumes, so a small model takes every big-model path.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import onnx

import onnxtrain
import onnxtrain.big_models
from onnxtrain.export import save_atomic

sys.path.insert(0, str(Path(__file__).parent))
from host import MALLOC_ENV, child_result, memory_kib  # noqa: E402

LR = 1e-4


def peak_rss_gb() -> float:
    return memory_kib("VmHWM") / 2**20


def gpt2(args: argparse.Namespace):
    """A random GPT2LMHeadModel (input_ids -> logits), the same in every process; in eval mode (no dropout), as
    it is exported."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_embd=args.embd, n_layer=args.layers, n_head=max(1, args.embd // 128),
                        vocab_size=args.vocab, n_positions=args.sequence, use_cache=False,
                        attn_implementation="eager")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).eval()

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt2 = model

        def forward(self, input_ids):
            return self.gpt2(input_ids=input_ids, use_cache=False, return_dict=False)[0]

    return Logits()


def export_gpt2(folder: Path, args: argparse.Namespace) -> tuple[Path, int]:
    """torch.onnx.export of `gpt2(args)`, weights in external data; the path and the parameter count."""
    import torch

    module = gpt2(args)
    params = sum(p.numel() for p in module.parameters())
    path = folder / "gpt2.onnx"
    ids = torch.zeros((1, args.sequence), dtype=torch.int64)
    with torch.no_grad():
        torch.onnx.export(module, (ids,), str(path), input_names=["input_ids"], output_names=["logits"],
                          dynamo=True, external_data=True, optimize=False)
    return path, params


def batch(args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray]:
    """The token ids every measurement trains on, and the regression target (zeros) of make_trainable's MSE."""
    ids = np.random.default_rng(0).integers(0, args.vocab, size=(1, args.sequence)).astype(np.int64)
    return ids, np.zeros((1, args.sequence, args.vocab), np.float32)


def train_loop(name: str, args: argparse.Namespace) -> Callable[[], float]:
    """Peer `name`'s train step (returning its loss), built as a user's process builds it: onnxtrain loads the
    trainable file (validated); PyTorch builds the module and steps MSE, backward and SGD."""
    ids, target = batch(args)
    if name == "onnxtrain":
        engine = onnxtrain.load(Path(args.folder) / "trainable.onnx")
        feeds = {"input_ids": ids, "target": target}
        return lambda: float(np.asarray(engine.train_step(feeds)["loss"]))
    import torch

    module = gpt2(args)
    sgd = torch.optim.SGD(module.parameters(), lr=LR)
    inputs, labels = torch.from_numpy(ids), torch.from_numpy(target)

    def step() -> float:
        sgd.zero_grad()
        loss = torch.nn.functional.mse_loss(module(inputs), labels)
        loss.backward()
        sgd.step()
        return float(loss)

    return step


def child(name: str, args: argparse.Namespace) -> None:
    """Prints peer `name`'s first train step (and its loss), median step and the process's peak RSS."""
    step = train_loop(name, args)
    start = time.perf_counter()
    loss = step()
    first = time.perf_counter() - start
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    print(json.dumps({"first": first, "loss": loss, "step": float(np.median(times)), "peak": peak_rss_gb() * 2**30}))


def fresh(name: str, args: argparse.Namespace, folder: Path) -> dict:
    """`child` in a new process: malloc set as realsize.py sets it (resident memory follows what is live), and
    an empty cache folder of its own (onnxtrain's first step is a first run's)."""
    flags = [f"--{k}={v}" for k, v in vars(args).items() if k in ("layers", "embd", "vocab", "sequence", "steps")]
    cache = folder / f"cache-{name}"
    return child_result([sys.executable, __file__, "--child", name, "--folder", str(folder), *flags],
                        f"the {name} process", {**MALLOC_ENV, "ONNXTRAIN_CACHE_DIR": str(cache)})


def compare_peers(folder: Path, args: argparse.Namespace) -> None:
    """Both peers' train steps, each in a fresh process, and the loss of their first step: the same weights, so
    the same number (the exported graph computes what the module does)."""
    ours, theirs = fresh("onnxtrain", args, folder), fresh("torch", args, folder)
    print("| measurement | onnxtrain | PyTorch eager | ÷ PyTorch |\n|---|---:|---:|---:|")
    for label, key, scale in (("first train step (s)", "first", 1), ("train step, median (s)", "step", 1),
                              ("peak RSS (GB)", "peak", 1e9)):
        print(f"| {label} | {ours[key] / scale:.2f} | {theirs[key] / scale:.2f} | {ours[key] / theirs[key]:.2f} |")
    print(f"first step's loss: onnxtrain {ours['loss']:.6g}, PyTorch {theirs['loss']:.6g}")
    if not np.isclose(ours["loss"], theirs["loss"], rtol=1e-4):
        sys.exit("the first step's losses differ: the peers do not train the same model")


def ort_logits(path: Path, ids: np.ndarray) -> np.ndarray:
    """ONNX Runtime on the exported file's inference part (training_info dropped: ORT does not run it)."""
    import onnxruntime as ort

    inference = onnx.load(path, load_external_data=False)  # the data file is shared, not copied
    del inference.training_info[:]
    inference_path = path.with_name("inference.onnx")
    inference_path.write_bytes(inference.SerializeToString())
    session = ort.InferenceSession(str(inference_path), providers=["CPUExecutionProvider"])
    return session.run(None, {"input_ids": ids})[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=13)
    parser.add_argument("--embd", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--sequence", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3, help="timed train steps after the first")
    parser.add_argument("--protobuf-limit", type=int, default=onnxtrain.big_models.PROTOBUF_LIMIT)
    parser.add_argument("--child", choices=("onnxtrain", "torch"), help=argparse.SUPPRESS)  # run by `fresh`
    parser.add_argument("--folder", help=argparse.SUPPRESS)  # the child's: where trainable.onnx is
    args = parser.parse_args()
    if args.child:
        return child(args.child, args)
    onnxtrain.big_models.PROTOBUF_LIMIT = args.protobuf_limit
    ids, target = batch(args)
    with tempfile.TemporaryDirectory(prefix="onnxtrain-big-model-") as tmp:
        folder = Path(tmp)
        start = time.perf_counter()
        source, params = export_gpt2(folder, args)
        gc.collect()
        print(f"GPT-2 {args.layers} layers x {args.embd}, vocab {args.vocab}: {params:,} parameters, "
              f"{params * 4 / 1e9:.2f} GB float32; torch.onnx.export {time.perf_counter() - start:.1f} s")

        start = time.perf_counter()
        model = onnx.load(source)
        assert onnxtrain.big_models.exceeds_protobuf_limit(model), "the model fits protobuf: nothing is tested"
        trainable = onnxtrain.make_trainable(model, loss="mse", optimizer="sgd", learning_rate=LR)
        del model
        save_atomic(trainable, folder / "trainable.onnx")  # as `onnxtrain make-trainable` writes it
        del trainable
        print(f"onnx.load + make_trainable + save: {time.perf_counter() - start:.1f} s")
        compare_peers(folder, args)

        start = time.perf_counter()
        engine = onnxtrain.load(folder / "trainable.onnx")  # onnx.checker runs (on a skeleton of the model)
        print(f"onnxtrain.load of the trainable file (validated): {time.perf_counter() - start:.1f} s")

        feeds = {"input_ids": ids, "target": target}
        start = time.perf_counter()
        loss = float(np.asarray(engine.train_step(feeds)["loss"]))
        print(f"first train step (compile + run): {time.perf_counter() - start:.1f} s, loss {loss:.4g}")
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            loss = float(np.asarray(engine.train_step(feeds)["loss"]))
            times.append(time.perf_counter() - start)
        print(f"train step: median {np.median(times):.2f} s over {args.steps}, loss {loss:.4g}; "
              f"peak RSS so far {peak_rss_gb():.1f} GB")

        expected = np.asarray(engine.infer({"input_ids": ids})["logits"])
        embedding = max(engine.state.items(), key=lambda item: item[1].size)[0]  # the largest weight
        trained_embedding = np.array(engine.state[embedding])
        exported = folder / "trained.onnx"
        start = time.perf_counter()
        engine.export(exported)  # external data chosen automatically
        data = [p.name for p in folder.iterdir() if p.name.startswith("trained.onnx.")]
        print(f"export: {time.perf_counter() - start:.1f} s; model file {exported.stat().st_size:,} bytes, "
              f"data file {data}")
        del engine
        gc.collect()

        start = time.perf_counter()
        logits = ort_logits(exported, ids)
        ort_error = float(np.max(np.abs(logits - expected)))
        print(f"ONNX Runtime load + run of the export: {time.perf_counter() - start:.1f} s, "
              f"max |ORT - onnxtrain.infer| {ort_error:.2e}")
        start = time.perf_counter()
        reloaded = onnxtrain.load(exported)
        same = np.array_equal(np.asarray(reloaded.state[embedding]), trained_embedding)
        print(f"onnxtrain.load of the export: {time.perf_counter() - start:.1f} s, trained {embedding} "
              f"{'identical' if same else 'DIFFERS'}, step {reloaded.step_count}; peak RSS {peak_rss_gb():.1f} GB")
        if not same or ort_error > 1e-3 * max(1.0, float(np.max(np.abs(expected)))):
            sys.exit("the export does not reproduce the trained model")


if __name__ == "__main__":
    main()
