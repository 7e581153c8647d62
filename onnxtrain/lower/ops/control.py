"""Control flow: If, Loop and Scan, lowered to lax.cond / lax.scan / lax.while_loop.

Each op picks the cheapest faithful lowering. When everything that decides the control flow is static, the
subgraph runs in Python (one branch inline, or the loop unrolled) so static values stay static and keep folding
downstream. Otherwise the body is traced once into a structured lax primitive. A body that a lax primitive
cannot hold (its carried values change shape, or one of its nodes needs a static value the primitive would make
traced) falls back to unrolling, which needs the trip count at compile time. Unrolling stops at UNROLL_LIMIT
iterations (tracing a million-step loop in Python takes minutes): a longer loop is a lax loop or an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ...errors import NodeError, StaticValueRequired
from ...ir import Graph
from ..walker import NodeContext, Subgraph
from ..registry import op, versions
from ..values import Value, folded, is_static, is_text, needs_static, signature, static_ints


UNROLL_LIMIT = 1024  # iterations run in Python at most: a longer static loop becomes a lax loop, or is refused


class Unstructured(Exception):
    """The body cannot be traced into a lax primitive (carried values change type, a condition varies...)."""


def truth(value: Value) -> bool:
    return bool(np.asarray(value).reshape(-1)[0])


def describe(value: Value) -> str:
    if value is None:
        return "an empty optional"
    if isinstance(value, list):
        return f"a sequence of {len(value)} ({', '.join(describe(v) for v in value)})"
    return f"{np.dtype(value.dtype).name}{list(np.shape(value))}"


def outer_names(graph: Any) -> set[str]:
    """The names `graph` (nested subgraphs included) reads from its enclosing scopes."""
    defined = {i.name for i in graph.inputs} | set(graph.initializers)
    used: set[str] = set()
    for node in graph.nodes:
        used.update(name for name in node.inputs if name)
        for value in node.attributes.values():
            for sub in value if isinstance(value, list) else [value]:
                if isinstance(sub, Graph):
                    used |= outer_names(sub)
        defined.update(node.outputs)
    return used - defined


def reads_only_static(body: Subgraph) -> bool:
    return all(is_static(body.scope[name]) for name in outer_names(body.graph) if name in body.scope)


def lax_scan(step: Callable, carry: list, xs: Any, length: int) -> tuple[list, list]:
    """lax.scan whose step raises Unstructured (not a JAX type error) when the carry changes type."""
    expected = signature(carry)

    def checked(c: list, x: Any) -> tuple[list, list]:
        new, ys = step(c, x)
        if signature(new) != expected:
            raise Unstructured("carried values change shape or type between iterations")
        if any(v is None or isinstance(v, list) or is_text(v) for v in ys):
            raise Unstructured("a scan output element is not a numeric tensor")
        return list(new), list(ys)

    return lax.scan(checked, list(carry), xs, length=length)


def unrolled_scan(step: Callable, carry: list, xs: Sequence[Value], length: int) -> tuple[list, list]:
    """The scan run in Python, one step per element: static elements stay static."""
    per_step = []
    for t in range(length):
        carry, ys = step(carry, [x[t] for x in xs])
        per_step.append(ys)
    return list(carry), [folded(lambda *v: jnp.stack(v), *column) for column in zip(*per_step)]


# ---------------------------------------------------------------------------------------------------- If


@op("If", *versions("If"))
def if_(cond: Value, *, then_branch: Subgraph, else_branch: Subgraph, ctx: NodeContext) -> tuple:
    if is_static(cond):
        return tuple((then_branch if truth(cond) else else_branch)())
    seen: dict[str, list] = {}

    def traced(branch: Subgraph, name: str) -> Callable[[], list]:
        def run() -> list:
            outputs = branch()
            seen[name] = outputs
            if any(is_text(v) for v in outputs):
                raise Unstructured("a branch produces strings")
            return outputs

        return run

    try:
        return tuple(lax.cond(jnp.reshape(cond, ()), traced(then_branch, "then"), traced(else_branch, "else")))
    except (TypeError, Unstructured) as exc:
        raise needs_static(ctx, 0, "cond", "under lax.cond " + branch_mismatch(seen, exc)) from None


def branch_mismatch(seen: dict[str, list], exc: Exception) -> str:
    if len(seen) < 2:
        return str(exc)
    then, other = seen["then"], seen["else"]
    for k, (a, b) in enumerate(zip(then, other)):
        if signature(a) != signature(b):
            return f"output {k} is {describe(a)} in then_branch but {describe(b)} in else_branch"
    return str(exc)


# -------------------------------------------------------------------------------------------------- Loop


class CondVaries(Exception):
    """Inside lax.scan, the body's condition is not statically true: the trip count is not M."""


@dataclass
class LoopRun:
    """One Loop node: M and cond as given (None when absent), the body, and how its outputs split."""

    body: Subgraph
    M: Value
    cond: Value
    n_carried: int
    n_scan: int
    ctx: NodeContext

    def split(self, outputs: list) -> tuple[Value, list, list]:
        n = self.n_carried
        return outputs[0], list(outputs[1 : 1 + n]), list(outputs[1 + n :])

    def unrolled(self, carried: list) -> tuple:
        reason = "the loop is unrolled (its body cannot run inside lax.scan / lax.while_loop)"
        limit = None if self.M is None else int(np.asarray(self.static_input(0, "M", reason)).reshape(-1)[0])
        cond = np.array(True) if self.cond is None else self.static_input(1, "cond", reason)
        too_long = Unstructured(f"its body cannot run inside lax.scan / lax.while_loop, and it runs more than the "
                                f"{UNROLL_LIMIT} iterations it may unroll")
        if self.cond is None and limit > UNROLL_LIMIT:
            raise too_long
        i, per_step = 0, []
        while truth(cond) and (limit is None or i < limit):
            if i == UNROLL_LIMIT:  # a condition that has not ended the loop yet
                raise too_long
            new_cond, carried, ys = self.split(self.body(np.array(i, np.int64), cond, *carried, iteration=i))
            per_step.append(ys)
            i += 1
            if self.cond is None:
                continue
            if not is_static(new_cond):
                if self.n_scan:
                    raise needs_static(
                        self.ctx, 1, "cond", "the body's condition depends on run-time data, so would the "
                        "length of the scan outputs"
                    )
                return self.while_loop(carried, i, new_cond)
            cond = new_cond
        if not per_step:
            return (*carried, *self.empty_scan_outputs(carried, cond))
        return (*carried, *[folded(lambda *v: jnp.stack(v), *column) for column in zip(*per_step)])

    def static_input(self, index: int, what: str, reason: str) -> np.ndarray:
        value = self.M if index == 0 else self.cond
        if not is_static(value):
            raise needs_static(self.ctx, index, what, reason)
        return np.asarray(value)

    def empty_scan_outputs(self, carried: list, cond: Value) -> list[np.ndarray]:
        """Zero iterations still give scan outputs their element shape: found by tracing the body abstractly."""
        if not self.n_scan:
            return []
        shapes = jax.eval_shape(lambda: self.split(self.body(np.array(0, np.int64), cond, *carried))[2])
        return [np.zeros((0, *s.shape), s.dtype) for s in shapes]

    def structured(self, carried: list) -> tuple:
        if self.M is not None and is_static(self.M, self.cond):
            trip = int(np.asarray(self.M).reshape(-1)[0])
            if self.cond is not None and not truth(self.cond):
                trip = 0
            try:
                return self.scanned(carried, max(trip, 0))
            except CondVaries:
                if self.n_scan:
                    raise Unstructured("the body's condition varies, so the scan outputs' length does") from None
        if self.n_scan:
            raise Unstructured("scan outputs need a trip count known at compile time")
        return self.while_loop(carried, 0, self.cond)

    def scanned(self, carried: list, trip: int) -> tuple:
        """A static trip count M and a condition that stays true: lax.scan, which reverse-mode AD supports."""
        cond_in = np.array(True)

        def step(carry: list, _: None) -> tuple[list, list]:
            i, *carry = carry
            new_cond, carry, ys = self.split(self.body(i, cond_in, *carry, iteration=i))
            if self.cond is not None and not (is_static(new_cond) and truth(new_cond)):
                raise CondVaries()
            return [i + 1, *carry], ys

        # the iteration number is carried, not scanned over: a TorchScript `while` exports M = 2**63 - 1, whose
        # arange XLA cannot even allocate before the body shows that its condition varies
        (_, *final), ys = lax_scan(step, [jnp.asarray(0, jnp.int64), *carried], None, trip)
        return (*final, *ys)

    def while_loop(self, carried: list, start: int, cond: Value) -> tuple:
        if self.M is None and self.cond is None:
            raise NodeError(f"{self.ctx.node.label}: a Loop with neither M nor cond never terminates")
        limit = None if self.M is None else jnp.reshape(self.M, ())
        cond0 = jnp.asarray(True) if cond is None else jnp.asarray(cond)
        expected = signature(carried)

        def going(state: tuple) -> jax.Array:
            i, c, _ = state
            go = jnp.asarray(True) if limit is None else i < limit
            return go & jnp.reshape(c, ()) if self.cond is not None else go

        def step(state: tuple) -> tuple:
            i, c, v = state
            new_cond, v, _ = self.split(self.body(i, c, *v, iteration=i))
            if signature(v) != expected:
                raise Unstructured("carried values change shape or type between iterations")
            c = jnp.reshape(new_cond, c.shape).astype(c.dtype) if self.cond is not None else c
            return i + 1, c, v

        _, _, final = reversible_while_loop(going, step, (jnp.asarray(start, jnp.int64), cond0, list(carried)))
        return tuple(final)


def zero_cotangent(x: Any) -> Any:
    """The zero cotangent of `x`: zeros of its dtype, or JAX's float0 for integers and bools."""
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(np.shape(x), jax.dtypes.float0)


def reversible_while_loop(going: Callable, step: Callable, init: Any) -> Any:
    """`lax.while_loop(going, step, init)` that reverse-mode AD can differentiate, whatever decides the trip
    count (a run-time M, a data-dependent condition).

    The forward pass is the plain while loop and also counts its iterations n. The backward pass keeps no
    per-iteration values (their number is unknown when tracing, so no buffer can hold them): for k = n-1 .. 0 it
    recomputes the state before iteration k from `init` and pulls the cotangent back through that iteration.
    That costs n (n + 1) / 2 body evaluations, against n for a scan; a loop whose trip count is known at compile
    time is a lax.scan instead (LoopRun.scanned) and pays n."""
    step_fn, step_consts = jax.closure_convert(step, init)  # the values being differentiated become arguments
    going_fn, going_consts = jax.closure_convert(going, init)

    def counted(step_consts: list, going_consts: list, init: Any) -> tuple[jax.Array, Any]:
        return lax.while_loop(
            lambda nc: going_fn(nc[1], *going_consts),
            lambda nc: (nc[0] + 1, step_fn(nc[1], *step_consts)),
            (jnp.asarray(0, jnp.int64), init),
        )

    @jax.custom_vjp
    def run(step_consts: list, going_consts: list, init: Any) -> Any:
        return counted(step_consts, going_consts, init)[1]

    def forward(step_consts: list, going_consts: list, init: Any) -> tuple[Any, tuple]:
        n, final = counted(step_consts, going_consts, init)
        return final, (step_consts, going_consts, init, n)

    def backward(residuals: tuple, cotangent: Any) -> tuple:
        step_consts, going_consts, init, n = residuals
        leaves, treedef = jax.tree_util.tree_flatten(init)
        inexact = [jnp.issubdtype(x.dtype, jnp.inexact) for x in leaves]
        floats = lambda tree: [x for x, f in zip(jax.tree_util.tree_leaves(tree), inexact) if f]  # noqa: E731

        def pull_back(j: jax.Array, acc: tuple) -> tuple:
            d_state, d_consts = acc
            before = lax.fori_loop(0, n - 1 - j, lambda _, s: step_fn(s, *step_consts), init)
            others = jax.tree_util.tree_leaves(before)

            def float_step(float_leaves: list, consts: list) -> list:
                it = iter(float_leaves)
                merged = [next(it) if f else x for x, f in zip(others, inexact)]
                return floats(step_fn(jax.tree_util.tree_unflatten(treedef, merged), *consts))

            _, vjp = jax.vjp(float_step, floats(before), list(step_consts))
            d_before, d_step = vjp(d_state)
            return d_before, jax.tree_util.tree_map(jnp.add, d_consts, d_step)

        zeros = [jnp.zeros_like(c) for c in step_consts]
        d_init, d_consts = lax.fori_loop(0, n, pull_back, (floats(cotangent), zeros))
        it = iter(d_init)
        d_init = [next(it) if f else zero_cotangent(x) for x, f in zip(leaves, inexact)]
        return d_consts, [zero_cotangent(c) for c in going_consts], jax.tree_util.tree_unflatten(treedef, d_init)

    run.defvjp(forward, backward)
    return run(step_consts, going_consts, init)


@op("Loop", *versions("Loop"))
def loop(M: Value = None, cond: Value = None, *initial: Value, body: Subgraph, ctx: NodeContext) -> tuple:
    n_carried = len(initial)
    run = LoopRun(body, M, cond, n_carried, len(body.output_names) - 1 - n_carried, ctx)
    if M is None and cond is None:
        raise NodeError(f"{ctx.node.label}: a Loop with neither M nor cond never terminates")
    carried = list(initial)
    if is_static(M, cond, *initial) and reads_only_static(body):
        try:
            return run.unrolled(carried)
        except Unstructured:
            pass  # too long to unroll: a lax loop
    try:
        return run.structured(carried)
    except (Unstructured, StaticValueRequired):
        pass
    try:
        return run.unrolled(carried)
    except Unstructured as exc:
        raise NodeError(f"{ctx.node.label}: {exc}") from None


# -------------------------------------------------------------------------------------------------- Scan


def run_scan(body: Subgraph, states: list, xs: list, length: int, label: str) -> tuple[list, list]:
    """The body over `xs` (scan axis first, already in iteration order): lax.scan, else unrolled (static
    values stay static) up to UNROLL_LIMIT steps."""
    n_state = len(states)

    def step(carry: list, x: list) -> tuple[list, list]:
        index, *x = x
        outputs = body(*carry, *x, iteration=index)
        return outputs[:n_state], outputs[n_state:]

    xs = [np.arange(length, dtype=np.int64), *xs]

    if length == 0:
        return lax_scan(step, states, xs, 0)  # nothing to unroll: the trace alone gives the output shapes
    if length > UNROLL_LIMIT or not (is_static(*states, *xs) and reads_only_static(body)):
        try:
            return lax_scan(step, states, xs, length)
        except (Unstructured, StaticValueRequired) as exc:
            if length > UNROLL_LIMIT:
                raise NodeError(f"{label}: its body cannot run inside lax.scan ({exc}), and its {length} "
                                f"iterations are more than the {UNROLL_LIMIT} it may unroll") from None
    return unrolled_scan(step, states, xs, length)


def scan_major(x: Value, axis: int, reverse: bool) -> Value:
    """`x` with `axis` moved first and, when scanned backwards, flipped into iteration order."""
    return folded(lambda v: jnp.flip(jnp.moveaxis(v, axis, 0), 0) if reverse else jnp.moveaxis(v, axis, 0), x)


def output_major(y: Value, axis: int, reverse: bool) -> Value:
    """A stacked scan output (iterations first) placed on `axis`, prepended when built backwards."""
    return folded(lambda v: jnp.moveaxis(jnp.flip(v, 0) if reverse else v, 0, axis), y)


@op("Scan", *versions("Scan", since=9))
def scan(
    *inputs: Value,
    body: Subgraph,
    num_scan_inputs: int,
    scan_input_axes: list[int] | None = None,
    scan_input_directions: list[int] | None = None,
    scan_output_axes: list[int] | None = None,
    scan_output_directions: list[int] | None = None,
    ctx: NodeContext,
) -> tuple:
    n_state = len(inputs) - num_scan_inputs
    states, sequences = list(inputs[:n_state]), inputs[n_state:]
    in_axes = scan_input_axes or [0] * num_scan_inputs
    in_dirs = scan_input_directions or [0] * num_scan_inputs
    xs = [scan_major(x, axis, bool(d)) for x, axis, d in zip(sequences, in_axes, in_dirs)]
    lengths = {np.shape(x)[0] for x in xs}
    if len(lengths) > 1:
        raise NodeError(f"Scan: the scan inputs have different sequence lengths {sorted(lengths)}")
    final, ys = run_scan(body, states, xs, lengths.pop() if lengths else 0, ctx.node.label)
    out_axes = scan_output_axes or [0] * len(ys)
    out_dirs = scan_output_directions or [0] * len(ys)
    return (*final, *[output_major(y, axis, bool(d)) for y, axis, d in zip(ys, out_axes, out_dirs)])


@op("Scan", 8)
def scan_batched(
    sequence_lens: Value,
    *inputs: Value,
    body: Subgraph,
    num_scan_inputs: int,
    directions: list[int] | None = None,
    ctx: NodeContext,
) -> tuple:
    """Opset 8: axis 0 of every input is a batch, axis 1 of scan inputs the sequence; each batch entry scans
    its own `sequence_lens` steps, and scan outputs are zero-padded to the longest sequence."""
    n_state = len(inputs) - num_scan_inputs
    states, sequences = inputs[:n_state], inputs[n_state:]
    batch, steps = np.shape(sequences[0])[:2]
    lengths = [steps] * batch if sequence_lens is None else static_ints(sequence_lens, "sequence_lens")
    dirs = directions or [0] * num_scan_inputs
    finals, outputs = [], []
    for b, length in enumerate(lengths):
        xs = [scan_major(x[b, :length], 0, bool(d)) for x, d in zip(sequences, dirs)]
        final, ys = run_scan(body, [s[b] for s in states], xs, length, ctx.node.label)
        finals.append(final)
        outputs.append([folded(lambda v: jnp.pad(v, [(0, steps - length)] + [(0, 0)] * (v.ndim - 1)), y) for y in ys])
    stack = lambda *v: jnp.stack(v)  # noqa: E731
    return (
        *[folded(stack, *column) for column in zip(*finals)],
        *[folded(stack, *column) for column in zip(*outputs)],
    )
