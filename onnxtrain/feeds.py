"""Checking what the user feeds against the graph's declared inputs, before anything is traced."""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import onnx

from .dtypes import np_dtype, type_name, onnx_type
from .errors import FeedError
from .ir import ValueInfo
from .lower.build import value_info
from .lower.typecheck import Sizes, bind_dim_param


# Python numbers are weakly typed (NumPy's NEP 50, JAX's weak types): a number, or nested lists of them, fed for a
# tensor takes the declared element type, as `0.01` does beside a float32 array in NumPy, where its default
# (float64, int64) would be refused. Within its kind only: a float never becomes an integer.
WEAK_KINDS = {bool: "b", int: "i", float: "f", complex: "c"}
WIDER_KINDS = {"": "bifc", "b": "b", "i": "ifc", "f": "fc", "c": "c"}  # "": an empty list, no value to lose


def to_array(name: str, value: Any, info: ValueInfo) -> Any:
    """A tensor feed as a NumPy or jax array (jax arrays pass through without a copy): nested lists are one array,
    as a user writes a small tensor, and Python numbers take the declared element type (WEAK_KINDS)."""
    if isinstance(value, jax.core.Tracer):  # else JAX's TypeError from the compiled program it reaches
        raise FeedError(f"feed {name!r} is a value JAX is tracing (infer or train_step called inside jax.jit, grad or "
                        "vmap): they run compiled programs of their own; Engine.jax_function() gives the model as a "
                        "function JAX can transform")
    if isinstance(value, (jax.Array, np.ndarray)):
        return value
    try:
        array = np.asarray(value)
    except Exception as exc:  # the object's own __array__ raises what it likes (torch: RuntimeError)
        try:  # a type NumPy lacks (torch's bfloat16): JAX reads it through DLPack, then copies it, waiting for
            # the copy: the tensor's memory stays the caller's, and a loop that refills one buffer would change a
            # step's input while it runs (from_dlpack(copy=True) still shared it on the CPU, jax 0.10)
            return jnp.array(jax.dlpack.from_dlpack(value), copy=True).block_until_ready()
        except Exception:  # (no __dlpack__, or it refuses too: the first reason is the one to show)
            pass
        raise FeedError(f"feed {name!r}: cannot convert {type(value).__name__} to an array ({exc})") from exc
    kind = weak_kind(value)
    if kind is None or not info.elem_type:
        return array
    target = np_dtype(info.elem_type)
    target_kind = number_kind(target)  # None for a string input
    if target_kind is None or target_kind not in WIDER_KINDS[kind]:
        return array  # refused by the type check, naming both types
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused below, by value
        converted = array.astype(target)
    lost = (converted.astype(array.dtype) != array) if kind in "bi" and target_kind == "i" else (
        np.isfinite(array) & ~np.isfinite(converted))
    if np.any(lost):
        raise FeedError(f"feed {name!r}: {array[lost].ravel()[0].item()!r} is out of the range of its declared type "
                        f"{type_name(info.elem_type)}")
    return converted


def weak_kind(value: Any) -> str | None:
    """The kind (WEAK_KINDS) of a Python number or of nested lists and tuples of Python numbers (the widest one
    among them; "" for empty ones), else None: NumPy values keep their own type."""
    if type(value) in WEAK_KINDS:
        return WEAK_KINDS[type(value)]
    if not isinstance(value, (list, tuple)):
        return None
    kinds = [weak_kind(v) for v in value]
    if None in kinds:
        return None
    return max(kinds, key=list(WIDER_KINDS).index, default="")


def number_kind(dtype: np.dtype) -> str | None:
    """'b', 'i' (signed or not), 'f' or 'c' for a numeric dtype, ml_dtypes' narrow floats and integers included."""
    if dtype.kind in "biufc":
        return "i" if dtype.kind == "u" else dtype.kind
    for kind, info in (("i", ml_dtypes.iinfo), ("f", ml_dtypes.finfo)):
        try:
            info(dtype)
            return kind
        except ValueError:
            continue
    return None


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
    symbols: Sizes = {}
    converted = {}
    for name, value in feeds.items():
        converted[name] = checked(name, value, declared[name], symbols)
        if rows_required and empty_batch(declared[name], converted[name]):
            raise FeedError(f"feed {name!r} has no rows (shape {tuple(converted[name].shape)}): a train step needs at "
                            f"least one")
    return converted


def checked(name: str, value: Any, info: ValueInfo, symbols: Sizes) -> Any:
    """`value` converted and checked against the type of `info`: a tensor by `check_one`; a sequence as a list,
    each element against the element type (its named dimensions its own: elements may differ in shape); an
    optional as None (empty) or as its element type; a map by `checked_map`."""
    kind = info.type_proto.WhichOneof("value")
    if kind == "map_type":
        return checked_map(name, value, info)
    if kind == "optional_type":
        return None if value is None else checked(name, value, contained(info, "optional_type"), symbols)
    if value is None and kind is not None:
        raise FeedError(f"feed {name!r} is None, which only an optional-typed input takes (an empty optional); "
                        f"{info.name!r} is not one: feed a value, or leave the feed out where the graph gives it "
                        f"an initializer")
    if kind == "sequence_type":
        if not isinstance(value, list):
            raise FeedError(f"feed {name!r} is a sequence input: feed a list of tensors, not {type(value).__name__}")
        element = contained(info, "sequence_type")
        return [checked(f"{name}[{i}]", v, element, {}) for i, v in enumerate(value)]
    if value is None:
        return None
    array = to_array(name, value, info)
    check_one(name, info, array, symbols)
    return array


def checked_map(name: str, value: Any, info: ValueInfo) -> np.ndarray:
    """A map feed: a dict whose keys are of the declared key type (str for string keys; ints within an integer
    type's range) and whose values are checked as `checked` checks a feed of the value type (a Python number
    takes the declared type). Returned as a 0-d object array holding the converted dict, which the map ops
    (DictVectorizer, CastMap) read on the host; a scalar value becomes a NumPy scalar of its type."""
    if not isinstance(value, Mapping):
        raise FeedError(f"feed {name!r} is a map input: feed a dict {{key: value}}, not {type(value).__name__}")
    map_type = info.type_proto.map_type
    key_dtype = np_dtype(map_type.key_type)
    element = value_info(onnx.helper.make_value_info(info.name, map_type.value_type))
    converted = {}
    for key, item in value.items():
        if key_dtype == object and not isinstance(key, str) or key_dtype != object and not (
                isinstance(key, (int, np.integer)) and not isinstance(key, bool)
                and np.iinfo(key_dtype).min <= key <= np.iinfo(key_dtype).max):
            raise FeedError(f"feed {name!r}: key {key!r} is not of the map's key type "
                            f"{type_name(map_type.key_type)}")
        item = checked(f"{name}[{key!r}]", item, element, {})
        converted[key if key_dtype == object else int(key)] = (
            item[()] if isinstance(item, np.ndarray) and item.ndim == 0 else item)
    holder = np.empty((), dtype=object)
    holder[()] = converted
    return holder


def contained(info: ValueInfo, kind: str) -> ValueInfo:
    """The ValueInfo of what a sequence or optional `info` holds."""
    return value_info(onnx.helper.make_value_info(info.name, getattr(info.type_proto, kind).elem_type))


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
        return self.checked(feeds)[0]

    def checked(self, feeds: Mapping[str, Any]) -> tuple[dict[str, Any], tuple | None]:
        """The checked feeds and their array signature (None unless every feed is an array)."""
        if type(feeds) is not dict and not isinstance(feeds, Mapping):  # (the ABC's check costs a microsecond)
            raise FeedError(f"feeds are a mapping {{input name: value}}, not {type(feeds).__name__}")
        signature = array_signature(feeds)
        if signature is not None and signature in self.passed:
            return dict(feeds), signature
        checked = check_feeds(feeds, self.required, self.optional, self.rows_required)
        if signature is not None:
            self.passed.add(signature)
        return checked, signature


# the classes seen to be concrete arrays: isinstance against jax.Array's ABC, asked for every feed of every step,
# was a microsecond apiece, and a small model's step on a GPU is paced by such host time (benchmarks/README.md)
ARRAY_CLASSES: set[type] = set()


def is_concrete_array(value: Any) -> bool:
    """A jax or NumPy array, not a tracer."""
    if type(value) in ARRAY_CLASSES:
        return True
    if isinstance(value, (jax.Array, np.ndarray)) and not isinstance(value, jax.core.Tracer):
        ARRAY_CLASSES.add(type(value))
        return True
    return False


def array_signature(feeds: Mapping[str, Any]) -> tuple | None:
    """What check_feeds' verdict depends on, when every feed is already an array (None otherwise)."""
    signature = []
    for name, value in feeds.items():
        if not is_concrete_array(value):
            return None
        signature.append((name, value.dtype, value.shape))
    return tuple(signature)


def check_one(name: str, info: ValueInfo, value: Any, symbols: Sizes) -> None:
    """A tensor feed (`name`: the feed, or a sequence's element) against the tensor type of `info`."""
    if not info.elem_type:
        return
    expected = np_dtype(info.elem_type)
    given = np.dtype(value.dtype)
    if given != expected and not (expected == object and given.kind in "OUS"):
        raise FeedError(
            f"feed {name!r}: expected dtype {type_name(info.elem_type)}, "
            f"got {type_name(onnx_type(given)) if given.kind not in 'OUSV' else given}"
        )
    if info.shape is None:
        return
    shape = tuple(value.shape)
    if len(shape) != len(info.shape):
        raise FeedError(
            f"feed {name!r}: expected rank {len(info.shape)} (shape {format_shape(info.shape)}), "
            f"got rank {len(shape)} (shape {shape})"
        )
    for axis, (want, got) in enumerate(zip(info.shape, shape)):
        if isinstance(want, int) and want != got:
            raise FeedError(
                f"feed {name!r}: dimension {axis} must be {want} (shape {format_shape(info.shape)}), got {got}: "
                f"the model fixes that size (an export keeps its example's sizes unless told which vary: "
                f"torch.onnx.export's and from_torch's dynamic_shapes=, dynamic_axes= with dynamo=False)"
            )
        if isinstance(want, str) and (conflict := bind_dim_param(symbols, want, got, repr(name), axis)):
            raise FeedError(f"feed {name!r}: {conflict}")


def format_shape(shape: tuple) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"
