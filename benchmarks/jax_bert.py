"""BERT-base written by hand in JAX + optax: the real-size JAX peer of benchmarks/realsize.py's bert-base case.

    python benchmarks/realsize.py --models bert-base --jax

The same math as the module realsize_models.py builds (Hugging Face's BertForSequenceClassification from the
default config, dropout off, no padding so no attention mask, token type 0): embeddings, twelve post-norm layers
with exact (erf) GELU, the pooler's tanh over the first position and the 2-class classifier, written as
jax_gpt2.py writes GPT-2 (one 2-D product per weight, `jax.jit` of `value_and_grad` and `optax.sgd` with the
weights donated). Where onnxtrain's step is slower than this one, the difference is onnxtrain's lowering; where
both are slower than PyTorch's, it is XLA's.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax_gpt2 import WIDTH, Initializer, dense, layer_norm, trainer

VOCAB, POSITIONS, TYPES, LAYERS, HEADS, CLASSES, EPS = 30522, 512, 2, 12, 12, 2, 1e-12  # WIDTH: GPT-2's 768


def weights(seed: int = 0) -> dict[str, Any]:
    init = Initializer(seed)
    layers = [{"q": init.dense(WIDTH, WIDTH), "k": init.dense(WIDTH, WIDTH), "v": init.dense(WIDTH, WIDTH),
               "out": init.dense(WIDTH, WIDTH), "ln1": init.norm(), "up": init.dense(WIDTH, 4 * WIDTH),
               "down": init.dense(4 * WIDTH, WIDTH), "ln2": init.norm()} for _ in range(LAYERS)]
    return {"tokens": init.normal(VOCAB, WIDTH), "positions": init.normal(POSITIONS, WIDTH),
            "types": init.normal(TYPES, WIDTH), "ln": init.norm(), "layers": layers,
            "pooler": init.dense(WIDTH, WIDTH), "classifier": init.dense(WIDTH, CLASSES)}


def attention(x: jax.Array, p: dict[str, Any]) -> jax.Array:
    batch, seq, _ = x.shape
    q, k, v = (dense(x, p[n]).reshape(batch, seq, HEADS, WIDTH // HEADS).transpose(0, 2, 1, 3) for n in "qkv")
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(WIDTH // HEADS).astype(np.float32)
    out = (jax.nn.softmax(scores, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(batch, seq, WIDTH)
    return dense(out, p["out"])


def forward(params: dict[str, Any], ids: jax.Array) -> jax.Array:
    """The class logits, [batch, CLASSES]."""
    h = params["tokens"][ids] + params["positions"][: ids.shape[1]] + params["types"][0]
    h = layer_norm(h, params["ln"], EPS)
    for p in params["layers"]:
        h = layer_norm(h + attention(h, p), p["ln1"], EPS)
        h = layer_norm(h + dense(jax.nn.gelu(dense(h, p["up"]), approximate=False), p["down"]), p["ln2"], EPS)
    pooled = jnp.tanh(dense(h[:, 0], params["pooler"]))
    return dense(pooled, params["classifier"])


def peer(ids: np.ndarray, target: np.ndarray, lr: float) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(train step, infer) of BERT-base on device arrays, each returning once computed."""
    return trainer(forward, weights(), ids, target, lr)
