"""ai.onnx.preview.training: Gradient (lowered to JAX autodiff) and the optimizer ops, per their schema docs."""

from __future__ import annotations

from itertools import accumulate
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from ...dtypes import HALF_FLOAT_DTYPES, is_float
from ...errors import NodeError
from ...ir import readers, reads
from ..axes import wrap_indices
from ..sparse_update import SparseRows, lookups, tapped
from ..walker import NodeContext, Scope, run_node
from ..registry import TRAINING_DOMAIN, op
from ..values import is_static


def differentiated_slice(ctx: NodeContext, sources: set[str], y: str) -> list[int]:
    """Positions of the nodes before the Gradient node that lie on a path from `sources` to `y`.

    A node that produces one of `sources` is excluded: a source named in xs/zs is an independent variable,
    fed by the Gradient node's inputs, even if the graph computes it (e.g. xs=["H"] for an intermediate H).
    """
    nodes = ctx.siblings[: ctx.position]
    reached = set(sources)
    downstream = []
    for i, node in enumerate(nodes):
        if any(o in sources for o in node.outputs):
            continue
        if not reached.isdisjoint(reads(node)):
            downstream.append(i)
            reached.update(o for o in node.outputs if o)
    needed, result = {y}, []
    for i in reversed(downstream):
        node = nodes[i]
        if any(o in needed for o in node.outputs):
            result.append(i)
            needed.update(reads(node))
    return sorted(result)


@op("Gradient", 1, domain=TRAINING_DOMAIN)
def gradient(*inputs, xs: Sequence[str], y: str, zs: Sequence[str] = (), ctx: NodeContext):
    """d(sum of y)/d(x) for each x in xs, at the values fed to this node. A non-scalar y is summed, which is
    what a loss of reduction 'sum' means and what the spec's scalar examples reduce to."""
    xs, zs = list(xs), list(zs)
    if len(inputs) != len(xs) + len(zs):
        raise NodeError(f"{ctx.node.label}: takes {len(xs) + len(zs)} inputs (xs then zs), got {len(inputs)}")
    undefined = [name for name in xs + zs if name not in ctx.scope]
    if undefined:  # no node reads such a name: its gradient would silently be zeros, and a parameter not trained
        raise NodeError(f"{ctx.node.label}: xs/zs name {undefined}, which the graph does not define before this node")
    for name, x in zip(xs, inputs):
        if not is_float(jnp.result_type(x)):
            raise NodeError(f"{ctx.node.label}: xs input {name!r} is {jnp.result_type(x)}: a gradient is taken with "
                            "respect to float tensors only")
    positions = differentiated_slice(ctx, set(xs) | set(zs), y)
    if y not in xs and not any(y in ctx.siblings[i].outputs for i in positions):
        raise NodeError(f"{ctx.node.label}: y={y!r} is not computed from xs={xs} / zs={zs}")
    z_values = dict(zip(zs, inputs[len(xs):]))
    # float16 products: the backward pass seeded with the loss scale keeps their gradients above float16's
    # underflow; unscaled in float32 (a power of two by default, so exactly). lower/autocast.py says why static.
    scale = ctx.trace.mixed_precision.loss_scale if ctx.trace.mixed_precision else 1.0
    tables = table_lookups(ctx, positions, xs) if not ctx.trace.remat and scale == 1.0 else {}

    def y_of(x_values: list, taps: dict):
        scope = Scope({**dict(zip(xs, x_values)), **z_values}, ctx.scope)
        attention = ctx.trace.remat == "attention"
        if ctx.trace.remat and not attention:
            for segment in segments(ctx.siblings, positions):
                run_segment(ctx, segment, scope)
        else:
            regions = {r[-1]: r for r in attention_regions(ctx.siblings, positions, y)} if attention else {}
            inside = {i for region in regions.values() for i in region[:-1]}
            for i in positions:
                if i in regions:  # the whole region where its last node stands: its inputs all exist by then
                    run_segment(ctx, regions[i], scope)
                elif i not in inside:
                    run_node(ctx.siblings[i], scope, ctx.trace, ctx.siblings, i)
                    if i in taps:  # a lookup of a table: its rows' gradient is taken too
                        looked_up = ctx.siblings[i].outputs[0]
                        scope[looked_up] = tapped(scope[looked_up], taps[i])
        y_dtype = jnp.result_type(scope[y])
        if not jnp.issubdtype(y_dtype, jnp.floating):  # a step function's: JAX had returned zero gradients
            raise NodeError(f"{ctx.node.label}: y={y!r} is {y_dtype}, which has no derivative: a Gradient's y is a "
                            "float tensor (the schema's outputs, its gradients, are float16, float or double)")
        traced = {name: v for name, v in scope.values.items() if name not in xs and not is_static(v)}
        return jnp.sum(scope[y]), traced

    x_values = [jnp.asarray(x) for x in inputs[: len(xs)]]
    taps = {i: jnp.zeros(indices.shape + x_values[j].shape[1:], x_values[j].dtype)
            for j, (i, indices) in tables.items()}
    total, pullback, recomputed = jax.vjp(y_of, x_values, taps, has_aux=True)
    if all(value is ctx.scope[name] for name, value in zip(xs + zs, inputs) if name in ctx.scope):
        # Evaluated at the graph's own xs/zs, the re-run forward values equal the ones already computed: use
        # them from here on, so the first forward pass becomes dead code XLA drops (it cannot merge two copies
        # of a while loop, e.g. an LSTM, by itself).
        ctx.scope.values.update(recomputed)
    if scale == 1.0:
        grads, rows = pullback(jnp.ones_like(total))
        for j, (i, indices) in tables.items():
            if ctx.node.outputs[j]:
                ctx.trace.sparse_gradients[ctx.node.outputs[j]] = SparseRows(
                    inputs[j], jnp.ravel(indices), jnp.reshape(rows[i], (-1, *x_values[j].shape[1:])))
        return tuple(grads)
    return tuple(g / jnp.asarray(scale, g.dtype) for g in pullback(jnp.full_like(total, scale))[0])


def table_lookups(ctx: NodeContext, positions: list[int], xs: list[str]) -> dict[int, tuple[int, object]]:
    """xs that the slice reads through one Gather along their first axis (lower/sparse_update.py), whose indices
    are known before it: index in xs -> (the Gather's position, its indices counted from the start)."""
    found = {}
    made_here = {o for i in positions for o in ctx.siblings[i].outputs}
    for x, i in lookups(ctx.siblings, positions, xs).items():
        name = ctx.siblings[i].inputs[1]
        if name and name not in made_here and name in ctx.scope:
            indices = ctx.scope[name]
            if jnp.issubdtype(jnp.result_type(indices), jnp.integer):
                try:
                    found[xs.index(x)] = (i, jnp.asarray(wrap_indices(indices, ctx.scope[x].shape[0])))
                except IndexError:  # left to the Gather, which names its own error
                    continue
    return found


def segments(nodes: Sequence, positions: list[int]) -> list[list[int]]:
    """`positions` cut into about sqrt(n) runs of consecutive nodes, each cut where the fewest values computed
    before it are read after it (between a transformer's layers: the hidden state): the values a recomputed
    forward pass keeps for the backward one are those crossing the cuts, and each run's own are recomputed."""
    n = len(positions)
    length = max(2, round(n**0.5))
    made: dict[str, int] = {}  # value -> index in positions of the node that computes it
    last_read: dict[str, int] = {}
    for k, i in enumerate(positions):
        node = nodes[i]
        for name in reads(node):
            if name in made:
                last_read[name] = k
        made.update((o, k) for o in node.outputs if o)
    change = [0] * (n + 2)  # crossing[k]: values made before position k and read at k or later
    for name, k in last_read.items():
        change[made[name] + 1] += 1
        change[k + 1] -= 1
    crossing = list(accumulate(change))
    cuts, start = [], 0
    while n - start > length + length // 2:
        window = range(start + length // 2, start + length + length // 2 + 1)
        cut = min(window, key=lambda c: (crossing[c], abs(c - start - length)))
        cuts.append(cut)
        start = cut
    bounds = [0, *cuts, n]
    return [positions[a:b] for a, b in zip(bounds, bounds[1:])]


# load's remat option: False keeps every forward value the backward pass reads; True recomputes the forward
# pass in segments (`segments`); "attention" recomputes each attention's scores and probabilities alone.
REMAT_MODES = (False, True, "attention")

# What may stand between an attention's scores product and its softmax (scaling, masks, casts), and between the
# softmax and the product with the values (PyTorch's exported scaled_dot_product_attention zeroes the NaN rows of
# a fully masked query: IsNaN and Where; in a train-mode export, or make_trainable's train_mode=True, attention
# dropout drops probabilities: Dropout, whose recomputation draws the forward pass's mask, see Randomness in
# docs/semantics.md).
BETWEEN_PRODUCTS = frozenset({"Add", "Sub", "Mul", "Div", "Where", "Cast", "Neg", "IsNaN", "IsInf", "Not", "Equal",
                              "Dropout"})


def attention_regions(nodes: Sequence, positions: list[int], y: str) -> list[list[int]]:
    """The attentions among `positions` (load(remat="attention")): a MatMul of the scores, elementwise steps, a
    Softmax, elementwise steps, and the MatMul of the probabilities with the values, each value made in between
    read inside the region alone. Each region, as sorted positions, is recomputed in the backward pass from its
    inputs (queries, keys, values, mask), so neither the scores nor the probabilities (batch x heads x length^2
    each) are kept for it, as PyTorch's fused scaled_dot_product_attention keeps neither."""
    reading = readers(nodes)
    maker = {o: i for i in positions for o in nodes[i].outputs if o}
    in_slice = set(positions)

    def plain(i: int, ops: frozenset[str]) -> bool:
        return i in in_slice and nodes[i].op_type in ops and not nodes[i].domain

    def scores_product(i: int) -> list[int] | None:
        """Back from the Softmax at i through one value per step to the MatMul computing the scores."""
        chain = []
        while True:
            flowing = [maker[n] for n in nodes[i].inputs if n in maker and n != y and reading[n] == [i]
                       and plain(maker[n], BETWEEN_PRODUCTS | {"MatMul"})]
            if len(flowing) != 1:
                return None
            i = flowing[0]
            chain.append(i)
            if nodes[i].op_type == "MatMul":
                return chain

    def values_product(i: int) -> list[int] | None:
        """Every reader of the probabilities and of what is made of them, ending in one MatMul that reads them
        as its first operand."""
        found, final, pending = [], None, [nodes[i].outputs[0]]
        while pending:
            name = pending.pop()
            if name == y:
                return None
            for j in reading.get(name, []):
                if plain(j, frozenset({"MatMul"})) and nodes[j].inputs[0] == name and final in (None, j):
                    final = j
                elif plain(j, BETWEEN_PRODUCTS) and j not in found:
                    found.append(j)
                    pending.extend(nodes[j].outputs)
                elif j not in found:
                    return None
        return None if final is None else [*found, final]

    regions, taken = [], set()
    for i in positions:
        if nodes[i].op_type == "Softmax" and not nodes[i].domain:
            before, after = scores_product(i), values_product(i)
            if before and after and taken.isdisjoint([*before, *after]):  # a node runs in one region at most
                regions.append(sorted([*before, i, *after]))
                taken.update(regions[-1])
    return regions


def run_segment(ctx: NodeContext, segment: list[int], scope: Scope) -> None:
    """Run the nodes at `segment` so that the backward pass recomputes their values from the segment's inputs
    instead of keeping them (load(remat=True)). Values computed at trace time (shapes) do not depend on the
    inputs and stay static: they leave the recomputed function beside it, not through it."""
    outer: dict[str, object] = {}
    made: set[str] = set()
    for i in segment:
        node = ctx.siblings[i]
        for name in reads(node):
            if name not in made and name in scope.values and not is_static(scope.values[name]):
                outer[name] = scope.values[name]
        made.update(o for o in node.outputs if o)
    static: dict[str, object] = {}

    def run(inputs: dict) -> dict:
        inner = Scope(dict(inputs), scope, sealed=True)
        for i in segment:
            run_node(ctx.siblings[i], inner, ctx.trace, ctx.siblings, i)
        computed = {n: v for n, v in inner.values.items() if n not in inputs}
        static.update((n, v) for n, v in computed.items() if is_static(v))
        return {n: v for n, v in computed.items() if not is_static(v)}

    scope.values.update(rematerialized(run)(outer))
    scope.values.update(static)


def rematerialized(f):
    """f (a pytree of arrays -> a pytree of arrays), differentiated by running f again in the backward pass
    from its inputs, the only values it keeps. The recomputation runs inside a conditional on the incoming
    cotangents (both branches the same): XLA-CPU schedules a plain or jax.checkpoint'ed recomputation right
    after the forward pass, where every segment's values are live at once and nothing is saved (a 12-layer toy
    MLP: 448 MB of temporaries either way, 52 MB with the conditional), while a conditional cannot run before
    its operands exist. Symbolic zeros keep the conditional's predicate off constant cotangents (XLA would fold
    the conditional away) and the pullback off outputs nothing differentiates."""
    perturbed: list[bool] = []  # per input leaf, set by the forward rule (traced before the backward one)

    @jax.custom_vjp
    def call(inputs):
        return f(inputs)

    def forward(inputs):
        leaves, tree = jax.tree_util.tree_flatten(inputs, is_leaf=lambda v: isinstance(v, CustomVJPPrimal))
        perturbed[:] = [leaf.perturbed for leaf in leaves]
        values = jax.tree_util.tree_unflatten(tree, [leaf.value for leaf in leaves])
        return f(values), values

    def backward(inputs, cotangents):
        leaves, tree = jax.tree_util.tree_flatten(inputs)
        wrt = [i for i, v in enumerate(leaves) if perturbed[i] and jnp.issubdtype(jnp.result_type(v), jnp.inexact)]
        incoming = jax.tree_util.tree_leaves(cotangents)
        seeds = [i for i, c in enumerate(incoming) if not isinstance(c, SymbolicZero)]
        seed_values = [incoming[i] for i in seeds]
        grads: list = [None] * len(leaves)
        if not (wrt and seeds):
            return (jax.tree_util.tree_unflatten(tree, grads),)

        def pull(wrt_values, seed_values):
            def differentiated(values):
                full = list(leaves)
                for i, v in zip(wrt, values):
                    full[i] = v
                outs = jax.tree_util.tree_leaves(f(jax.tree_util.tree_unflatten(tree, full)))
                return [outs[i] for i in seeds]

            return jax.vjp(differentiated, wrt_values)[1](seed_values)[0]

        pred = sum(jnp.real(jnp.ravel(c)[0]).astype(jnp.float32) for c in seed_values if jnp.size(c)) > 0
        for i, g in zip(wrt, lax.cond(pred, pull, pull, [leaves[i] for i in wrt], seed_values)):
            grads[i] = g
        return (jax.tree_util.tree_unflatten(tree, grads),)

    call.defvjp(forward, backward, symbolic_zeros=True)
    return call


def split_groups(ctx: NodeContext, tensors: Sequence, groups: int) -> list[tuple]:
    """Optimizer inputs after R and T come as `groups` blocks of n tensors (X..., G..., ...); zip them."""
    if len(tensors) % groups:
        raise NodeError(f"{ctx.node.label}: expects a multiple of {groups} tensors after R and T, got {len(tensors)}")
    n = len(tensors) // groups
    return list(zip(*(tensors[k * n : (k + 1) * n] for k in range(groups))))


def cast_like(value, like):
    return jnp.asarray(value).astype(like.dtype)


def opmath(tensors: tuple) -> tuple:
    """Momentum's tensors of a half-precision type (a module trained as `.to(torch.bfloat16)`) widened to float32,
    as torch.optim.SGD's kernels compute a half-precision update (their opmath type) before rounding it to the
    tensor's type (cast_like). Computed in the tensor's own type, alpha, which scales the velocity every step, was
    rounded to it first (JAX's weak types): 0.9 is 0.8984375 in bfloat16, a momentum that decayed 1.6% more per
    step, and 100 steps trained 30% farther from a float64 run than PyTorch's (now 1-4% nearer). Adagrad keeps
    its tensors' type: torch sums its squares and adds epsilon in that type too (in float16 both underflow alike)."""
    return tuple(t.astype(jnp.float32) if jnp.dtype(t.dtype) in HALF_FLOAT_DTYPES else t for t in tensors)


@op("Adagrad", 1, domain=TRAINING_DOMAIN)
def adagrad(r, t, *tensors, decay_factor: float, epsilon: float, norm_coefficient: float, ctx: NodeContext):
    lr = r / (1 + t * decay_factor)
    new_x, new_h = [], []
    for x, g, h in split_groups(ctx, tensors, 3):
        g_reg = norm_coefficient * x + g
        h2 = h + g_reg * g_reg
        new_x.append(cast_like(x - lr * g_reg / (jnp.sqrt(h2) + epsilon), x))
        new_h.append(cast_like(h2, h))
    return tuple(new_x + new_h)


@op("Momentum", 1, domain=TRAINING_DOMAIN)
def momentum(r, t, *tensors, alpha: float, beta: float, mode: str, norm_coefficient: float, ctx: NodeContext):
    if mode not in ("standard", "nesterov"):
        raise NodeError(f"{ctx.node.label}: mode must be 'standard' or 'nesterov', got {mode!r}")
    beta_adjusted = jnp.where(t > 0, beta, 1.0)
    new_x, new_v = [], []
    for x0, g, v0 in split_groups(ctx, tensors, 3):
        x, g, v = opmath((x0, g, v0))
        g_reg = norm_coefficient * x + g
        v2 = alpha * v + beta_adjusted * g_reg
        step = g_reg + alpha * v2 if mode == "nesterov" else v2
        new_x.append(cast_like(x - r * step, x0))
        new_v.append(cast_like(v2, v0))
    return tuple(new_x + new_v)


@op("Adam", 1, domain=TRAINING_DOMAIN)
def adam(
    r, t, *tensors, alpha: float, beta: float, epsilon: float, norm_coefficient: float,
    norm_coefficient_post: float, ctx: NodeContext,
):
    t_float = jnp.asarray(t).astype(jnp.asarray(r).dtype)
    corrected = r * jnp.sqrt(1 - beta**t_float) / (1 - alpha**t_float)
    lr = jnp.where(t > 0, corrected, r)
    new_x, new_v, new_h = [], [], []
    for x, g, v, h in split_groups(ctx, tensors, 4):
        g_reg = norm_coefficient * x + g
        v2 = alpha * v + (1 - alpha) * g_reg
        h2 = beta * h + (1 - beta) * g_reg * g_reg
        x2 = (1 - norm_coefficient_post) * (x - lr * v2 / (jnp.sqrt(h2) + epsilon))
        new_x.append(cast_like(x2, x))
        new_v.append(cast_like(v2, v))
        new_h.append(cast_like(h2, h))
    return tuple(new_x + new_v + new_h)
