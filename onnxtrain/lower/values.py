"""The static/traced value rule (docs/architecture.md): NumPy arrays are known at trace time, jax arrays are not.

Implementations are written once, in jax.numpy. The graph walker runs a node whose inputs are all static under
`static_evaluation()` (eagerly, on the CPU) and turns its results back into NumPy, so shape arithmetic
(Shape -> Gather -> Concat -> Reshape) folds away at trace time and never reaches XLA. An input XLA needs at
compile time is read with `static(value, "input name")`, which raises a clear error when it is traced.
"""

from __future__ import annotations

import functools
import math
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import jax
import numpy as np

from ..errors import StaticValueRequired, ValueTooLargeError
from ..tensor_data import MAX_HOST_VALUE_BYTES

if TYPE_CHECKING:
    from .walker import NodeContext

Value = Any  # np.ndarray | jax.Array | list (an ONNX sequence) | None (absent optional)
Array = Any  # a jax array or a NumPy array (static value)


@functools.cache
def host_device() -> jax.Device | None:
    """JAX's CPU device, None in a process without JAX's CPU backend (JAX_PLATFORMS naming only accelerators)."""
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        return None


@contextmanager
def static_evaluation() -> Iterator[None]:
    """jax.numpy computes eagerly, inside a trace too, and on the CPU: each distinct small computation is a
    program compiled once per process, which takes milliseconds there and tens of them on a GPU, and its result
    goes to NumPy anyway."""
    with jax.ensure_compile_time_eval(), jax.default_device(host_device()):
        yield


def is_static(*values: Value) -> bool:
    """True when every non-missing tensor among `values` (sequences included) is known at trace time."""
    for v in values:
        if v is None:
            continue
        if isinstance(v, list):
            if not is_static(*v):
                return False
        elif not isinstance(v, (np.ndarray, np.generic, int, float, bool)):
            return False
    return True


def to_static(result: Any) -> Any:
    """Concrete jax arrays (computed at trace time) back to NumPy; tracers stay as they are."""
    if isinstance(result, tuple):
        return tuple(to_static(r) for r in result)
    if isinstance(result, list):
        return [to_static(r) for r in result]
    if isinstance(result, jax.Array) and not isinstance(result, jax.core.Tracer):
        return np.asarray(result)
    if isinstance(result, np.generic):
        return np.asarray(result)
    return result


def static(value: Value, what: str) -> np.ndarray:
    """The value as a NumPy array, or StaticValueRequired naming input `what` (the walker adds the node)."""
    if not is_static(value):
        raise StaticValueRequired(what)
    return np.asarray(value)


def static_ints(value: Value, what: str) -> list[int]:
    return [int(v) for v in static(value, what).reshape(-1).tolist()]


def static_int(value: Value, what: str) -> int:
    """A compile-time scalar input (one element of any rank)."""
    values = static_ints(value, what)
    if len(values) != 1:
        raise ValueError(f"input {what!r} must hold exactly one value, got {len(values)}")
    return values[0]


def host_sized(shape: Sequence[int], dtype: np.dtype, what: str = "its output") -> tuple[int, ...]:
    """`shape`, once an array of it and `dtype` is known to fit in host memory: an op building an array on the
    host checks it before allocating (the walker adds the node to the error)."""
    size = math.prod(shape) * np.dtype(dtype).itemsize
    if size > MAX_HOST_VALUE_BYTES:
        raise ValueTooLargeError(f"{what} would be {np.dtype(dtype).name}{list(shape)}, {size} bytes: more than "
                                 f"this host's memory (the limit is {MAX_HOST_VALUE_BYTES} bytes)")
    return tuple(shape)


def is_text(value: Value) -> bool:
    """A string tensor: it lives on the host (NumPy object or str array), never in XLA."""
    return isinstance(value, np.ndarray) and value.dtype.kind in "OUS"


def needs_static(ctx: "NodeContext", index: int, what: str, reason: str) -> StaticValueRequired:
    """A StaticValueRequired for input `index` that also says why the value must be known at compile time."""
    name = ctx.node.inputs[index] if index < len(ctx.node.inputs) and ctx.node.inputs[index] else None
    return StaticValueRequired(what, name, ctx.node.label, reason)


def folded(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`, kept static when every argument is static (inside jit, jnp would stage it otherwise)."""
    if is_static(*args):
        with static_evaluation():
            return to_static(fn(*args))
    return fn(*args)


def signature(tree: Any) -> tuple:
    """What a lax primitive requires to be equal between iterations or branches: structure, shapes, dtypes."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple((tuple(np.shape(x)), np.dtype(x.dtype)) for x in leaves)
