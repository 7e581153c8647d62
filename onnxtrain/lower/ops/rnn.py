"""RNN, GRU and LSTM: one recurrence driver (directions, sequence_lens, initial states, layouts) and a table of
per-step cell functions.

Every direction runs in the same lax.scan: weights keep ONNX's leading num_directions axis and a backward
direction simply sees its sequence reversed (within each batch entry's length), so a bidirectional layer costs
one scan. The input projection X·Wᵀ + Wb, which does not depend on the state, is one matmul before the scan, and
the recurrence bias Rb joins it there wherever it is added to the whole gate (everywhere but the candidate of a
GRU with linear_before_reset): added inside the step, its gradient was summed over the batch, per gate, in every
step of the backward loop (an LSTM's train step on a GPU: six more kernels per time step).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ...errors import NodeError
from ..registry import op, versions
from ..target import target_platform
from ..values import Value, is_static

Array = jax.Array
Activation = Callable[[Array], Array]


# name (lower case) -> (f(x, alpha, beta), default alpha or None if unused, default beta or None if unused)
ACTIVATIONS: dict[str, tuple[Callable[[Array, float, float], Array], float | None, float | None]] = {
    "relu": (lambda x, a, b: jax.nn.relu(x), None, None),
    "tanh": (lambda x, a, b: jnp.tanh(x), None, None),
    "sigmoid": (lambda x, a, b: jax.nn.sigmoid(x), None, None),
    "affine": (lambda x, a, b: a * x + b, 1.0, 0.0),
    "leakyrelu": (lambda x, a, b: jnp.where(x >= 0, x, a * x), 0.01, None),
    "thresholdedrelu": (lambda x, a, b: jnp.where(x >= a, x, 0), 1.0, None),
    "scaledtanh": (lambda x, a, b: a * jnp.tanh(b * x), 1.0, 1.0),
    "hardsigmoid": (lambda x, a, b: jnp.clip(a * x + b, 0, 1), 0.2, 0.5),
    "elu": (lambda x, a, b: jnp.where(x >= 0, x, a * jnp.expm1(x)), 1.0, None),
    "softsign": (lambda x, a, b: x / (1 + jnp.abs(x)), None, None),
    "softplus": (lambda x, a, b: jax.nn.softplus(x), None, None),
}


def bind_activations(names: Sequence[str], alphas: Sequence[float], betas: Sequence[float]) -> list[tuple]:
    """(function, alpha, beta) per name. As onnxruntime does, alpha/beta values are consumed in order by the
    activations that take them; the others, and any left without a value, use the function's default."""
    alphas, betas = list(alphas or []), list(betas or [])
    bound = []
    for name in names:
        key = name.lower()
        if key not in ACTIVATIONS:
            raise NodeError(f"unknown activation {name!r}; expected one of {sorted(ACTIVATIONS)}")
        fn, alpha, beta = ACTIVATIONS[key]
        if alpha is not None and alphas:
            alpha = alphas.pop(0)
        if beta is not None and betas:
            beta = betas.pop(0)
        bound.append((key, alpha, beta))
    return bound


def per_direction(bound: Sequence[tuple]) -> Activation:
    """One activation over the [num_directions, ...] axis; directions may use different functions."""
    functions = [partial(ACTIVATIONS[key][0], a=alpha, b=beta) for key, alpha, beta in bound]
    if len(set(bound)) == 1:
        return functions[0]
    return lambda x: jnp.stack([fn(x[d]) for d, fn in enumerate(functions)])


@dataclass(frozen=True)
class Weights:
    """What a step reads besides its input projection: recurrence weights and biases, peepholes."""

    R: Array  # [D, H, gates*H]: ONNX's R transposed once, outside the loop, for h·R
    R_t: Array  # [D, gates*H, H]: ONNX's R as given, for the gradient's g·Rᵀ (see _recur)
    Rb: Array | None  # [D, H]: the part of Rb a cell adds inside (the linear-before-reset GRU candidate's)
    P: Array | None  # [D, 3*H], LSTM only; None without peepholes (zeros would still cost three products)
    clip: Callable[[Array], Array]  # applied to every gate's pre-activation


def product(a: Array, b: Array) -> Array:
    """a·b for every direction: [D, B, K] x [D, K, N] -> [D, B, N]."""
    if a.shape[0] == 1:
        return (a[0] @ b[0])[None]
    return jnp.einsum("dbk,dkn->dbn", a, b)


def product_transposed(a: Array, b_t: Array) -> Array:
    """a·b_tᵀ for every direction: [D, B, K] x [D, N, K] -> [D, B, N]."""
    if a.shape[0] == 1:
        return lax.dot_general(a[0], b_t[0], (((1,), (1,)), ((), ())))[None]
    return jnp.einsum("dbk,dnk->dbn", a, b_t)


@jax.custom_jvp
def _recur(h: Array, R: Array, R_t: Array) -> Array:
    return product(h, R)


@_recur.defjvp
def _recur_jvp(primals: tuple, tangents: tuple) -> tuple:
    # The tangent dh·R is written against R_t, ONNX's R as given ([gates*H, H]; its value is Rᵀ), so that its
    # transpose, the gradient g·R_t once per step of the backward loop, is a plain product: JAX's own rule
    # contracted R's last axis instead, which XLA-CPU's matmul ran ~1.4x slower. R_t does not change the value.
    (h, R, R_t), (dh, dR, _) = primals, tangents
    return product(h, R), product_transposed(dh, R_t) + product(h, dR)


def recur(h: Array, w: Weights, gates: slice = slice(None)) -> Array:
    """h·R over the columns `gates` of R, for every direction: [D, B, H] -> [D, B, columns]."""
    return _recur(h, w.R[..., gates], w.R_t[:, gates])


def bias(b: Array) -> Array:
    return b[:, None, :]  # [D, G] broadcast over the batch


def rnn_cell(x: tuple, state: tuple, w: Weights, acts: Sequence[Activation]) -> tuple:
    (x_gate,), (h,) = x, state
    return (acts[0](w.clip(x_gate + recur(h, w))),)


def gru_cell(x: tuple, state: tuple, w: Weights, acts: Sequence[Activation], linear_before_reset: int) -> tuple:
    (h,) = state
    f, g = acts
    hidden = h.shape[-1]
    x_z, x_r, x_h = x
    zr, candidate_columns = slice(0, 2 * hidden), slice(2 * hidden, None)
    h_z, h_r = jnp.split(recur(h, w, zr), 2, axis=-1)
    z, r = f(w.clip(x_z + h_z)), f(w.clip(x_r + h_r))
    if linear_before_reset:
        candidate = g(w.clip(x_h + r * (recur(h, w, candidate_columns) + bias(w.Rb))))
    else:
        candidate = g(w.clip(x_h + recur(r * h, w, candidate_columns)))
    return ((1 - z) * candidate + z * h,)


def lstm_cell(x: tuple, state: tuple, w: Weights, acts: Sequence[Activation], input_forget: int) -> tuple:
    h, c = state
    f, g, act_h = acts
    gi, go, gf, gc = (x_gate + hR_gate for x_gate, hR_gate in zip(x, jnp.split(recur(h, w), 4, axis=-1)))
    if w.P is not None:
        p_i, p_o, p_f = (bias(p) for p in jnp.split(w.P, 3, axis=-1))
        gi, gf = gi + p_i * c, gf + p_f * c
    i = f(w.clip(gi))
    forget = 1 - i if input_forget else f(w.clip(gf))
    c_new = forget * c + i * g(w.clip(gc))
    o = f(w.clip(go if w.P is None else go + p_o * c_new))
    return o * act_h(c_new), c_new


@dataclass(frozen=True)
class CellKind:
    gates: int  # blocks stacked in W and R
    activations: tuple[str, ...]  # the default per direction
    n_states: int  # 1 (h) or 2 (h, c)


RNN_KIND = CellKind(1, ("Tanh",), 1)
GRU_KIND = CellKind(3, ("Sigmoid", "Tanh"), 1)
LSTM_KIND = CellKind(4, ("Sigmoid", "Tanh", "Tanh"), 2)

DIRECTIONS = {"forward": (False,), "reverse": (True,), "bidirectional": (False, True)}


def reverse_within(x: Array, lengths: Array | None) -> Array:
    """x [T, B, ...] with each batch entry's first lengths[b] steps reversed (the rest stay in place)."""
    if lengths is None:
        return jnp.flip(x, 0)
    t = jnp.arange(x.shape[0])[:, None]
    index = jnp.where(t < lengths[None, :], lengths[None, :] - 1 - t, t)
    return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=0)


def recurrence(
    kind: CellKind,
    cell: Callable,
    X: Value,
    W: Value,
    R: Value,
    B: Value,
    sequence_lens: Value,
    initial: Sequence[Value],
    P: Value = None,
    *,
    direction: str,
    activations: Sequence[str] | None,
    activation_alpha: Sequence[float] | None,
    activation_beta: Sequence[float] | None,
    clip: float | None,
    layout: int,
    inner_bias_gate: int | None = None,
) -> tuple:
    """(Y, final states...) in the node's layout. `inner_bias_gate`: the gate block whose recurrence bias the
    cell adds inside (not to the whole gate); every other block's joins the input projection."""
    if direction not in DIRECTIONS:
        raise NodeError(f"direction must be one of {sorted(DIRECTIONS)}, got {direction!r}")
    reversed_ = DIRECTIONS[direction]
    D = len(reversed_)
    if np.shape(W)[0] != D:
        raise NodeError(f"direction {direction!r} needs {D} weight set(s), W has {np.shape(W)[0]}")
    if layout:
        X = jnp.swapaxes(X, 0, 1)
        initial = [None if s is None else jnp.swapaxes(s, 0, 1) for s in initial]
    steps, batch, _ = np.shape(X)
    hidden = np.shape(R)[-1]
    dtype = X.dtype
    states = tuple(jnp.zeros((D, batch, hidden), dtype) if s is None else jnp.asarray(s) for s in initial)
    B = jnp.zeros((D, 2 * kind.gates * hidden), dtype) if B is None else B
    Wb, Rb = jnp.split(B, 2, axis=-1)

    lengths = None if sequence_lens is None else jnp.asarray(sequence_lens)
    if sequence_lens is not None and is_static(sequence_lens) and np.all(np.asarray(sequence_lens) == steps):
        lengths = None  # every sequence is full length: no masking needed
    ordered = [reverse_within(X, lengths) if rev else X for rev in reversed_]  # D x [T, B, I]
    if D == 1:  # one 2-D product: the batched form left [T, B, G] to transpose in memory (4 MB in an LSTM)
        projected = (ordered[0] @ jnp.swapaxes(W[0], 0, 1))[:, None]
    else:
        projected = jnp.einsum("dtbi,dgi->tdbg", jnp.stack(ordered), W)
    inner = None if inner_bias_gate is None else slice(inner_bias_gate * hidden, (inner_bias_gate + 1) * hidden)
    outer_Rb = Rb if inner is None else Rb.at[:, inner].set(0)
    projected = projected + (Wb + outer_Rb)[None, :, None, :]  # [T, D, B, G]

    acts = activation_functions(kind, D, activations, activation_alpha, activation_beta)
    limit = (lambda x: x) if clip is None else (lambda x: jnp.clip(x, -clip, clip))
    weights = Weights(jnp.swapaxes(jnp.asarray(R), 1, 2), jnp.asarray(R), None if inner is None else Rb[:, inner],
                      P, limit)
    mask = None if lengths is None else (jnp.arange(steps)[:, None] < lengths[None, :])[:, None, :, None]

    # On the CPU one stacked input per gate (cells take x as a tuple of gate blocks): a step's slice of the whole
    # [T, D, B, gates*H] projection, split into gates inside the cell, fused into the cell's elementwise kernel
    # as index arithmetic that XLA-CPU runs several times slower (benchmarks/README.md). Elsewhere the one
    # projection, split in the step as a JAX user writes it: per-gate inputs cost every step a slice per gate,
    # and its gradient a store per gate, each a kernel.
    per_gate = target_platform() == "cpu"
    scanned = tuple(jnp.split(projected, kind.gates, axis=-1)) if per_gate else projected

    def step(carry: tuple, xs: tuple) -> tuple:
        x, active = xs
        new = cell(x if per_gate else tuple(jnp.split(x, kind.gates, axis=-1)), carry, weights, acts)
        if active is None:
            return new, new[0]
        kept = tuple(jnp.where(active, n, c) for n, c in zip(new, carry))
        return kept, jnp.where(active, new[0], jnp.zeros((), dtype))

    final, Y = lax.scan(step, states, (scanned, mask))  # Y: [T, D, B, H]
    Y = jnp.stack([reverse_within(Y[:, d], lengths) if rev else Y[:, d] for d, rev in enumerate(reversed_)], 1)
    if layout:
        return (jnp.transpose(Y, (2, 0, 1, 3)), *[jnp.swapaxes(s, 0, 1) for s in final])
    return (Y, *final)


def activation_functions(
    kind: CellKind, D: int, names: Sequence[str] | None, alphas: Sequence[float] | None, betas: Sequence[float] | None
) -> list[Activation]:
    """One activation per slot of the cell (f, g, h...), each over the num_directions axis."""
    k = len(kind.activations)
    names = list(names) if names else list(kind.activations) * D
    if len(names) == k and D == 2:
        names = names * 2  # one list given for a bidirectional layer: both directions use it
    if len(names) < k * D:
        raise NodeError(f"activations needs {k * D} names for {D} direction(s), got {len(names)}")
    bound = bind_activations(names[: k * D], alphas, betas)
    return [per_direction([bound[d * k + slot] for d in range(D)]) for slot in range(k)]


@op("RNN", *versions("RNN", since=7))
def rnn(
    X, W, R, B=None, sequence_lens=None, initial_h=None, *, hidden_size=None, activations=("Tanh", "Tanh"),
    activation_alpha=None, activation_beta=None, clip=None, direction="forward", layout=0,
) -> tuple:
    return recurrence(
        RNN_KIND, rnn_cell, X, W, R, B, sequence_lens, [initial_h], direction=direction, activations=activations,
        activation_alpha=activation_alpha, activation_beta=activation_beta, clip=clip, layout=layout,
    )


@op("GRU", *versions("GRU", since=7))
def gru(
    X, W, R, B=None, sequence_lens=None, initial_h=None, *, hidden_size=None, activations=None,
    activation_alpha=None, activation_beta=None, clip=None, direction="forward", linear_before_reset=0, layout=0,
) -> tuple:
    return recurrence(
        GRU_KIND, partial(gru_cell, linear_before_reset=linear_before_reset), X, W, R, B, sequence_lens,
        [initial_h], direction=direction, activations=activations, activation_alpha=activation_alpha,
        activation_beta=activation_beta, clip=clip, layout=layout, inner_bias_gate=2 if linear_before_reset else None,
    )


@op("LSTM", *versions("LSTM", since=7))
def lstm(
    X, W, R, B=None, sequence_lens=None, initial_h=None, initial_c=None, P=None, *, hidden_size=None,
    activations=None, activation_alpha=None, activation_beta=None, clip=None, direction="forward", input_forget=0,
    layout=0,
) -> tuple:
    return recurrence(
        LSTM_KIND, partial(lstm_cell, input_forget=input_forget), X, W, R, B, sequence_lens,
        [initial_h, initial_c], P, direction=direction, activations=activations,
        activation_alpha=activation_alpha, activation_beta=activation_beta, clip=clip, layout=layout,
    )


# Opset 1 (and GRU 3) only add `output_sequence`, which says whether Y is wanted: the node's outputs say that.
# GRU-1's schema spells its default direction "foward".


@op("RNN", 1)
def rnn_v1(*inputs, output_sequence=0, **attributes) -> tuple:
    return rnn(*inputs, **attributes)


@op("GRU", 1, 3)
def gru_v1(*inputs, direction: str, output_sequence=0, **attributes) -> tuple:
    return gru(*inputs, direction="forward" if direction == "foward" else direction, **attributes)


@op("LSTM", 1)
def lstm_v1(*inputs, output_sequence=0, **attributes) -> tuple:
    return lstm(*inputs, **attributes)
