"""A GPT-2 past protobuf's 2 GiB, end to end: load with validation, train, export, reload in onnxtrain and ONNX
Runtime. The model is built at run time from a config with random weights (nothing is downloaded or kept).

    python benchmarks/big_model.py                     # ~2.7 GB of float32 weights; needs ~16 GB of memory
    python benchmarks/big_model.py --layers 2 --embd 256 --protobuf-limit 4000000   # rehearsal, small model

`--protobuf-limit` lowers the limit onnxtrain assumes, so a small model takes every big-model path.
"""

from __future__ import annotations

import argparse
import gc
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

import onnxtrain
import onnxtrain.big_models


def peak_rss_gb() -> float:
    scale = 2**30 if sys.platform == "darwin" else 2**20  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / scale


def export_gpt2(folder: Path, layers: int, embd: int, vocab: int, sequence: int) -> tuple[Path, int]:
    """torch.onnx.export of a random GPT2LMHeadModel (input_ids -> logits), weights in external data."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_embd=embd, n_layer=layers, n_head=max(1, embd // 128), vocab_size=vocab,
                        n_positions=sequence, use_cache=False, attn_implementation="eager")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).eval()
    params = sum(p.numel() for p in model.parameters())

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt2 = model

        def forward(self, input_ids):
            return self.gpt2(input_ids=input_ids, use_cache=False, return_dict=False)[0]

    path = folder / "gpt2.onnx"
    ids = torch.zeros((1, sequence), dtype=torch.int64)
    with torch.no_grad():
        torch.onnx.export(Logits(), (ids,), str(path), input_names=["input_ids"], output_names=["logits"],
                          dynamo=True, external_data=True, optimize=False)
    return path, params


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
    args = parser.parse_args()
    onnxtrain.big_models.PROTOBUF_LIMIT = args.protobuf_limit
    rng = np.random.default_rng(0)
    ids = rng.integers(0, args.vocab, size=(1, args.sequence)).astype(np.int64)
    with tempfile.TemporaryDirectory(prefix="onnxtrain-big-model-") as tmp:
        folder = Path(tmp)
        start = time.perf_counter()
        source, params = export_gpt2(folder, args.layers, args.embd, args.vocab, args.sequence)
        gc.collect()
        print(f"GPT-2 {args.layers} layers x {args.embd}, vocab {args.vocab}: {params:,} parameters, "
              f"{params * 4 / 1e9:.2f} GB float32; torch.onnx.export {time.perf_counter() - start:.1f} s")

        start = time.perf_counter()
        model = onnx.load(source)
        assert onnxtrain.big_models.exceeds_protobuf_limit(model), "the model fits protobuf: nothing is tested"
        trainable = onnxtrain.make_trainable(model, loss="mse", optimizer="sgd", learning_rate=1e-4)
        del model
        engine = onnxtrain.load(trainable)  # onnx.checker runs (on a skeleton of the model)
        del trainable
        print(f"onnx.load + make_trainable + onnxtrain.load (validated): {time.perf_counter() - start:.1f} s")

        target = np.zeros((1, args.sequence, args.vocab), np.float32)
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
        embedding = max(engine.state, key=lambda n: np.prod(engine.state[n].shape))  # the largest weight
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
