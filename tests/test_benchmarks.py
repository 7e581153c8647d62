"""The benchmark suite still runs end to end (a smoke run: it checks the table is printed, never a timing); the
scripts that check numbers against PyTorch (agreement.py, big_model.py) fail where the numbers are wrong."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("onnxruntime")

ROOT = Path(__file__).resolve().parent.parent


def test_run_quick_prints_the_table():
    command = [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--quick", "--models", "mlp", "--steps", "4"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "| model | measurement | onnxtrain | JAX | PyTorch | ORT |" in out
    measurements = ["train step (ms)", "infer (ms)", "first call, train step (s)", "first call, infer (s)",
                    "train step temporaries"]
    if jax.default_backend() == "cpu":  # on an accelerator the state is in its memory, which RSS does not show
        measurements.append("train peak RSS increase")
    for measurement in measurements:
        assert f"| mlp | {measurement}" in out, out
    assert "dispatch overhead (µs" in out


def test_kernels_lists_each_peers_kernels_per_step():
    command = [sys.executable, str(ROOT / "benchmarks" / "kernels.py"), "--models", "mlp", "--steps", "3", "--top", "3"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for peer in ("onnxtrain", "jax"):
        found = re.search(rf"^mlp {peer}: (\d+) kernels per step", done.stdout, re.M)
        assert found and int(found.group(1)) >= 10, done.stdout  # three products and their gradients at least


def test_realsize_quick_prints_the_table():
    """Every kind of row, each through the cheapest entry of its table: --huge-pages is one more entry of the
    table of process settings that --retain goes through (three more processes compiling ResNet-18, of this
    test's 4.5 minutes), and --remat-attention, which recomputes nothing in a model without attention, goes
    through the remat rows as --remat does, without compiling ResNet-18's recomputed step twice (38 s of 144)."""
    command = [sys.executable, str(ROOT / "benchmarks" / "realsize.py"), "--quick", "--models", "resnet18",
               "--steps", "1", "--mixed-precision", "bfloat16", "--remat-attention", "--retain"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| model | measurement | onnxtrain | PyTorch | ÷ PyTorch |" in done.stdout
    for measurement in ("train step (ms)", "infer (ms)", "first train step, cold (s)",
                        "first train step, warm cache (s)", "peak RSS (MB)", "peak RSS, long run (MB)",
                        "peak RSS, long run, warm cache (MB)", "train step, bfloat16 (ms)",
                        "peak RSS, bfloat16, warm cache (MB)", "train step, attention recomputed (ms)",
                        "peak RSS, attention recomputed, warm cache (MB)",
                        "train step, freed memory retained (ms)", "peak RSS, freed memory retained (MB)"):
        assert f"| resnet18 | {measurement} |" in done.stdout, done.stdout


def test_agreement_fails_nowhere_on_mobilenet():
    """agreement.py exits non-zero where onnxtrain's update is further from PyTorch's float64 one than 3x PyTorch's
    float32 update is: MobileNetV3-small (its cheapest real-size model: depthwise convolutions, hard-swish,
    squeeze-excitation), one SGD step."""
    command = [sys.executable, str(ROOT / "benchmarks" / "agreement.py"), "--models", "mobilenetv3-small",
               "--optimizers", "sgd", "--steps", "1"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| mobilenetv3-small | sgd | 142 |" in done.stdout, done.stdout


def test_big_model_rehearsal_trains_as_pytorch_does_and_exports():
    """The big-model benchmark on a small GPT-2 that takes every big-model path (a lowered protobuf limit): it
    exits non-zero where onnxtrain's first loss differs from PyTorch's on the same weights, or where ONNX Runtime
    or a reload does not reproduce the trained model."""
    command = [sys.executable, str(ROOT / "benchmarks" / "big_model.py"), "--layers", "2", "--embd", "128",
               "--vocab", "256", "--protobuf-limit", "1000000", "--steps", "2"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    for measurement in ("first train step (s)", "train step, median (s)", "peak RSS (GB)"):
        assert f"| {measurement} |" in done.stdout, done.stdout
    assert "trained" in done.stdout and "identical" in done.stdout, done.stdout


def test_products_prints_the_table():
    command = [sys.executable, str(ROOT / "benchmarks" / "products.py"), "--tokens", "8", "--width", "16",
               "--steps", "2"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "8, " in line]
    assert len(rows) == 9, done.stdout  # three forms of each of the layer's three weight shapes


def test_convolutions_prints_the_table():
    command = [sys.executable, str(ROOT / "benchmarks" / "convolutions.py"), "--layers", "4x6", "--steps", "2"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "2, 4, 6" in line]
    assert len(rows) == 3, done.stdout  # forward, input gradient and kernel gradient of the one layer


def gpt2_weights(weights: dict[str, np.ndarray]) -> dict:
    """jax_gpt2's pytree from the state dict of realsize_models' gpt2 module (Conv1D weights are [in, out])."""
    prefix = "model.transformer."

    def dense(name: str) -> dict:
        return {"w": weights[f"{name}.weight"], "b": weights[f"{name}.bias"]}

    def norm(name: str) -> dict:
        return {"scale": weights[f"{name}.weight"], "bias": weights[f"{name}.bias"]}

    layers = [{"ln1": norm(f"{prefix}h.{i}.ln_1"), "qkv": dense(f"{prefix}h.{i}.attn.c_attn"),
               "proj": dense(f"{prefix}h.{i}.attn.c_proj"), "ln2": norm(f"{prefix}h.{i}.ln_2"),
               "up": dense(f"{prefix}h.{i}.mlp.c_fc"), "down": dense(f"{prefix}h.{i}.mlp.c_proj")} for i in range(12)]
    return {"tokens": weights[f"{prefix}wte.weight"], "positions": weights[f"{prefix}wpe.weight"], "layers": layers,
            "ln_f": norm(f"{prefix}ln_f")}


def bert_weights(weights: dict[str, np.ndarray]) -> dict:
    """jax_bert's pytree from the state dict of realsize_models' bert-base module (Linear weights are [out, in])."""
    prefix = "model.bert."

    def dense(name: str) -> dict:
        return {"w": weights[f"{name}.weight"].T, "b": weights[f"{name}.bias"]}

    def norm(name: str) -> dict:
        return {"scale": weights[f"{name}.weight"], "bias": weights[f"{name}.bias"]}

    def layer(at: str) -> dict:
        return {"q": dense(f"{at}attention.self.query"), "k": dense(f"{at}attention.self.key"),
                "v": dense(f"{at}attention.self.value"), "out": dense(f"{at}attention.output.dense"),
                "ln1": norm(f"{at}attention.output.LayerNorm"), "up": dense(f"{at}intermediate.dense"),
                "down": dense(f"{at}output.dense"), "ln2": norm(f"{at}output.LayerNorm")}

    embeddings = f"{prefix}embeddings."
    return {"tokens": weights[f"{embeddings}word_embeddings.weight"],
            "positions": weights[f"{embeddings}position_embeddings.weight"],
            "types": weights[f"{embeddings}token_type_embeddings.weight"], "ln": norm(f"{embeddings}LayerNorm"),
            "layers": [layer(f"{prefix}encoder.layer.{i}.") for i in range(12)], "pooler": dense(f"{prefix}pooler.dense"),
            "classifier": dense("model.classifier")}


@pytest.mark.parametrize("case, peer, weights_of", [("gpt2", "jax_gpt2", gpt2_weights),
                                                    ("bert-base", "jax_bert", bert_weights)])
def test_a_hand_written_jax_peer_computes_what_the_pytorch_module_computes(case: str, peer: str, weights_of):
    """realsize.py's JAX column means something only if that peer's forward pass is the module's: with the
    module's weights, its logits are PyTorch's."""
    pytest.importorskip("transformers")
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import realsize_models

        module = importlib.import_module(peer)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    torch.manual_seed(0)
    model = realsize_models.CASES[case].module().eval()
    ids = realsize_models.CASES[case].inputs(2, np.random.default_rng(1))["input_ids"]
    with torch.no_grad():
        expected = model(torch.tensor(ids)).numpy()
    params = jax.tree.map(jax.numpy.asarray, weights_of({k: v.numpy() for k, v in model.state_dict().items()}))
    got = np.asarray(module.forward(params, jax.numpy.asarray(ids, np.int32)))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
