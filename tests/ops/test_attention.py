"""Attention and transformer blocks against the ReferenceEvaluator or NumPy: float64/float16, GQA, caches,
traced nonpad_kv_seqlen and position_ids, opset differences, gradients and error messages."""

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import pytest
from jax.test_util import check_grads
from onnx import helper
from onnx.reference import ReferenceEvaluator

import onnxtrain
from onnxtrain.dtypes import onnx_type
from onnxtrain.lower.ops import attention as att

rng = np.random.default_rng(0)


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def rand(*shape, dtype=np.float64):
    return rng.uniform(-1, 1, shape).astype(dtype)


def single_node(op_type, inputs, n_outputs=1, opset=25, domain="", **attrs) -> onnx.ModelProto:
    """A one-node model; an input given as None is an absent optional input ("" in the node)."""
    outputs = [f"out{i}" for i in range(n_outputs)]
    names = [n if v is not None else "" for n, v in inputs.items()]
    node = helper.make_node(op_type, names, outputs, domain=domain, **attrs)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(n, onnx_type(v.dtype), v.shape) for n, v in inputs.items() if v is not None],
        [helper.make_empty_tensor_value_info(o) for o in outputs],
    )
    opsets = [helper.make_opsetid("", opset if not domain else 25)]
    if domain:
        opsets.append(helper.make_opsetid(domain, opset))
    return helper.make_model(graph, opset_imports=opsets)


def check_gradient(fn, args):
    """Reverse-mode gradients against finite differences (jitted: eager dispatch is slow)."""
    check_grads(jax.jit(fn), args, order=1, modes=["rev"])


def compare(model, inputs, rtol=1e-10, atol=1e-12):
    feeds = {n: v for n, v in inputs.items() if v is not None}
    engine = onnxtrain.load(model, check=False)
    got = engine.infer(feeds)
    ours = [np.asarray(got[n]) for n in engine.output_names]
    theirs = ReferenceEvaluator(model).run(None, feeds)
    for mine, ref in zip(ours, theirs):
        assert mine.dtype == ref.dtype and mine.shape == ref.shape, (mine.dtype, ref.dtype, mine.shape, ref.shape)
        np.testing.assert_allclose(mine.astype(np.float64), ref.astype(np.float64), rtol=rtol, atol=atol)
    return ours


# --- Attention -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("opset", [23, 24, 25])
def test_gqa_bool_mask_causal_with_past_float64(opset):
    inputs = {
        "Q": rand(2, 4, 3, 8),
        "K": rand(2, 2, 3, 8),
        "V": rand(2, 2, 3, 5),
        "mask": rng.uniform(size=(4, 3, 6)) > 0.3,  # rank 3: (heads, q, kv)
        "past_key": rand(2, 2, 3, 8),
        "past_value": rand(2, 2, 3, 5),
    }
    compare(single_node("Attention", inputs, 4, opset, is_causal=1, qk_matmul_output_mode=2), inputs)


def test_mask_broadcast_over_queries_composes_with_causal():
    """NumPy reference: the ReferenceEvaluator sizes the causal mask from the attn_mask's (broadcast) q axis."""
    q, k, v = rand(1, 2, 3, 4), rand(1, 2, 5, 4), rand(1, 2, 5, 4)
    mask = np.array([[True, False, True, True, True]])  # (1, kv): the same for every query
    past_key, past_value = k[:, :, :2], v[:, :, :2]  # the query block follows two cached keys
    y = jax.jit(att.attention, static_argnames=["is_causal"])(
        q, k[:, :, 2:], v[:, :, 2:], mask, past_key, past_value, is_causal=1
    )[0]
    allowed = mask & (np.arange(5)[None, :] <= np.arange(3)[:, None] + 2)
    scores = np.where(allowed, q @ np.swapaxes(k, -1, -2) / 2, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    np.testing.assert_allclose(y, probs / probs.sum(-1, keepdims=True) @ v, rtol=1e-12)


def test_packed_3d_fp16_softcap_with_cache():
    inputs = {
        "Q": rand(2, 3, 4 * 8, dtype=np.float16),
        "K": rand(2, 3, 2 * 8, dtype=np.float16),
        "V": rand(2, 3, 2 * 6, dtype=np.float16),
        "mask": rand(3, 5, dtype=np.float16),  # a float mask is an additive bias
        "past_key": rand(2, 2, 2, 8, dtype=np.float16),
        "past_value": rand(2, 2, 2, 6, dtype=np.float16),
    }
    model = single_node("Attention", inputs, 4, 24, q_num_heads=4, kv_num_heads=2, softcap=2.0, qk_matmul_output_mode=1)
    ours = compare(model, inputs, rtol=2e-3, atol=2e-3)
    assert ours[0].shape == (2, 3, 4 * 6) and ours[1].shape == (2, 2, 5, 8)


def test_traced_nonpad_kv_seqlen_and_short_mask_are_padded():
    """An external cache: per-batch valid lengths fed at run time, and a mask shorter than the cache."""
    inputs = {
        "Q": rand(3, 2, 2, 4),
        "K": rand(3, 2, 6, 4),
        "V": rand(3, 2, 6, 4),
        "mask": rng.uniform(size=(2, 5)) > 0.2,
        "past_key": None,
        "past_value": None,
        "nonpad": np.array([6, 4, 1], np.int64),  # batch 2: offset -1, its first query sees nothing
    }
    y, *_ = compare(single_node("Attention", inputs, 1, 25, is_causal=1), inputs)
    np.testing.assert_array_equal(y[2, :, 0], 0)


def test_sliding_window_with_past_float64():
    inputs = {"Q": rand(1, 2, 3, 4), "K": rand(1, 2, 3, 4), "V": rand(1, 2, 3, 4), "mask": None,
              "past_key": rand(1, 2, 4, 4), "past_value": rand(1, 2, 4, 4)}
    compare(single_node("Attention", inputs, 3, 25, left_window_size=2, right_window_size=1), inputs)


def test_fully_masked_rows_are_zero_with_finite_gradients():
    q, k, v = rand(1, 2, 3, 4), rand(1, 2, 3, 4), rand(1, 2, 3, 4)
    mask = np.array([[True, True, False], [False, False, False], [True, False, True]])

    @jax.jit
    def forward(q, k, v):
        y, _, _, probs = att.attention(q, k, v, mask, is_causal=1, qk_matmul_output_mode=3)
        return y, probs

    y, probs = forward(q, k, v)
    np.testing.assert_array_equal(y[:, :, 1], 0)
    np.testing.assert_array_equal(probs[:, :, 1], 0)
    check_gradient(lambda q, k, v: jnp.sum(forward(q, k, v)[0] ** 2), (q, k, v))


def test_qk_output_mode_0_is_the_raw_product_even_with_softcap():
    """The spec: mode 0 is the QK matmul itself (the ReferenceEvaluator returns it softcapped)."""
    q, k, v = rand(1, 1, 2, 4), rand(1, 1, 3, 4), rand(1, 1, 3, 4)
    qk = jax.jit(lambda q, k, v: att.attention(q, k, v, scale=0.3, softcap=0.5, qk_matmul_output_mode=0)[3])(q, k, v)
    np.testing.assert_allclose(qk, 0.3 * q @ np.swapaxes(k, -1, -2), rtol=1e-12)


def test_softmax_precision_keeps_output_dtype():
    inputs = {n: rand(1, 2, 3, 4, dtype=np.float16) for n in ("Q", "K", "V")}
    model = single_node("Attention", inputs, 4, 24, softmax_precision=onnx.TensorProto.FLOAT, qk_matmul_output_mode=3)
    ours = compare(model, inputs, rtol=2e-3, atol=2e-3)
    assert ours[3].dtype == np.float16


def test_attention_25_rejects_head_counts_on_4d_inputs():
    inputs = {n: rand(1, 2, 3, 4) for n in ("Q", "K", "V")}
    engine = onnxtrain.load(single_node("Attention", inputs, 1, 25, q_num_heads=2, kv_num_heads=2), check=False)
    with pytest.raises(onnxtrain.errors.NodeError, match="must not be given with 4D"):
        engine.infer(inputs)


def test_packed_inputs_need_head_counts():
    inputs = {n: rand(1, 3, 8) for n in ("Q", "K", "V")}
    engine = onnxtrain.load(single_node("Attention", inputs, 1, 24), check=False)
    with pytest.raises(onnxtrain.errors.NodeError, match="3D Q needs the number of heads"):
        engine.infer(inputs)


# --- FlexAttention -------------------------------------------------------------------------------------------


def test_flex_attention_gqa_float64_and_gradient_through_score_mod():
    q, k, v = rand(1, 4, 3, 4), rand(1, 2, 5, 4), rand(1, 2, 5, 3)
    inputs = {"Q": q, "K": k, "V": v}
    compare(single_node("FlexAttention", inputs, 1, 1, domain=att.PREVIEW_DOMAIN, scale=0.7), inputs)

    def halve(scores):
        return [scores * 0.5]

    grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(att.flex_attention(q, k, v, score_mod=halve) ** 2), (0, 1, 2)))(
        q, k, v
    )
    assert all(np.all(np.isfinite(g)) and np.any(g != 0) for g in grads)


# --- RotaryEmbedding -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("interleaved", [0, 1])
def test_rotary_packed_partial_with_traced_position_ids(interleaved):
    batch, length, heads, head_size, rotated = 2, 3, 2, 8, 4
    inputs = {
        "X": rand(batch, length, heads * head_size, dtype=np.float32),  # the schema's T has no double
        "cos": rand(10, rotated // 2, dtype=np.float32),
        "sin": rand(10, rotated // 2, dtype=np.float32),
        "pos": rng.integers(0, 10, (batch, length)).astype(np.int64),
    }
    model = single_node("RotaryEmbedding", inputs, 1, 23, interleaved=interleaved, num_heads=heads,
                        rotary_embedding_dim=rotated)
    compare(model, inputs, rtol=1e-5, atol=1e-6)


def test_rotary_4d_without_position_ids_float16():
    inputs = {"X": rand(2, 2, 3, 4, dtype=np.float16), "cos": rand(2, 3, 2, dtype=np.float16),
              "sin": rand(2, 3, 2, dtype=np.float16)}
    compare(single_node("RotaryEmbedding", inputs, 1, 23), inputs, rtol=1e-3, atol=1e-3)


# --- LinearAttention, CausalConvWithState, SwiGLU ------------------------------------------------------------


@pytest.mark.parametrize("rule", ["linear", "gated", "delta", "gated_delta"])
def test_linear_attention_rules_with_gqa_and_past_state(rule):
    batch, steps, q_heads, kv_heads, dk, dv = 2, 4, 4, 2, 3, 2
    inputs = {
        "query": rand(batch, steps, q_heads * dk),
        "key": rand(batch, steps, kv_heads * dk) * 0.5,
        "value": rand(batch, steps, kv_heads * dv),
        "past_state": rand(batch, kv_heads, dk, dv),
        "decay": -rng.uniform(0, 1, (batch, steps, kv_heads * dk)) if rule.startswith("gated") else None,
        "beta": rng.uniform(0, 1, (batch, steps, 1)) if rule.endswith("delta") else None,
    }
    while inputs and list(inputs.values())[-1] is None:
        inputs.popitem()
    model = single_node("LinearAttention", inputs, 2, 27, q_num_heads=q_heads, kv_num_heads=kv_heads, update_rule=rule)
    ours = compare(model, inputs, rtol=1e-5, atol=1e-6)  # the reference runs the recurrence in float32
    assert ours[0].dtype == ours[1].dtype == np.float64


def test_linear_attention_gradient_and_missing_input_error():
    q, k, v = rand(1, 3, 4), rand(1, 3, 4), rand(1, 3, 2)
    decay, beta = -rng.uniform(0, 1, (1, 3, 2)), rng.uniform(0, 1, (1, 3, 2))

    def fn(q, k, v):
        return att.linear_attention(q, k, v, None, decay, beta, q_num_heads=2, kv_num_heads=2,
                                    update_rule="gated_delta", scale=0.0)[0]

    check_gradient(fn, (q, k, v))
    with pytest.raises(ValueError, match="'gated' needs the decay input"):
        att.linear_attention(q, k, v, q_num_heads=2, kv_num_heads=2, update_rule="gated", scale=0.0)


@pytest.mark.parametrize("activation", ["none", "silu"])
def test_causal_conv_with_state_float64(activation):
    inputs = {"x": rand(2, 3, 5), "w": rand(3, 1, 4), "b": rand(3), "past": rand(2, 3, 3)}
    model = single_node("CausalConvWithState", inputs, 2, 27, activation=activation)
    y, state = compare(model, inputs, rtol=1e-6, atol=1e-7)  # the reference's SiLU runs in float32
    np.testing.assert_array_equal(state, inputs["x"][:, :, -3:])


def test_causal_conv_streaming_equals_one_pass_and_has_gradients():
    x, w = rand(1, 2, 6), rand(2, 1, 3)
    conv = jax.jit(lambda x, w, state=None: att.causal_conv_with_state(x, w, None, state, activation="silu"))
    whole, _ = conv(x, w)
    first, state = conv(x[:, :, :4], w)
    rest, _ = conv(x[:, :, 4:], w, state)
    np.testing.assert_allclose(np.concatenate([first, rest], axis=2), whole, rtol=1e-12)
    grad_x, grad_w = jax.grad(lambda x, w: jnp.sum(conv(x, w)[0] ** 2), (0, 1))(x, w)
    assert grad_x[0, 0, 5] != 0 and grad_w.shape == w.shape  # the last position sees all weights


def test_swiglu_float64_and_shape_check():
    a, b = rand(3, 4), rand(3, 4)
    np.testing.assert_allclose(jax.jit(att.swiglu)(a, b, alpha=1.5), a / (1 + np.exp(-1.5 * a)) * b, rtol=1e-12)
    with pytest.raises(ValueError, match="same shape"):
        att.swiglu(a, b[:, :2], alpha=1.0)
