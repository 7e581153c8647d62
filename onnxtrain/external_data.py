"""External data: every tensor of a model whose bytes live in another file, read only from the model's folder.

The rule (docs/semantics.md, "External data"): a location is a relative path that, symlinks resolved, stays inside
the folder of the model file; the file is a regular file; `offset`/`length` are non-negative integers and the
range holds exactly the bytes the tensor's dims and type need. A model given as bytes or a ModelProto has no
folder, so it may not reference external data at all. Every tensor is visited (main graph, training graphs,
sparse initializers, attribute tensors, subgraphs, functions), not only the ones onnx's helper walks, and nothing
beyond the tensor's bytes is read. `load` leaves the state in its data files (ExternalValues), checked by the same
rule at every read. The file opened is what is checked (on Linux), so a link swapped in after the check
escapes nothing.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO, Callable

import numpy as np
import onnx
from onnx import TensorProto

from .big_models import is_external
from .errors import ExternalDataError, OnnxTrainError
from .tensor_data import raw_size, raw_value, refuse_segment, tensor_value


def open_regular_file(path: Path, error: type[OnnxTrainError], what: str) -> tuple[BinaryIO, os.stat_result]:
    """Open `path` for reading, and its status (size...), only if it is a regular file: reading a FIFO blocks and a device such
    as /dev/zero never ends. O_NONBLOCK keeps even the open of a FIFO swapped in after the stat from blocking."""
    try:
        opened = open_if_regular(path) if stat.S_ISREG(os.stat(path).st_mode) else None
    except OSError as exc:
        raise error(f"{what} cannot be read: {exc.strerror}") from exc
    if opened is None:
        raise error(f"{what} is not a regular file")
    return opened


def open_if_regular(path: Path) -> tuple[BinaryIO, os.stat_result] | None:
    """`path` opened for reading and its status if what was opened is a regular file, else None (OSError if it
    cannot be opened). O_NONBLOCK: the open of a FIFO returns at once instead of waiting for a writer."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    file = os.fdopen(fd, "rb")
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        file.close()
        return None
    return file, info


def attribute_tensors(attributes: Iterable[onnx.AttributeProto], owner: str) -> Iterator[tuple[str, TensorProto]]:
    """Every tensor held by these attributes, whatever their declared type, subgraphs included."""
    for attr in attributes:
        label = f"attribute {attr.name!r} of {owner}"
        if attr.HasField("t"):
            yield label, attr.t
        yield from ((label, t) for t in attr.tensors)
        sparse = [attr.sparse_tensor] if attr.HasField("sparse_tensor") else []
        for s in sparse + list(attr.sparse_tensors):
            yield f"{label} (sparse values)", s.values
            yield f"{label} (sparse indices)", s.indices
        if attr.HasField("g"):
            yield from graph_tensors(attr.g)
        for g in attr.graphs:
            yield from graph_tensors(g)


def graph_tensors(graph: onnx.GraphProto) -> Iterator[tuple[str, TensorProto]]:
    for t in graph.initializer:
        yield f"initializer {t.name!r} of graph {graph.name!r}", t
    for s in graph.sparse_initializer:
        yield f"sparse initializer {s.values.name!r} of graph {graph.name!r} (values)", s.values
        yield f"sparse initializer {s.values.name!r} of graph {graph.name!r} (indices)", s.indices
    for node in graph.node:
        yield from attribute_tensors(node.attribute, f"node {node.name or node.op_type!r} of graph {graph.name!r}")


def model_tensors(model: onnx.ModelProto) -> Iterator[tuple[str, TensorProto]]:
    """Every TensorProto of the model, each with a label naming where it stands."""
    yield from graph_tensors(model.graph)
    for info in model.training_info:
        yield from graph_tensors(info.initialization)
        yield from graph_tensors(info.algorithm)
    for function in model.functions:
        owner = f"function {function.name!r}"
        yield from attribute_tensors(function.attribute_proto, owner)
        for node in function.node:
            yield from attribute_tensors(node.attribute, f"node {node.name or node.op_type!r} of {owner}")


def entries(tensor: TensorProto, label: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for entry in tensor.external_data:
        if entry.key in found:
            raise ExternalDataError(f"{label}: external data key {entry.key!r} is given twice")
        found[entry.key] = entry.value
    return found


MAX_DIGITS = 30  # digits of an offset or length: 2**64 has 20


def non_negative(entries_: dict[str, str], key: str, label: str) -> int | None:
    if key not in entries_:
        return None
    text = entries_[key]
    if not text.isascii() or not text.isdigit():
        raise ExternalDataError(f"{label}: external data {key} {text!r} is not a non-negative integer")
    digits = text.lstrip("0") or "0"  # int() refuses a string of over 4300 digits, zeros too (a raw ValueError)
    if len(digits) > MAX_DIGITS:
        raise ExternalDataError(f"{label}: external data {key} of {len(digits)} digits is past any file's size")
    return int(digits)


def outside_error(location: str, label: str) -> ExternalDataError:
    return ExternalDataError(f"{label}: external data location {location!r} is outside the model's folder")


def confined_path(location: str, folder: Path, label: str) -> Path:
    """`location` resolved (symlinks included) inside `folder`, else ExternalDataError. `folder` is resolved
    already, once per model (read_model's), not again per tensor: one that is not could only refuse more."""
    if not location:
        raise ExternalDataError(f"{label}: external data has no location")
    if "\0" in location:
        raise ExternalDataError(f"{label}: external data location {location!r} contains a NUL byte")
    outside = outside_error(location, label)
    if os.path.isabs(location):
        raise outside
    try:
        target = (folder / location).resolve()
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop
        raise ExternalDataError(f"{label}: external data location {location!r} cannot be resolved: {exc}") from exc
    if not target.is_relative_to(folder):
        raise outside
    return target


def opened_path(file: BinaryIO) -> Path | None:
    """Where the file open on `file` lies, as the kernel names it (Linux's /proc/self/fd), or None where the system
    does not say."""
    try:
        return Path(os.readlink(f"/proc/self/fd/{file.fileno()}"))
    except OSError:
        return None


# What says a file is the one read before, unchanged: its device and inode (the same file, not another put at its
# path), size, and modification and status-change times in nanoseconds (any write changes both; the status-change
# time cannot be set back). A stamp, not a checksum of the bytes: a checksum costs a pass over them (1.0 s of a
# 2.7 GB model's 6 s load).
Stamp = tuple[int, int, int, int, int]


@contextlib.contextmanager
def tensor_range(tensor: TensorProto, label: str, folder: Path) -> Iterator[tuple[BinaryIO, int, Stamp]]:
    """The confined external-data file of `tensor` in `folder` (resolved: confined_path), open and checked to hold
    its bytes, positioned at their start; how many bytes its dims and type need; and the file's stamp."""
    found = entries(tensor, label)
    location = found.get("location", "")
    target = confined_path(location, folder, label)
    needed = raw_size(tensor, label, ExternalDataError)
    offset = non_negative(found, "offset", label) or 0
    length = non_negative(found, "length", label)
    if length is not None and length != needed:
        raise ExternalDataError(
            f"{label}: external data length {length} does not match the {needed} bytes its dims "
            f"{list(tensor.dims)} and type need"
        )
    file, info = open_regular_file(target, ExternalDataError, f"{label}: external data file {location!r}")
    size = info.st_size
    with file:
        # The file opened, not the path resolved before: a folder or the file swapped for a link out of the folder
        # in between is opened through it. Where the system cannot name an open file, that window stays.
        opened = opened_path(file)
        if opened is not None and not opened.is_relative_to(folder):
            raise outside_error(location, label)
        # Without a length the data runs to the end of the file (onnx's rule), so the rest must be exactly it.
        end_mismatch = size != offset + needed if length is None else size < offset + needed
        if end_mismatch:
            raise ExternalDataError(
                f"{label}: external data file {location!r} has {size} bytes; the tensor needs bytes "
                f"[{offset}, {offset + needed})"
            )
        file.seek(offset)
        yield file, needed, (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def read_tensor_bytes(tensor: TensorProto, label: str, folder: Path) -> tuple[bytes, Stamp]:
    """Exactly the bytes `tensor` needs, read from its confined external-data file, and the file's stamp."""
    with tensor_range(tensor, label, folder) as (file, needed, stamp):
        try:
            data = file.read(needed)
        except MemoryError:  # dims no host holds, backed by a file as large (a sparse one costs no disk)
            raise ExternalDataError(f"{label}: its {needed} bytes of external data (dims {list(tensor.dims)}) do not "
                                    "fit in host memory") from None
    if len(data) != needed:  # the file shrank since its size was read
        raise ExternalDataError(f"{label}: external data file ended early")
    return data, stamp


class ExternalValues:
    """The state variables a model read from its file keeps in external data (read_model's `keep`), read
    where they lie each time they are needed (at load; by reset; before an export replaces their file) instead of
    held in memory: each straight into its array, never through the proto (a 2.7 GB model's load 10.7 -> 8.1 s,
    its peak 5.3 -> 2.9 GB). The first read of a variable records its file's stamp and
    every later one must find the same, so a file changed since load is refused, never trained from."""

    def __init__(self, folder: Path):
        self.folder = folder  # resolved, read_model's
        self.stamps: dict[str, Stamp] = {}

    def value(self, tensor: TensorProto, label: str) -> np.ndarray:
        """`tensor`'s values: through this object when it references external data, else from the proto."""
        if not is_external(tensor):
            return tensor_value(tensor, label)
        refuse_segment(tensor, label)
        return raw_value(tensor, self.read(tensor, label))

    def read(self, tensor: TensorProto, label: str) -> bytes:
        """`tensor`'s bytes from its data file, which must be the one the first read found."""
        location = entries(tensor, label).get("location", "")
        try:
            data, stamp = read_tensor_bytes(tensor, label, self.folder)
        except ExternalDataError as exc:
            if tensor.name not in self.stamps:
                raise
            # read before, so the file changed since: removed (an export over a model file removes its data file),
            # replaced, or cut short. Its own error ("cannot be read: No such file") had hidden the cause.
            said, named = str(exc), f"{label}: external data file {location!r} "
            now = f"now it {said.removeprefix(named)}" if said.startswith(named) else f"now: {said}"
            raise changed_since_load(label, location, now) from exc
        # by name: the kept tensors' names are unique in the model, and a model exported over the loaded one
        # names another file for the same variable
        if self.stamps.setdefault(tensor.name, stamp) != stamp:
            raise changed_since_load(label, location, "written since")
        return data

    def inline_files(self, model: onnx.ModelProto, replaced: Callable[[Path], bool]) -> None:
        """Move into `model` the bytes of each tensor it keeps in a file that `replaced` says is about to go (an
        export over the model's own files), so that reset can still read them."""
        for label, tensor in model_tensors(model):
            if not is_external(tensor):
                continue
            location = entries(tensor, label).get("location", "")
            if replaced(self.folder / location) or replaced(confined_path(location, self.folder, label)):
                hold_inline(tensor, self.read(tensor, label))


def changed_since_load(label: str, location: str, how: str) -> ExternalDataError:
    return ExternalDataError(
        f"{label}: external data file {location!r} has changed since the model was loaded ({how}): the engine reads "
        "the initial state there, for reset() and to recover from a failed first step; load the model again from "
        "its original files (an export over the loaded model replaces them: export elsewhere to keep them)")


def hold_inline(tensor: TensorProto, data: bytes) -> None:
    """`tensor` holding `data` in its raw_data instead of referencing external data."""
    tensor.raw_data = data
    tensor.data_location = TensorProto.DEFAULT
    del tensor.external_data[:]


def inline_external_data(model: onnx.ModelProto, folder: Path | None, keep: Iterable[TensorProto] = ()) -> None:
    """Replace every external reference of `model` by the bytes it names, except those of the tensors in `keep`,
    which are only checked (ExternalValues reads them later). `folder` is resolved (confined_path); None (the model
    came as bytes or a ModelProto) refuses any, since a relative location would otherwise resolve against the
    working dir."""
    held = list(keep)  # holds the messages' Python objects, so that their ids name them during the walk
    kept = {id(t) for t in held}
    for label, tensor in model_tensors(model):
        if not is_external(tensor):
            continue
        if folder is None:
            location = entries(tensor, label).get("location", "")
            raise ExternalDataError(
                f"{label}: external data {location!r} can only be read from the model's folder; load the model "
                "from its file path"
            )
        if id(tensor) in kept:
            with tensor_range(tensor, label, folder):
                pass
            continue
        hold_inline(tensor, read_tensor_bytes(tensor, label, folder)[0])
