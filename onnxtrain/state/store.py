"""The state pytree (name -> array) and the rule that an assignment keeps each variable's shape and dtype."""

from __future__ import annotations

import json
import os
import zipfile
import zlib
from pathlib import Path
from typing import Any, BinaryIO, Mapping

import numpy as np
from numpy.lib.npyio import NpzFile

from ..atomic import replace_atomically, writable_target
from ..errors import ExternalDataError, ModelLoadError, StateError
from ..export import exported_state
from ..external_data import open_regular_file
from ..model import every_tensor, read_model


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
    """Write exactly `path` (no suffix added), atomically: a crash leaves the previous checkpoint or this one."""
    problem = writable_target(path, "state checkpoint")  # before the state is serialized
    if problem:
        raise StateError(problem)
    arrays, dtypes = {}, {}
    for name, value in state.items():
        array = np.asarray(value)
        dtypes[name] = array.dtype.name
        if array.dtype.kind == "V" or array.dtype.name not in np.sctypeDict:
            array = array.view(f"u{array.dtype.itemsize}")
        arrays[name] = array
    header = json.dumps({"dtypes": dtypes, "meta": dict(meta)})
    header_array = np.frombuffer(header.encode(), dtype=np.uint8)
    try:
        replace_atomically(Path(path), lambda stream: np.savez(stream, **{HEADER: header_array}, **arrays))
    except OSError as exc:
        raise StateError(f"cannot write state checkpoint {str(path)!r}: {exc}") from exc


HEADER = "__onnxtrain__"
# What a damaged file raises while it is read: not a zip, truncated, bad CRC, bad JSON, wrong-typed header...
DAMAGE = (OSError, ValueError, EOFError, KeyError, TypeError, zipfile.BadZipFile, zlib.error)


def load_checkpoint(path: str | Path) -> tuple[dict[str, np.ndarray], int]:
    """The state variables and step count of a checkpoint: save_npz's .npz archive, or a model Engine.export wrote
    (fit's and `onnxtrain train -o`'s checkpoints), told apart by the archive's first bytes. StateError naming the
    file for anything else or anything damaged. Only a regular file is opened (np.load of a FIFO blocked forever),
    only a zip archive is handed to np.load, whose error for any other file advised allow_pickle, and a model is
    read as `load` reads one (model.read_model: its external data confined to its folder)."""
    if not isinstance(path, (str, os.PathLike)) or "\0" in str(path):
        raise StateError(f"cannot read state checkpoint {path!r}: not a file path")
    file, info = open_regular_file(Path(path), StateError, f"state checkpoint {str(path)!r}")
    with file:
        if file.read(len(ZIP_MAGIC)) == ZIP_MAGIC:
            file.seek(0)
            try:
                data = np.load(file, allow_pickle=False)
            except DAMAGE as exc:
                raise StateError(f"cannot read state checkpoint {str(path)!r}: {exc}") from exc
            state, meta = read_archive(data, path)
            return state, meta.get("step", 0)
        return load_exported(Path(path), (file, info))  # read from the file opened here, not opened again


def load_exported(path: Path, opened: tuple[BinaryIO, os.stat_result]) -> tuple[dict[str, np.ndarray], int]:
    """The state and step count of the model Engine.export wrote at `path` (export.exported_state), `opened` by
    load_checkpoint."""
    try:
        model, folder = read_model(path, keep=every_tensor, opened=opened)
    except ExternalDataError as exc:
        raise StateError(f"state checkpoint {str(path)!r} is damaged: {exc}") from exc
    except ModelLoadError as exc:
        raise StateError(f"{str(path)!r} is not an onnxtrain state checkpoint (not an .npz archive of save_state, "
                         f"nor a model export wrote: {exc})") from exc
    try:
        return exported_state(model, folder)
    except ModelLoadError as exc:
        raise StateError(f"state checkpoint {str(path)!r} is damaged: {exc}") from exc


ZIP_MAGIC = b"PK\x03\x04"  # how a zip archive with members (np.savez's, never empty: it holds the header) starts


def read_archive(data: NpzFile, path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    with data:
        if HEADER not in data.files:
            raise StateError(f"{str(path)!r} is not an onnxtrain state checkpoint (written by Engine.save_state)")
        try:
            return read_checkpoint(data)
        except DAMAGE as exc:
            raise StateError(f"state checkpoint {str(path)!r} is damaged: {exc!r}") from exc


def read_checkpoint(data: NpzFile) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    import ml_dtypes  # noqa: F401  (registers the dtype names np.dtype() resolves below)

    header = json.loads(bytes(data[HEADER]).decode())
    if not isinstance(header, dict) or not isinstance(header.get("dtypes"), dict):
        raise ValueError(f"header {header!r} has no 'dtypes' table")
    meta = header.get("meta")
    step = meta.get("step", 0) if isinstance(meta, dict) else None
    if type(step) is not int or step < 0:  # (a bool is an int; -1 had become the step count, OverflowError later)
        raise ValueError(f"header {header!r} has no 'meta' table with a non-negative integer 'step'")
    state = {}
    for name, dtype_name in header["dtypes"].items():
        array = data[name]
        dtype = np.dtype(getattr(ml_dtypes, str(dtype_name), dtype_name))
        state[name] = array.view(dtype) if array.dtype != dtype else array
    return state, meta
