"""Attention and the transformer building blocks around it: Attention (23-25), FlexAttention (preview),
LinearAttention, RotaryEmbedding, CausalConvWithState and SwiGLU.

Grouped-query attention never materializes repeated K/V heads: query heads are folded to (kv_heads, group) and
contracted against their shared K/V head (query head h reads K/V head h // group, as the spec says).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ...dtypes import np_dtype
from ..autocast import low_precision, product_result
from ..registry import op, versions

PREVIEW_DOMAIN = "ai.onnx.preview"


# --- head layout ---------------------------------------------------------------------------------------------


def split_heads(x, num_heads: int | None, what: str):
    """(B, S, H*D) -> (B, H, S, D)."""
    if num_heads is None:
        raise ValueError(f"3D {what} needs the number of heads (q_num_heads / kv_num_heads)")
    batch, length, hidden = x.shape
    if num_heads <= 0 or hidden % num_heads:
        raise ValueError(f"{what}: hidden size {hidden} is not divisible by {num_heads} heads")
    return jnp.transpose(jnp.reshape(x, (batch, length, num_heads, hidden // num_heads)), (0, 2, 1, 3))


def merge_heads(x):
    """(B, H, S, D) -> (B, S, H*D)."""
    batch, heads, length, size = x.shape
    return jnp.reshape(jnp.transpose(x, (0, 2, 1, 3)), (batch, length, heads * size))


def head_groups(q_heads: int, kv_heads: int) -> int:
    if kv_heads <= 0 or q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads cannot share {kv_heads} key/value heads")
    return q_heads // kv_heads


def grouped_scores(q, k):
    """q (B, Hq, Sq, D) . k (B, Hkv, Skv, D)^T -> (B, Hq, Sq, Skv)."""
    batch, q_heads, q_len, size = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    grouped = jnp.reshape(q, (batch, kv_heads, head_groups(q_heads, kv_heads), q_len, size))
    (grouped, k), accumulate = low_precision(grouped, k)
    scores = product_result(jnp.einsum("bhgqd,bhkd->bhgqk", grouped, k, preferred_element_type=accumulate), k,
                            accumulate)
    return jnp.reshape(scores, (batch, q_heads, q_len, kv_len))


def grouped_values(probs, v):
    """probs (B, Hq, Sq, Skv) . v (B, Hkv, Skv, Dv) -> (B, Hq, Sq, Dv)."""
    batch, q_heads, q_len, kv_len = probs.shape
    kv_heads = v.shape[1]
    grouped = jnp.reshape(probs, (batch, kv_heads, head_groups(q_heads, kv_heads), q_len, kv_len))
    (grouped, v), accumulate = low_precision(grouped, v)
    values = product_result(jnp.einsum("bhgqk,bhkd->bhgqd", grouped, v, preferred_element_type=accumulate), v,
                            accumulate)
    return jnp.reshape(values, (batch, q_heads, q_len, v.shape[-1]))


# --- Attention -----------------------------------------------------------------------------------------------


def allowed_keys(q_len: int, kv_len: int, offset, is_causal: int, left: int, right: int, nonpad_kv_seqlen):
    """Where causality, the sliding window and kv padding let query i see key j, or None if they all allow
    everything. Query i sits at absolute position i + offset; a per-batch offset yields (B, 1, Sq, Skv)."""
    query = jnp.arange(q_len)[:, None] + offset
    key = jnp.arange(kv_len)[None, :]
    allowed = None

    def both(a, b):
        return b if a is None else a & b

    if is_causal:
        allowed = both(allowed, key <= query)
    if left >= 0:
        allowed = both(allowed, key >= query - left)
    if right >= 0:
        allowed = both(allowed, key <= query + right)
    if nonpad_kv_seqlen is not None:
        allowed = both(allowed, key < jnp.reshape(nonpad_kv_seqlen, (-1, 1, 1, 1)))
    return allowed


def attention_bias(attn_mask, dtype, kv_len: int, allowed):
    """The additive bias: a boolean mask as 0 / -inf, a float mask as given, padded with -inf up to kv_len
    (the mask may be shorter than the cache), and -inf wherever `allowed` is False."""
    neg_inf = jnp.asarray(-jnp.inf, dtype)
    if attn_mask is None:
        bias = jnp.zeros((1, kv_len), dtype)
    else:
        is_bool = attn_mask.dtype == jnp.bool_
        missing = kv_len - attn_mask.shape[-1]
        if missing > 0:
            widths = [(0, 0)] * (attn_mask.ndim - 1) + [(0, missing)]
            attn_mask = jnp.pad(attn_mask, widths, constant_values=False if is_bool else -jnp.inf)
        bias = jnp.where(attn_mask, jnp.zeros((), dtype), neg_inf) if is_bool else attn_mask.astype(dtype)
    return bias if allowed is None else jnp.where(allowed, bias, neg_inf)


def guarded_softmax(logits, fully_masked):
    """Softmax over the last axis whose fully-masked rows are 0, not NaN (forward and backward)."""
    peak = jnp.max(logits, axis=-1, keepdims=True)
    peak = lax.stop_gradient(jnp.where(jnp.isneginf(peak), jnp.zeros((), logits.dtype), peak))
    weights = jnp.exp(logits - peak)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    probs = weights / jnp.where(total == 0, jnp.ones((), total.dtype), total)
    return jnp.where(fully_masked, jnp.zeros((), probs.dtype), probs)


@op("Attention", *versions("Attention", until=24))
def attention(
    Q,
    K,
    V,
    attn_mask=None,
    past_key=None,
    past_value=None,
    nonpad_kv_seqlen=None,
    *,
    is_causal=0,
    q_num_heads=None,
    kv_num_heads=None,
    scale=None,
    softcap=0.0,
    softmax_precision=None,
    qk_matmul_output_mode=0,
    left_window_size=-1,
    right_window_size=-1,
):
    """Returns (Y, present_key, present_value, qk_matmul_output)."""
    if (past_key is None) != (past_value is None):
        raise ValueError("past_key and past_value must be given together")
    if past_key is not None and nonpad_kv_seqlen is not None:
        raise ValueError("nonpad_kv_seqlen (an external cache) cannot be combined with past_key/past_value")
    if not 0 <= qk_matmul_output_mode <= 3:
        raise ValueError(f"qk_matmul_output_mode must be 0..3, got {qk_matmul_output_mode}")
    packed = Q.ndim == 3
    if packed:
        Q = split_heads(Q, q_num_heads, "Q")
        K = split_heads(K, kv_num_heads, "K")
        V = split_heads(V, kv_num_heads, "V")
    past_len = 0
    if past_key is not None:
        past_len = past_key.shape[2]
        K = jnp.concatenate([past_key, K], axis=2)
        V = jnp.concatenate([past_value, V], axis=2)
    dtype = Q.dtype
    q_len, kv_len = Q.shape[2], K.shape[2]

    root_scale = jnp.asarray(math.sqrt(1 / math.sqrt(Q.shape[-1]) if scale is None else scale), dtype)
    scores = grouped_scores(Q * root_scale, K * root_scale)
    capped = softcap * jnp.tanh(scores / softcap) if softcap > 0 else scores

    # bottom-right causal alignment: the query block follows the cached keys
    offset = past_len if nonpad_kv_seqlen is None else jnp.reshape(nonpad_kv_seqlen, (-1, 1, 1, 1)) - q_len
    allowed = allowed_keys(q_len, kv_len, offset, is_causal, left_window_size, right_window_size, nonpad_kv_seqlen)
    bias = attention_bias(attn_mask, dtype, kv_len, allowed)
    biased = capped + bias
    fully_masked = jnp.all(jnp.isneginf(bias), axis=-1, keepdims=True)
    softmax_dtype = dtype if softmax_precision is None else np_dtype(softmax_precision)
    probs = guarded_softmax(biased.astype(softmax_dtype), fully_masked).astype(dtype)

    y = grouped_values(probs, V)
    qk_output = (scores, capped, biased, probs)[qk_matmul_output_mode].astype(dtype)
    return (merge_heads(y) if packed else y), K, V, qk_output


@op("Attention", *versions("Attention", since=25))
def attention_25(Q, K, V, *inputs, q_num_heads=None, kv_num_heads=None, left_window_size, right_window_size, **attrs):
    """Opset 25 adds the sliding window and rejects head counts on 4D inputs."""
    if Q.ndim == 4 and (q_num_heads is not None or kv_num_heads is not None):
        raise ValueError("q_num_heads and kv_num_heads must not be given with 4D Q, K, V")
    for name, size in (("left_window_size", left_window_size), ("right_window_size", right_window_size)):
        if size < -1:
            raise ValueError(f"{name} must be -1 or nonnegative, got {size}")
    return attention(
        Q,
        K,
        V,
        *inputs,
        q_num_heads=q_num_heads,
        kv_num_heads=kv_num_heads,
        left_window_size=left_window_size,
        right_window_size=right_window_size,
        **attrs,
    )


@op("FlexAttention", *versions("FlexAttention", domain=PREVIEW_DOMAIN), domain=PREVIEW_DOMAIN)
def flex_attention(Q, K, V, *, scale=None, score_mod=None, prob_mod=None, softmax_precision=None):
    """Scores, softmax and the value product run in the softmax precision (float32 for narrower inputs);
    `score_mod` / `prob_mod` are subgraphs mapping a (B, Hq, Sq, Skv) tensor to one of the same shape."""
    if Q.ndim != 4 or K.ndim != 4 or V.ndim != 4:
        raise ValueError(f"FlexAttention needs rank-4 Q, K, V, got {Q.shape}, {K.shape}, {V.shape}")
    if softmax_precision is not None:
        compute = np_dtype(softmax_precision)
    else:
        compute = np.dtype(np.float32) if np.dtype(Q.dtype).itemsize < 4 else np.dtype(Q.dtype)
    scale = 1 / math.sqrt(Q.shape[-1]) if scale is None else scale
    root_scale = jnp.asarray(np.sqrt(np.float32(scale)), Q.dtype)
    scores = grouped_scores(Q * root_scale, K * root_scale).astype(compute)
    if score_mod is not None:
        scores = jnp.asarray(score_mod(scores)[0]).astype(compute)
    probs = jax.nn.softmax(scores, axis=-1)
    if prob_mod is not None:
        probs = jnp.asarray(prob_mod(probs)[0]).astype(compute)
    return grouped_values(probs, V.astype(compute)).astype(V.dtype)


# --- LinearAttention -----------------------------------------------------------------------------------------

UPDATE_RULES = {"linear": (False, False), "gated": (True, False), "delta": (False, True), "gated_delta": (True, True)}


def per_head_sequence(x, kv_heads: int, what: str):
    """decay / beta (B, T, 1 or H or H*D) -> time-major (T, B, 1 or H, 1 or D), to broadcast in the scan."""
    batch, length, last = x.shape
    if last != 1 and last % kv_heads:
        raise ValueError(f"{what}: last dimension {last} does not fit {kv_heads} key/value heads")
    heads = 1 if last == 1 else kv_heads
    return jnp.transpose(jnp.reshape(x, (batch, length, heads, last // heads)), (1, 0, 2, 3))


@op("LinearAttention", *versions("LinearAttention"))
def linear_attention(
    query, key, value, past_state=None, decay=None, beta=None, *, q_num_heads, kv_num_heads, update_rule, scale,
    chunk_size=64,
):
    """The recurrence run token by token (lax.scan) in at least float32; `chunk_size` is only a tuning hint.
    Returns (output (B, T, Hq*Dv), present_state (B, Hkv, Dk, Dv))."""
    if update_rule not in UPDATE_RULES:
        raise ValueError(f"update_rule must be one of {sorted(UPDATE_RULES)}, got {update_rule!r}")
    gated, delta = UPDATE_RULES[update_rule]
    for name, value_, needed in (("decay", decay, gated), ("beta", beta, delta)):
        if needed and value_ is None:
            raise ValueError(f"update_rule {update_rule!r} needs the {name} input")
        if not needed and value_ is not None:
            raise ValueError(f"update_rule {update_rule!r} does not take a {name} input")
    dtype = jnp.promote_types(query.dtype, jnp.float32)
    group = head_groups(q_num_heads, kv_num_heads)
    q = split_heads(query, q_num_heads, "query").astype(dtype)
    k = split_heads(key, kv_num_heads, "key").astype(dtype)
    v = split_heads(value, kv_num_heads, "value").astype(dtype)
    batch, _, _, key_size = k.shape
    value_size = v.shape[-1]
    state_shape = (batch, kv_num_heads, key_size, value_size)
    if past_state is not None and tuple(past_state.shape) != state_shape:
        raise ValueError(f"past_state shape {tuple(past_state.shape)} should be {state_shape}")
    state = jnp.zeros(state_shape, dtype) if past_state is None else past_state.astype(dtype)
    scale = scale if scale else 1 / math.sqrt(query.shape[-1] // q_num_heads)

    def time_major(x):  # (B, H, T, D) -> (T, B, H, D)
        return jnp.transpose(x, (2, 0, 1, 3))

    steps = {
        "q": time_major(q),
        "k": time_major(k),
        "v": time_major(v),
        "decay": None if decay is None else per_head_sequence(decay.astype(dtype), kv_num_heads, "decay"),
        "beta": None if beta is None else per_head_sequence(beta.astype(dtype), kv_num_heads, "beta"),
    }

    def step(state, t):
        if gated:
            state = state * jnp.exp(t["decay"])[..., None]
        update = t["v"]
        if delta:
            update = t["beta"] * (update - jnp.einsum("bhdm,bhd->bhm", state, t["k"]))
        state = state + t["k"][..., :, None] * update[..., None, :]
        q_t = jnp.reshape(t["q"], (batch, kv_num_heads, group, key_size))
        out = scale * jnp.einsum("bhgd,bhdm->bhgm", q_t, state)
        return state, jnp.reshape(out, (batch, q_num_heads, value_size))

    state, outputs = lax.scan(step, state, steps)
    output = jnp.reshape(jnp.transpose(outputs, (1, 0, 2, 3)), (batch, outputs.shape[0], q_num_heads * value_size))
    state_dtype = query.dtype if past_state is None else past_state.dtype
    return output.astype(query.dtype), state.astype(state_dtype)


# --- RotaryEmbedding, CausalConvWithState, SwiGLU ------------------------------------------------------------


@op("RotaryEmbedding", *versions("RotaryEmbedding"))
def rotary_embedding(X, cos_cache, sin_cache, position_ids=None, *, interleaved, rotary_embedding_dim, num_heads=None):
    """Rotates the first `rotary_embedding_dim` features of each head (all by default), as pairs of halves or,
    when interleaved, of neighbours. X is (B, H, S, D) or (B, S, H*D)."""
    if X.ndim == 4:
        x = jnp.transpose(X, (0, 2, 1, 3))  # (B, S, H, D)
    else:
        x = jnp.transpose(split_heads(X, num_heads, "X"), (0, 2, 1, 3))
    head_size = x.shape[-1]
    rotated_size = rotary_embedding_dim or head_size
    half = rotated_size // 2
    if position_ids is not None:
        cos_cache = jnp.take(cos_cache, position_ids, axis=0)
        sin_cache = jnp.take(sin_cache, position_ids, axis=0)
    if cos_cache.shape[-1] != half or sin_cache.shape[-1] != half:
        raise ValueError(f"cos/sin caches must end in rotary_embedding_dim / 2 = {half}, got {cos_cache.shape}")
    cos = jnp.expand_dims(cos_cache, -2)  # broadcast over heads
    sin = jnp.expand_dims(sin_cache, -2)
    rotated, kept = x[..., :rotated_size], x[..., rotated_size:]
    if interleaved:
        first, second = rotated[..., 0::2], rotated[..., 1::2]
    else:
        first, second = rotated[..., :half], rotated[..., half:]
    real = cos * first - sin * second
    imag = sin * first + cos * second
    if interleaved:
        rotated = jnp.reshape(jnp.stack([real, imag], axis=-1), rotated.shape)
    else:
        rotated = jnp.concatenate([real, imag], axis=-1)
    y = jnp.concatenate([rotated, kept], axis=-1).astype(X.dtype)
    if X.ndim == 4:
        return jnp.transpose(y, (0, 2, 1, 3))
    return jnp.reshape(y, X.shape)


@op("CausalConvWithState", *versions("CausalConvWithState"))
def causal_conv_with_state(input, weight, bias=None, past_state=None, *, activation):
    """Depthwise causal conv1d over (B, C, L) after the carried (B, C, k-1) state; returns (output,
    present_state) where present_state is the last k-1 positions of state ++ input."""
    if activation not in ("none", "silu", "swish"):
        raise ValueError(f"activation must be 'none', 'silu' or 'swish', got {activation!r}")
    if input.ndim != 3 or weight.ndim != 3:
        raise ValueError(f"input and weight must be rank 3, got {input.shape} and {weight.shape}")
    batch, channels, _ = input.shape
    kernel = weight.shape[2]
    if past_state is None:
        past_state = jnp.zeros((batch, channels, kernel - 1), input.dtype)
    padded = jnp.concatenate([past_state.astype(input.dtype), input], axis=2)
    dtype = jnp.promote_types(input.dtype, jnp.float32)
    out = lax.conv_general_dilated(
        padded.astype(dtype),
        weight.astype(dtype),
        window_strides=(1,),
        padding="VALID",
        dimension_numbers=("NCH", "OIH", "NCH"),
        feature_group_count=channels,
    )
    if bias is not None:
        out = out + bias.astype(dtype)[:, None]
    out = out.astype(input.dtype)  # the spec rounds the convolution before the activation
    if activation != "none":
        wide = out.astype(dtype)
        out = (wide * jax.nn.sigmoid(wide)).astype(input.dtype)
    return out, padded[:, :, padded.shape[2] - (kernel - 1) :]


@op("SwiGLU", *versions("SwiGLU"))
def swiglu(A, B, *, alpha):
    if A.shape != B.shape:
        raise ValueError(f"A and B must have the same shape (no broadcasting), got {A.shape} and {B.shape}")
    return A * jax.nn.sigmoid(alpha * A) * B
