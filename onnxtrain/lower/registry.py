"""Operator registration and opset dispatch.

An implementation is a plain function: positional arguments are the node's inputs (None for an absent
optional input), keyword arguments are the ONNX attributes, with defaults filled in from the schema before the
call. A function that declares a keyword-only parameter `ctx` also receives the NodeContext (node, rng, scope).
It is registered against every `since_version` it implements; a node binds to the schema whose since_version
is the highest one not above the model's opset for the node's domain.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import onnx.defs

TRAINING_DOMAIN = "ai.onnx.preview.training"
ML_DOMAIN = "ai.onnx.ml"


@dataclass(frozen=True)
class OpImpl:
    fn: Callable
    wants_ctx: bool
    layout: str = ""  # layout.ELEMENTWISE or layout.CHANNELS_LAST: the op takes channels-last activations


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
            _REGISTRY[key] = OpImpl(fn, wants_ctx, layout)
        return fn

    return register


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
