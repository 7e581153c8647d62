"""Operator registration and opset dispatch.

An implementation is a plain function: positional arguments are the node's inputs (None for an absent
optional input), keyword arguments are the ONNX attributes, with defaults filled in from the schema before the
call. A function that declares a keyword-only parameter `ctx` also receives the NodeContext (node, rng, scope).
It is registered against every `since_version` it implements; a node binds to the schema whose since_version
is the highest one not above the model's opset for the node's domain.

One mechanism, `op`; two table-entry forms build on it: `register(name, fn, since=, until=)` registers a function
for a range of an op's schema history and adapts legacy attributes, and ops/ml.py's `ml_op` does the same
for the ai.onnx.ml domain.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import Any, Callable

import jax.numpy as jnp
import onnx.defs

from .layout import ELEMENTWISE
from .values import Array

TRAINING_DOMAIN = "ai.onnx.preview.training"
ML_DOMAIN = "ai.onnx.ml"


@dataclass(frozen=True)
class OpImpl:
    fn: Callable
    wants_ctx: bool
    layout: str = ""  # layout.ELEMENTWISE or layout.CHANNELS_LAST: the op takes channels-last activations
    module: str = ""  # the op module that registered it, where a reader finds it (docs/ops.md names it)


_REGISTRY: dict[tuple[str, str, int], OpImpl] = {}


def canonical_domain(domain: str) -> str:
    return "" if domain in ("", "ai.onnx") else domain


def op(op_type: str, *since_versions: int, domain: str = "", layout: str = "") -> Callable[[Callable], Callable]:
    """Register `fn` as the lowering of `domain::op_type` for each listed since_version (`layout`: see
    lower/layout.py)."""

    def register(fn: Callable) -> Callable:
        wants_ctx = "ctx" in inspect.signature(fn).parameters
        for version in since_versions:
            key = (canonical_domain(domain), op_type, version)
            if key in _REGISTRY:
                raise RuntimeError(f"{key} registered twice ({_REGISTRY[key].fn.__name__} and {fn.__name__})")
            _REGISTRY[key] = OpImpl(fn, wants_ctx, layout, _registering_module())
        return fn

    return register


def _registering_module() -> str:
    """The module whose code registers: the op module, also through the table-entry form below (a table entry's
    function may be a library one, jnp.abs, so its own __module__ would not say where the entry is)."""
    frame = sys._getframe(1)
    while frame.f_globals.get("__name__") == __name__:
        frame = frame.f_back
    return frame.f_globals["__name__"]


def schema_for(domain: str, op_type: str, opset: int) -> onnx.defs.OpSchema | None:
    try:
        return onnx.defs.get_schema(op_type, opset, canonical_domain(domain))
    except onnx.defs.SchemaError:
        return None


def lookup(domain: str, op_type: str, since_version: int) -> OpImpl | None:
    return _REGISTRY.get((canonical_domain(domain), op_type, since_version))


def registered() -> set[tuple[str, str, int]]:
    return set(_REGISTRY)


def _history() -> dict[tuple[str, str], list[int]]:
    if not _HISTORY:
        for schema in onnx.defs.get_all_schemas_with_history():
            _HISTORY.setdefault((canonical_domain(schema.domain), schema.name), []).append(schema.since_version)
        for versions in _HISTORY.values():
            versions.sort()
    return _HISTORY


_HISTORY: dict[tuple[str, str], list[int]] = {}


def versions(op_type: str, since: int = 1, until: int | None = None, domain: str = "") -> tuple[int, ...]:
    """The since_versions in `op_type`'s schema history within [since, until]: for ops whose semantics did
    not change across those versions (only their type lists grew), one implementation serves them all."""
    history = _history().get((canonical_domain(domain), op_type))
    if not history:
        raise RuntimeError(f"no schema history for {domain or 'ai.onnx'}::{op_type}")
    return tuple(v for v in history if v >= since and (until is None or v <= until))


def register(
    name: str, fn: Callable, *, since: int = 1, until: int | None = None, binary: bool = False,
    elementwise: bool = False,
) -> None:
    """Register `fn` for every since_version of `name` in [since, until]. Versions whose schema still has
    legacy attributes get adapters (a table entry: many ops,
    one mechanism), so `fn` only ever sees the attributes of today's schema: `consumed_inputs`
    is dropped, and for a `binary` elementwise op, `broadcast`/`axis` reshape B before the call.

    `elementwise`: each output element depends only on the input elements at its (broadcast) position, so the
    op runs on channels-last activations as they are (lower/layout.py); not the axis-aligned legacy versions."""
    for version in versions(name, since=since, until=until):
        attributes = onnx.defs.get_schema(name, version).attributes
        legacy_broadcast = "broadcast" in attributes
        impl = _with_legacy_broadcast(fn) if binary and legacy_broadcast else fn
        if "consumed_inputs" in attributes:
            impl = _dropping_consumed_inputs(impl)
        op(name, version, layout=ELEMENTWISE if elementwise and not legacy_broadcast else "")(impl)


def _dropping_consumed_inputs(fn: Callable) -> Callable:
    def impl(*inputs: Array, consumed_inputs: list[int] | None = None, **attributes: Any) -> Array:
        return fn(*inputs, **attributes)

    impl.__name__ = fn.__name__
    return impl


def _with_legacy_broadcast(fn: Callable) -> Callable:
    """Binary ops before opset 7: with `broadcast=1` and `axis`, B's dims match A's dims from `axis` on;
    without `axis` the match is at the suffix, which NumPy broadcasting already does."""

    def impl(a: Array, b: Array, *, broadcast: int = 0, axis: int | None = None) -> Array:
        if broadcast and axis is not None and jnp.ndim(b) > 0:
            start = axis % jnp.ndim(a)
            trailing = jnp.ndim(a) - start - jnp.ndim(b)
            if trailing < 0:
                raise ValueError(f"B of shape {jnp.shape(b)} does not fit in A of shape {jnp.shape(a)} at axis {axis}")
            b = jnp.reshape(b, jnp.shape(b) + (1,) * trailing)
        return fn(a, b)

    impl.__name__ = fn.__name__
    return impl
