"""State -> initializers of a copy of the ModelProto, written atomically (a crash never leaves a half file)."""

from __future__ import annotations

import mmap
import os
import re
import zlib
from collections import Counter
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from . import big_models
from .atomic import (TOKEN_HEX, fsync_folder, new_token, replace_file, settle, unlink_quietly, writable_target,
                     write_durably)
from .big_models import (PROTOBUF_LIMIT, exceeds_protobuf_limit, initializer_graphs, is_external, lean_copy,
                         weight_tensors)
from .dtypes import onnx_type, type_name
from .errors import ExportError, ModelLoadError
from .external_data import ExternalValues, open_if_regular
from .placement import host_array
from .state.bindings import binding_owners, owner_graphs
from .tensor_data import (field_beside_raw_data, holds_no_data, lies_in_memory, raw_size, sparse_to_dense,
                          tensor_value, zeros_of)

STEP_METADATA_KEY = "onnxtrain.step"  # metadata_props key of an exported model's train step count
DATA_ALIGNMENT = 64  # bytes; each tensor starts at a multiple of this in the data file


def saved_step_count(model: onnx.ModelProto) -> int:
    """The step count an exported model records (0 if none): a non-negative integer, or ModelLoadError."""
    text = {p.key: p.value for p in model.metadata_props}.get(STEP_METADATA_KEY, "0")
    if not text.strip().isdigit():
        raise ModelLoadError(
            f"metadata_props[{STEP_METADATA_KEY!r}] = {text!r}: expected the number of train steps taken, "
            f"a non-negative integer"
        )
    return int(text)


# What a pending tensor's bytes can add to a message's size besides their count: raw_data's tag and length, and
# the longer length prefixes of the tensor, its graph and their owners (each a varint of at most 5 bytes more)
PENDING_OVERHEAD = 32
# A tensor of an export's model whose bytes are still an array, with that array: save_atomic writes it to the
# data file straight from the array (a 2.7 GB model's state went through four copies into and out of the proto).
Pending = tuple[TensorProto, np.ndarray]


def with_state(
    model: onnx.ModelProto, state: Mapping[str, Any], state_owner: Mapping[str, int | None], step: int,
) -> tuple[onnx.ModelProto, list[Pending]]:
    """A copy of `model` whose state initializers hold `state` and whose metadata records `step` train steps,
    for save_atomic: each state initializer whose bytes an array holds as they lie in memory is left without
    them, and comes back with that array. `state_owner`: each state variable -> None (ModelProto.graph) or k
    (training_info[k].algorithm)."""
    # the state's old bytes are not copied, they are replaced below; a name in several graphs is copied whole
    names = Counter(t.name for g in initializer_graphs(model) for t in g.initializer)
    result = lean_copy(model, lambda tensor: tensor.name in state_owner and names[tensor.name] == 1)
    pending = []
    for name, value in state.items():
        owner = state_owner[name]
        graph = result.graph if owner is None else result.training_info[owner].algorithm
        for tensor in graph.initializer:
            if tensor.name == name:
                array = np.asarray(host_array(value), order="C")  # (ascontiguousarray makes a 0-d array 1-d)
                data_type = in_memory_type(array)
                if data_type is None:
                    tensor.CopyFrom(numpy_helper.from_array(array, name))
                else:
                    tensor.CopyFrom(TensorProto(name=name, data_type=data_type, dims=array.shape))
                    pending.append((tensor, array))
                break
    for prop in list(result.metadata_props):
        if prop.key == STEP_METADATA_KEY:
            result.metadata_props.remove(prop)
    if step:
        result.metadata_props.add(key=STEP_METADATA_KEY, value=str(step))
    return result, pending


# The share of a model's initializer bytes its zero state must hold for `without_zero_state` to copy the rest of
# the model: an optimizer's moments (two thirds of an Adam model) are worth the copy; a freshly initialised
# model's zero biases are not (BERT-base trained by SGD: 0.1 % of its 439 MB, for a 0.35 s copy at load).
ZERO_STATE_WORTH_A_COPY = 0.125


def without_zero_state(model: onnx.ModelProto, checksummed: bool = False,
                       ) -> tuple[onnx.ModelProto, frozenset[str], dict[str, int]]:
    """`model` without the bytes of its state variables (binding keys) whose bytes are all zero, their names, and
    (`checksummed`: for `without_state_bytes`, the model having come from a file) the CRC-32 of every other state
    variable's raw_data, one read of a tensor's raw_data serving both, since each read copies its bytes (1.9 s of
    a 2.7 GB model's load). An optimizer's moments start at zero and are each as large as the weights. A copy,
    because protobuf (upb) keeps a cleared field's memory in its message's arena: the caller must hold no other
    reference to `model` for its memory to go. `stored_state` and build_graph (through the resolver) recreate the
    zeros. `model` itself, and no names, where the zeros are less than ZERO_STATE_WORTH_A_COPY of its
    initializers' bytes."""
    keys = {e.key for info in model.training_info for e in (*info.initialization_binding, *info.update_binding)}
    graphs = [model.graph] + [info.algorithm for info in model.training_info]
    zeros, checksums = [], {}
    for tensor in (t for g in graphs for t in g.initializer if t.name in keys and t.HasField("raw_data")):
        raw = tensor.raw_data
        if holds_zeros(tensor, raw):
            zeros.append(tensor)
        elif checksummed:
            checksums[tensor.name] = zlib.crc32(raw)
    total = sum(values_bytes(t) for g in initializer_graphs(model) for t in g.initializer)
    if not zeros or sum(values_bytes(t) for t in zeros) < ZERO_STATE_WORTH_A_COPY * total:
        return model, frozenset(), checksums
    zero = frozenset(t.name for t in zeros)
    # a name another graph's initializer holds too may hold non-zero bytes there: only those are read again
    held = Counter(t.name for g in initializer_graphs(model) for t in g.initializer)
    lean = lean_copy(model, lambda t: t.name in zero and (held[t.name] == 1 or
                                                     t.HasField("raw_data") and holds_zeros(t, t.raw_data)))
    return lean, zero, checksums


def exported_state(model: onnx.ModelProto, folder: Path | None) -> tuple[dict[str, np.ndarray], int]:
    """The state (every state variable's value, by name) and step count that `with_state` wrote into `model`, read
    from `folder` by model.read_model(path, keep=every_tensor): the state's external data straight into its arrays
    (ExternalValues, confined to `folder` as at load). ModelLoadError for a damaged tensor or step count."""
    external = None if folder is None else ExternalValues(folder)
    return dict(stored_state(model, binding_owners(model), external=external)), saved_step_count(model)


def without_state_bytes(model: onnx.ModelProto, state_owner: Mapping[str, int | None], zero: frozenset[str],
                        checksums: Mapping[str, int]) -> tuple[onnx.ModelProto, dict[str, int]]:
    """`model` without the bytes of its state variables (except the `zero` ones, which hold none already), and
    the CRC-32 of each variable's bytes it took, from `checksums` (`without_zero_state`'s): for an engine that
    read `model` from a file and can read them there again (model.StateFile). Only a variable held by one
    initializer of one graph loses its bytes, the one with_state replaces on export. A copy, as for
    `without_zero_state`."""
    names = Counter(t.name for g in initializer_graphs(model) for t in g.initializer)
    taken = {}
    for owner, graph in owner_graphs(model).items():
        for tensor in graph.initializer:
            name = tensor.name
            owned_here = name in state_owner and state_owner[name] == owner and names[name] == 1
            if owned_here and name not in zero and name in checksums and tensor.HasField("raw_data"):
                taken[name] = checksums[name]
    if not taken:
        return model, taken
    return lean_copy(model, lambda tensor: tensor.name in taken), taken


def values_bytes(tensor: TensorProto) -> int:
    """The bytes of `tensor`'s values, from its dims and type where they say it: `ByteSize` serializes a message
    to count it (upb), a pass over the data (2.8 s of a 2.7 GB model's load)."""
    try:
        return raw_size(tensor, "")
    except ModelLoadError:  # a string tensor, or dims that do not fit its type: tensor_value names what is wrong
        return tensor.ByteSize()


def holds_zeros(tensor: TensorProto, raw: bytes) -> bool:
    """`raw`, `tensor`'s raw_data, is of exactly the size its dims and type need, all zero bytes (a malformed
    tensor keeps its bytes, for tensor_value to name what is wrong: a typed field holding values too, which
    without raw_data would be read instead)."""
    try:
        return len(raw) == raw_size(tensor, "") and not raw.strip(b"\0") and not field_beside_raw_data(tensor)
    except ModelLoadError:
        return False


def stored_state(model: onnx.ModelProto, state_owner: Mapping[str, int | None],
                 zero: frozenset[str] = frozenset(), external: ExternalValues | None = None,
                 ) -> Iterator[tuple[str, np.ndarray]]:
    """(name, value) of each state variable as `model`'s initializers store it (the spec's pre-initialized
    state), decoded one at a time so that a caller moving them to a device holds one decoded copy at most.
    `state_owner` as for `with_state`; `zero`: the variables `without_zero_state` took the bytes of; `external`:
    reads those the model keeps in external data."""
    graphs = owner_graphs(model)
    tensors = {owner: {t.name: t for t in graph.initializer} for owner, graph in graphs.items()}
    sparse = {owner: {t.values.name: t for t in graph.sparse_initializer} for owner, graph in graphs.items()}
    for name, owner in state_owner.items():
        label = f"initializer {name!r}"
        if name in zero and holds_no_data(tensors[owner][name]):
            yield name, zeros_of(tensors[owner][name])
        elif name in tensors[owner]:
            tensor = tensors[owner][name]
            yield name, tensor_value(tensor, label) if external is None else external.value(tensor, label)
        else:
            yield name, sparse_to_dense(sparse[owner][name], f"sparse {label}", max_bytes=PROTOBUF_LIMIT)


def with_initializers(model: onnx.ModelProto, values: Mapping[str, Any]) -> onnx.ModelProto:
    """A copy of `model` whose main-graph initializers named in `values` hold those values."""
    result = onnx.ModelProto()
    result.CopyFrom(model)
    unknown = set(values) - {t.name for t in result.graph.initializer}
    if unknown:
        raise ExportError(f"{sorted(unknown)} are not initializers of the model's main graph")
    arrays = {name: np.asarray(value) for name, value in values.items()}
    mismatched = [  # a value of another shape or type would make a model the graph's nodes cannot read
        f"{t.name!r} is {type_name(onnx_type(a.dtype))}{list(a.shape)}, the model's "
        f"{type_name(t.data_type)}{list(t.dims)}"
        for t in result.graph.initializer if (a := arrays.get(t.name)) is not None
        and (a.shape, onnx_type(a.dtype)) != (tuple(t.dims), t.data_type)]
    if mismatched:
        raise ExportError(f"values that do not fit their initializers: {'; '.join(mismatched)}")
    for tensor in result.graph.initializer:
        if tensor.name in arrays:
            tensor.CopyFrom(numpy_helper.from_array(arrays[tensor.name], tensor.name))
    return result


def in_memory_type(array: np.ndarray) -> int | None:
    """The TensorProto type whose raw_data is exactly `array`'s memory; None where onnx encodes the values
    otherwise (strings, packed sub-byte types, a big-endian host)."""
    if array.dtype.kind in "OUS":
        return None
    data_type = helper.np_dtype_to_tensor_dtype(array.dtype)
    return data_type if lies_in_memory(data_type) else None


def array_bytes(array: np.ndarray) -> memoryview:
    """`array`'s memory as bytes (C-contiguous; any dtype, 0-d included)."""
    return memoryview(array.reshape(-1).view(np.uint8))


def check_export_target(path: str | os.PathLike) -> None:
    """ExportError unless a model file can be written at `path` (atomic.writable_target). Checked before the
    weights are written, and by the training loop and the CLI before training."""
    problem = writable_target(path, "model")
    if problem:
        raise ExportError(problem)


def save_atomic(model: onnx.ModelProto, path: str | os.PathLike, external_data: bool | None = None,
                pending: Sequence[Pending] = ()) -> None:
    """Write `model` to `path`; with external data (external_data=True, or None and the model past protobuf's
    limit) its weights (big_models.weight_tensors) go to `<name>.<token>.data` beside it. `model` is consumed
    (its weights are moved out). `pending`: tensors of `model` whose bytes are arrays (with_state's), written
    from the arrays.

    The model file at `path` is always either the previous one or the new one, each whole with its own data file:
    every export writes its weights under a fresh name (the file and its folder entry fsync'ed), then the model file
    referencing them replaces the old one atomically (the commit point), then the previous data file is removed.
    Files a killed export left (staging model files, data files no model refers to) match `path`'s patterns and are
    removed by the next export to `path`. One writer per path at a time."""
    check_export_target(path)
    path = Path(path)
    if external_data is None:
        external_data = exceeds_protobuf_limit(model, sum(PENDING_OVERHEAD + a.nbytes for _, a in pending))
    folder = path.absolute().parent  # not resolve(): a symlink at `path` is replaced, not its target
    weights = weight_tensors(model) if external_data else []
    arrays = {id(tensor): array for tensor, array in pending}  # `pending` holds the tensors: their ids name them
    data_name = f"{path.name}.{new_token()}.data" if weights else None
    committed = False
    try:
        if data_name is not None:
            write_durably(folder / data_name,
                          lambda stream: move_to_external_data(weights, stream, data_name, arrays))
            # the data file's folder entry on disk before the rename that commits a model file naming it: the file
            # system may persist the rename first, and a power loss between left a model naming a missing file
            fsync_folder(folder)
        for tensor, array in pending:  # what stays in the model file
            if not is_external(tensor):
                tensor.raw_data = array_bytes(array).tobytes()
        serialized = serialize(model, path, external_data)
        replace_file(path, lambda stream: stream.write(serialized))
        # the model file referencing the data file is in place: from here a failure (the folder's fsync, an
        # interrupt) must not remove the data file, which left `path` naming a missing one, neither old nor new
        committed = True
        settle(path)
    except OSError as exc:
        after = " (the new model file is in place, not known to be on disk)" if committed else ""
        raise ExportError(f"cannot export to {str(path)!r}{after}: {exc}") from exc
    finally:
        if data_name is not None and not committed and not renamed_in(path, data_name):
            unlink_quietly(folder / data_name)
    remove_stale_data(folder, path, keep=data_name)  # settle removed the staging files


def renamed_in(path: Path, data_name: str) -> bool:
    """Whether the model file at `path` names the data file `data_name` (fresh to an export: no other file names
    it), so the export's rename happened though `committed` was not set: Python runs a signal handler (Ctrl-C's
    KeyboardInterrupt) as a call returns, and a SIGINT that came during the fsync or rename lands as os.replace
    returns. A model file that cannot be read counts as naming it: the data file stays, a leftover the next
    export removes, never the reverse."""
    try:
        return data_name in names_in_file(path, {data_name})
    except FileNotFoundError:  # no model file: a first export that failed before its rename
        return False
    except OSError:
        return True


def remove_stale_data(folder: Path, path: Path, keep: str | None) -> None:
    """Remove the data files of exports to `path` (`data_pattern`) but `keep`, the one the new model file
    references, unless another model file of the folder references one: a copy of an exported model file, or a
    model torch.onnx.export wrote beside `<name>.data` and another model shares, would otherwise lose its weights."""
    pattern = data_pattern(path)
    stale = {entry.name for entry in os.scandir(folder) if entry.name != keep and pattern.fullmatch(entry.name)}
    for name in stale - referenced_by_other_models(folder, path, stale):
        unlink_quietly(folder / name)


def referenced_by_other_models(folder: Path, path: Path, names: set[str]) -> set[str]:
    """Which of `names` a `.onnx` file of `folder` other than `path` contains (an external-data location is
    stored as its bytes). A match that is no location keeps a file that could go, never the reverse; a file that
    cannot be read counts as naming them all. Read only when there is something to remove: a model that
    references external data is small, its weights being elsewhere."""
    found: set[str] = set()
    if not names:
        return found
    for entry in os.scandir(folder):
        if entry.name == path.name or not entry.name.endswith(".onnx") or not entry.is_file():
            continue
        try:
            found |= names_in_file(Path(entry.path), names - found)
        except OSError:
            return set(names)
        if found == names:
            break
    return found


def names_in_file(path: Path, names: set[str]) -> set[str]:
    """Which of `names` the file at `path` contains as bytes (OSError if it cannot be read). A FIFO or a device
    names none: a plain open() of a FIFO blocks."""
    opened = open_if_regular(path)
    if opened is None:
        return set()
    try:
        with opened[0] as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return {name for name in names if data.find(name.encode()) >= 0}
    except ValueError:  # an empty file: it names nothing
        return set()


def replaced_by_export(path: Path) -> Callable[[Path], bool]:
    """Whether a path names a folder entry that an export to `path` replaces or removes: `path` itself or a data
    file of it (the folders compared resolved: the same folder reached through a link is the same)."""
    folder = path.absolute().parent.resolve()

    def replaced(file: Path) -> bool:
        named = file.name == path.name or bool(data_pattern(path).fullmatch(file.name))
        return named and file.absolute().parent.resolve() == folder

    return replaced


def data_pattern(path: Path) -> re.Pattern[str]:
    """The data files of exports to `path`: ours (`<name>.<token>.data`) and `<name>.data`, the name earlier
    versions and torch.onnx.export give the data of a model file `<name>`."""
    return re.compile(rf"{re.escape(path.name)}(\.[0-9a-f]{{{TOKEN_HEX}}})?\.data")


def serialize(model: onnx.ModelProto, path: Path, external_data: bool) -> bytes:
    if exceeds_protobuf_limit(model):
        advice = "even with its weights in external data" if external_data else "export with external_data=True"
        raise ExportError(
            f"cannot export to {str(path)!r}: the model file would be past protobuf's limit of "
            f"{big_models.PROTOBUF_LIMIT:,} bytes ({advice})"
        )
    return model.SerializeToString()


def move_to_external_data(tensors: list[onnx.TensorProto], stream: BinaryIO, location: str,
                          arrays: Mapping[int, np.ndarray]) -> None:
    """Append each tensor's bytes (its array's, where `arrays` has one by the tensor's id) to `stream` (64-byte
    aligned) and make the tensor refer to them."""
    for tensor in tensors:
        array = arrays.get(id(tensor))
        if array is None and not tensor.HasField("raw_data"):
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor), tensor.name))
        stream.write(bytes(-stream.tell() % DATA_ALIGNMENT))
        offset = stream.tell()
        raw = tensor.raw_data if array is None else array_bytes(array)  # raw_data: a copy out, read it once
        stream.write(raw)
        tensor.ClearField("raw_data")
        del tensor.external_data[:]
        for key, value in (("location", location), ("offset", offset), ("length", len(raw))):
            tensor.external_data.add(key=key, value=str(value))
        tensor.data_location = onnx.TensorProto.EXTERNAL
