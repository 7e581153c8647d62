"""The state pytree (name -> array) and the rule that an assignment keeps each variable's shape and dtype."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ..errors import StateError


def check_assignment(name: str, value: Any, current: Any, source: str) -> None:
    """Refuse a change of shape or dtype (runs at trace time, so before any compute)."""
    if value is None or isinstance(value, list):
        raise StateError(f"{source}: state variable {name!r} must be assigned a tensor")
    if tuple(value.shape) != tuple(current.shape) or np.dtype(value.dtype) != np.dtype(current.dtype):
        raise StateError(
            f"{source}: assigning {np.dtype(value.dtype)}{list(value.shape)} to state variable {name!r} "
            f"of {np.dtype(current.dtype)}{list(current.shape)} (shape and dtype must not change)"
        )


def assign(state: Mapping[str, Any], binding: Mapping[str, str], values: Mapping[str, Any], source: str) -> dict:
    """All bindings of one call at once, from values computed with the state as it was before the call."""
    new_state = dict(state)
    for name, value_name in binding.items():
        value = values[value_name]
        check_assignment(name, value, state[name], f"{source} binding {name!r} <- {value_name!r}")
        new_state[name] = value
    return new_state


# NumPy's .npz holds only NumPy's own dtypes; ml_dtypes ones (bfloat16, float8...) travel as raw bits.
def save_npz(path: str | Path, state: Mapping[str, Any], meta: Mapping[str, Any]) -> None:
    arrays, dtypes = {}, {}
    for name, value in state.items():
        array = np.asarray(value)
        dtypes[name] = array.dtype.name
        if array.dtype.kind == "V" or array.dtype.name not in np.sctypeDict:
            array = array.view(f"u{array.dtype.itemsize}")
        arrays[name] = array
    header = json.dumps({"dtypes": dtypes, "meta": dict(meta)})
    np.savez(path, __onnxtrain__=np.frombuffer(header.encode(), dtype=np.uint8), **arrays)


def load_npz(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    import ml_dtypes  # noqa: F401  (registers the dtype names np.dtype() resolves below)

    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise StateError(f"cannot read state checkpoint {str(path)!r}: {exc}") from exc
    with data:
        if "__onnxtrain__" not in data.files:
            raise StateError(f"{str(path)!r} is not an onnxtrain state checkpoint (written by Engine.save_state)")
        header = json.loads(bytes(data["__onnxtrain__"]).decode())
        state = {}
        for name, dtype_name in header["dtypes"].items():
            array = data[name]
            dtype = np.dtype(getattr(ml_dtypes, dtype_name, dtype_name))
            state[name] = array.view(dtype) if array.dtype != dtype else array
    return state, header["meta"]

