"""Checking what the user feeds against the graph's declared inputs, before anything is traced."""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np

from .dtypes import np_dtype, type_name, onnx_type
from .errors import FeedError
from .ir import ValueInfo


def to_array(name: str, value: Any, sequence: bool = False) -> Any:
    """A feed as a NumPy or jax array (jax arrays pass through without a copy); a `sequence` input's list stays a
    list of them, any other list is one array (nested lists, as a user writes a small tensor)."""
    if isinstance(value, (jax.Array, np.ndarray)) or value is None:
        return value
    if sequence and isinstance(value, list):  # an ONNX sequence (possibly empty): a list of tensors
        return [to_array(name, v) for v in value]
    try:
        return np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise FeedError(f"feed {name!r}: cannot convert {type(value).__name__} to an array ({exc})") from exc


def check_feeds(
    feeds: Mapping[str, Any], required: list[ValueInfo], optional: list[ValueInfo], rows_required: bool = False
) -> dict[str, Any]:
    """Validate names, dtypes, ranks, fixed dims and dim_param consistency; return the converted feeds.

    `rows_required` (a train step): a batch of zero rows is refused, as its mean loss is NaN and the step
    would still advance the optimizer's state."""
    declared = {v.name: v for v in required + optional}
    unknown = sorted(set(feeds) - set(declared))
    if unknown:
        raise FeedError(f"unknown feed name(s) {unknown}; the model's inputs are {sorted(declared)}")
    missing = [v.name for v in required if v.name not in feeds]
    if missing:
        raise FeedError(f"missing feed(s) {missing}; the model requires {[v.name for v in required]}")
    converted = {name: to_array(name, value, holds_sequence(declared[name])) for name, value in feeds.items()}
    symbols: dict[str, tuple[int, str]] = {}
    for name, value in converted.items():
        check_one(declared[name], value, symbols)
        if rows_required and empty_batch(declared[name], value):
            raise FeedError(f"feed {name!r} has no rows (shape {tuple(value.shape)}): a train step needs at least one")
    return converted


def holds_sequence(info: ValueInfo) -> bool:
    """Whether the input is an ONNX sequence, or an optional one."""
    kind = info.type_proto.WhichOneof("value")
    if kind == "optional_type":
        kind = info.type_proto.optional_type.elem_type.WhichOneof("value")
    return kind == "sequence_type"


def empty_batch(info: ValueInfo, value: Any) -> bool:
    """A tensor with zero rows, where the graph does not declare its first dimension to be 0."""
    rows = getattr(value, "shape", ())[:1]
    return rows == (0,) and not (info.shape and info.shape[0] == 0)


class FeedChecker:
    """check_feeds for one graph's inputs, remembering the signatures (names, dtypes, shapes of arrays) it has
    passed: a training loop feeds one signature every step, and checking it again cost more than the launch."""

    def __init__(self, required: list[ValueInfo], optional: list[ValueInfo], rows_required: bool = False):
        self.required, self.optional, self.rows_required = required, optional, rows_required
        self.passed: set[tuple] = set()

    def __call__(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        signature = array_signature(feeds)
        if signature is not None and signature in self.passed:
            return dict(feeds)
        checked = check_feeds(feeds, self.required, self.optional, self.rows_required)
        if signature is not None:
            self.passed.add(signature)
        return checked


def array_signature(feeds: Mapping[str, Any]) -> tuple | None:
    """What check_feeds' verdict depends on, when every feed is already an array (None otherwise)."""
    signature = []
    for name, value in feeds.items():
        if not isinstance(value, (jax.Array, np.ndarray)):
            return None
        signature.append((name, value.dtype, value.shape))
    return tuple(signature)


def check_one(info: ValueInfo, value: Any, symbols: dict[str, tuple[int, str]]) -> None:
    if value is None and info.type_proto.WhichOneof("value") not in (None, "optional_type"):
        raise FeedError(f"feed {info.name!r} is None, which only an optional-typed input takes (an empty optional); "
                        f"{info.name!r} is not one: feed a value, or leave the feed out where the graph gives it "
                        f"an initializer")
    if not info.elem_type or value is None or isinstance(value, list):
        return
    expected = np_dtype(info.elem_type)
    given = np.dtype(value.dtype)
    if given != expected and not (expected == object and given.kind in "OUS"):
        raise FeedError(
            f"feed {info.name!r}: expected dtype {type_name(info.elem_type)}, "
            f"got {type_name(onnx_type(given)) if given.kind not in 'OUSV' else given}"
        )
    if info.shape is None:
        return
    shape = tuple(value.shape)
    if len(shape) != len(info.shape):
        raise FeedError(
            f"feed {info.name!r}: expected rank {len(info.shape)} (shape {format_shape(info.shape)}), "
            f"got rank {len(shape)} (shape {shape})"
        )
    for axis, (want, got) in enumerate(zip(info.shape, shape)):
        if isinstance(want, int) and want != got:
            raise FeedError(
                f"feed {info.name!r}: dimension {axis} must be {want} (shape {format_shape(info.shape)}), got {got}"
            )
        if isinstance(want, str):
            seen = symbols.setdefault(want, (got, f"{info.name!r} dimension {axis}"))
            if seen[0] != got:
                raise FeedError(
                    f"feed {info.name!r}: dimension {axis} ({want!r}) is {got}, "
                    f"but {seen[1]} gave {want!r} = {seen[0]}"
                )


def format_shape(shape: tuple) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"
