"""GPT-2 124M written by hand in JAX + optax: the real-size JAX peer of benchmarks/realsize.py's gpt2 case.

    python benchmarks/realsize.py --models gpt2 --jax

The same math as the module realsize_models.py builds (Hugging Face's GPT2LMHeadModel from the default config,
dropout off, the logits of the last position) written the way a JAX user would: a pytree of weights, one
`jax.jit` of `value_and_grad` and `optax.sgd` with the weights donated, `jax.jit` of the forward pass, and each
product of activations by a weight flattened to one 2-D product (`dense`: XLA-CPU differentiates the 3-D `x @ w`
into slower products, 1.44 s against 0.97 s a step at batch 2, first step 8.9 against 5.5 s). The
weights are random (as every real-size peer's); the lm head reads the token embedding transposed, as the module
does. Where onnxtrain's step is slower than this one, the difference is onnxtrain's lowering; where both are
slower than PyTorch's, it is XLA's.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

VOCAB, POSITIONS, WIDTH, LAYERS, HEADS = 50257, 1024, 768, 12, 12


class Initializer:
    """Random weights as Hugging Face initializes these models: normal with std 0.02, zero biases, unit norm
    scales, drawn in turn from one seeded generator."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def normal(self, *shape: int) -> jax.Array:
        return jnp.asarray(self.rng.normal(0, 0.02, shape).astype(np.float32))

    def norm(self) -> dict[str, jax.Array]:
        return {"scale": jnp.ones(WIDTH), "bias": jnp.zeros(WIDTH)}

    def dense(self, fan_in: int, fan_out: int) -> dict[str, jax.Array]:
        return {"w": self.normal(fan_in, fan_out), "b": jnp.zeros(fan_out)}


def weights(seed: int = 0) -> dict[str, Any]:
    init = Initializer(seed)
    layers = [{"ln1": init.norm(), "qkv": init.dense(WIDTH, 3 * WIDTH), "proj": init.dense(WIDTH, WIDTH),
               "ln2": init.norm(), "up": init.dense(WIDTH, 4 * WIDTH), "down": init.dense(4 * WIDTH, WIDTH)}
              for _ in range(LAYERS)]
    return {"tokens": init.normal(VOCAB, WIDTH), "positions": init.normal(POSITIONS, WIDTH), "layers": layers,
            "ln_f": init.norm()}


def dense(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    """x [..., k] @ w [k, n] + b as one [rows, k] x [k, n] product."""
    return (x.reshape(-1, x.shape[-1]) @ p["w"] + p["b"]).reshape(*x.shape[:-1], p["w"].shape[-1])


def layer_norm(x: jax.Array, p: dict[str, jax.Array], eps: float = 1e-5) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    variance = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(variance + eps) * p["scale"] + p["bias"]


def attention(x: jax.Array, p: dict[str, Any]) -> jax.Array:
    batch, seq, _ = x.shape
    q, k, v = jnp.split(dense(x, p["qkv"]), 3, axis=-1)
    q, k, v = (t.reshape(batch, seq, HEADS, WIDTH // HEADS).transpose(0, 2, 1, 3) for t in (q, k, v))
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(WIDTH // HEADS).astype(np.float32)
    causal = jnp.tril(jnp.ones((seq, seq), bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    out = (jax.nn.softmax(scores, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(batch, seq, WIDTH)
    return dense(out, p["proj"])


def forward(params: dict[str, Any], ids: jax.Array) -> jax.Array:
    """The logits of the last position, [batch, VOCAB]; like the module, the lm head computes every position's."""
    h = params["tokens"][ids] + params["positions"][: ids.shape[1]]
    for p in params["layers"]:
        h = h + attention(layer_norm(h, p["ln1"]), p)
        h = h + dense(jax.nn.gelu(dense(layer_norm(h, p["ln2"]), p["up"]), approximate=True), p["down"])
    logits = dense(layer_norm(h, params["ln_f"]), {"w": params["tokens"].T, "b": 0.0})
    return logits[:, -1]


def peer(ids: np.ndarray, target: np.ndarray, lr: float) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(train step, infer) of GPT-2 on device arrays, each returning once computed."""
    return trainer(forward, weights(), ids, target, lr)


def trainer(forward: Callable[[Any, jax.Array], jax.Array], params: Any, ids: np.ndarray, target: np.ndarray,
            lr: float) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(train step, infer) of `forward(params, ids) -> logits` with cross-entropy and optax's SGD, each returning
    once computed; the state is the peer's own."""
    optimizer = optax.sgd(lr)
    state = {"params": params}
    state["opt"] = optimizer.init(state["params"])
    ids, target = jax.device_put(ids.astype(np.int32)), jax.device_put(target.astype(np.int32))

    def loss(params: dict[str, Any]) -> jax.Array:
        return optax.softmax_cross_entropy_with_integer_labels(forward(params, ids), target).mean()

    def step(params: dict[str, Any], opt: Any) -> tuple[Any, Any, jax.Array]:
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt = optimizer.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, value

    jitted, infer = jax.jit(step, donate_argnums=(0, 1)), jax.jit(forward)

    def train() -> jax.Array:
        state["params"], state["opt"], value = jitted(state["params"], state["opt"])
        return jax.block_until_ready(value)

    return train, lambda: jax.block_until_ready(infer(state["params"], ids))
