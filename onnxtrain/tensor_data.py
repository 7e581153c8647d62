"""Decoding a TensorProto to NumPy, after checking that its type is known and its data has exactly the size its
dims and type declare: a malformed tensor is a ModelLoadError naming it, never a KeyError or a reshape error."""

from __future__ import annotations

import math
import os
import sys
from typing import Iterator, Mapping

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .errors import ExternalDataError, ModelLoadError

KNOWN_TYPES = frozenset(TensorProto.DataType.values()) - {TensorProto.UNDEFINED}

# Sub-byte types pack several elements per byte of raw_data (and the 4- and 2-bit ones per typed-field entry too).
BITS = {
    TensorProto.INT4: 4, TensorProto.UINT4: 4, TensorProto.FLOAT4E2M1: 4,
    TensorProto.INT2: 2, TensorProto.UINT2: 2,
    TensorProto.FLOAT6E2M3: 6, TensorProto.FLOAT6E3M2: 6,
}
PER_FIELD_ENTRY = {TensorProto.INT4: 2, TensorProto.UINT4: 2, TensorProto.FLOAT4E2M1: 2,
                   TensorProto.INT2: 4, TensorProto.UINT2: 4}
COMPLEX = frozenset({TensorProto.COMPLEX64, TensorProto.COMPLEX128})


def tensor_label(tensor: TensorProto, label: str | None) -> str:
    return label or f"tensor {tensor.name!r}"


def known_type(elem_type: int, what: str, error: type[ModelLoadError] = ModelLoadError) -> int:
    if elem_type not in KNOWN_TYPES:
        raise error(f"{what} has unknown element type {elem_type}")
    return elem_type


# Values over this size are refused before XLA sees them (lower/walker.py's check_sizes): a shape whose byte size
# overflows XLA's int64 extent arithmetic aborts the whole process (SIGABRT, e.g. Expand to [2**63-1]). No device
# holds 256 TiB anyway.
MAX_VALUE_BYTES = 2**48
# The most elements an empty tensor's non-zero dimensions may multiply to: no data backs them (a dimension of 0
# leaves no bytes to check), and NumPy refuses a shape whose non-zero dims overflow its sizes (a raw ValueError).
# The bound of the largest value a node may produce, counted in elements.
MAX_EMPTY_EXTENT = MAX_VALUE_BYTES
# Values computed at load or trace time from constants (ConstantOfShape, Range, a node of constants: the walker's
# static values) are built in host memory, so none can be larger than it: one that is (a constant shape of 32 GiB)
# is refused before it is allocated, not met as NumPy's MemoryError or the system's out-of-memory killer.
MAX_HOST_VALUE_BYTES = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def checked_dims(dims, label: str, error: type[ModelLoadError] = ModelLoadError) -> int:
    """The element count of a tensor of `dims`, each dimension checked: none negative, and an empty tensor's
    others not past MAX_EMPTY_EXTENT."""
    if any(d < 0 for d in dims):
        raise error(f"{label} has a negative dimension in {list(dims)}")
    count = math.prod(dims)
    if count == 0 and math.prod(d for d in dims if d) > MAX_EMPTY_EXTENT:
        raise error(f"{label} has dims {list(dims)}: an empty tensor whose other dimensions multiply past 2**48, "
                    "more than any tensor can have")
    return count


def raw_size(tensor: TensorProto, label: str, error: type[ModelLoadError] = ModelLoadError) -> int:
    """The bytes of raw_data (or external data) that `tensor`'s dims and type need."""
    known_type(tensor.data_type, label, error)
    if tensor.data_type == TensorProto.STRING:
        raise error(f"{label}: a string tensor keeps its data in string_data, not in raw or external data")
    count = checked_dims(tensor.dims, label, error)
    bits = BITS.get(tensor.data_type) or 8 * np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize
    return -(-count * bits // 8)


def field_entries(tensor: TensorProto, count: int) -> int:
    """How many entries of its typed field (float_data, int32_data...) a tensor of `count` elements holds."""
    if tensor.data_type in COMPLEX:
        return 2 * count
    return -(-count // PER_FIELD_ENTRY.get(tensor.data_type, 1))


def decode_utf8(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ModelLoadError(f"{what} is not valid UTF-8 ({exc.reason} at byte {exc.start})") from exc


def tensor_value(tensor: TensorProto, label: str | None = None) -> np.ndarray:
    """`tensor` as a NumPy array; its data must already be in the proto (external data is inlined by read_model,
    or read by external_data.ExternalValues)."""
    label = tensor_label(tensor, label)
    if tensor.data_location == TensorProto.EXTERNAL:
        raise ExternalDataError(
            f"{label} references external data, which is only read when the model is loaded from its file path: "
            "give onnxtrain.load the path, and make_trainable a model read with its data (onnx.load(path), whose "
            "load_external_data=True is the default)"
        )
    refuse_segment(tensor, label)
    known_type(tensor.data_type, label)
    count = checked_dims(tensor.dims, label)
    if tensor.data_type == TensorProto.STRING:
        if len(tensor.string_data) != count:
            raise ModelLoadError(f"{label} has {len(tensor.string_data)} strings for dims {list(tensor.dims)}")
        strings = [decode_utf8(s, f"a string of {label}") for s in tensor.string_data]
        return np.array(strings, dtype=object).reshape(tuple(tensor.dims))
    doubled = field_beside_raw_data(tensor)
    if doubled:
        raise ModelLoadError(
            f"{label} holds values both in raw_data and in {doubled}, which onnx.checker refuses; keep one of them"
        )
    raw = tensor.raw_data if tensor.HasField("raw_data") else None  # each read of the field copies its bytes
    if raw is not None:
        needed, held, unit = raw_size(tensor, label), len(raw), "bytes of raw_data"
    else:
        field = helper.tensor_dtype_to_field(tensor.data_type)
        needed, held, unit = field_entries(tensor, count), len(getattr(tensor, field)), f"entries of {field}"
    if held != needed:
        raise ModelLoadError(
            f"{label} has {held} {unit} where its dims {list(tensor.dims)} and type "
            f"{TensorProto.DataType.Name(tensor.data_type)} need {needed}"
        )
    return numpy_helper.to_array(tensor) if raw is None else raw_value(tensor, raw)


def field_beside_raw_data(tensor: TensorProto) -> str | None:
    """The typed field (float_data, int64_data...) that holds entries although raw_data is set too, if any."""
    if not tensor.HasField("raw_data") or tensor.data_type not in KNOWN_TYPES - {TensorProto.STRING}:
        return None
    field = helper.tensor_dtype_to_field(tensor.data_type)
    return field if len(getattr(tensor, field)) else None


def refuse_segment(tensor: TensorProto, label: str) -> None:
    if tensor.HasField("segment"):
        raise ModelLoadError(f"{label} is a segment of a tensor; segmented tensors are not supported")


def lies_in_memory(data_type: int) -> bool:
    """Whether raw_data of this (known, not string) type holds the elements as NumPy holds them in memory: whole-
    byte elements on a little-endian host (onnx stores them little-endian, and packs the sub-byte types)."""
    return data_type not in BITS and sys.byteorder == "little"


def raw_value(tensor: TensorProto, raw: bytes) -> np.ndarray:
    """`raw`, exactly the bytes `tensor`'s dims and type need, as `tensor`'s values: a view of the bytes where they
    lie as in memory (not a second copy), else onnx's decoding of them."""
    if lies_in_memory(tensor.data_type):
        return np.frombuffer(raw, helper.tensor_dtype_to_np_dtype(tensor.data_type)).reshape(tuple(tensor.dims))
    return numpy_helper.to_array(TensorProto(data_type=tensor.data_type, dims=tensor.dims, raw_data=raw))


def holds_no_data(tensor: TensorProto) -> bool:
    """Neither raw_data nor entries in the typed field: how export.without_zero_state leaves a zero tensor."""
    if tensor.HasField("raw_data") or tensor.data_type not in KNOWN_TYPES or tensor.data_type == TensorProto.STRING:
        return False
    return len(getattr(tensor, helper.tensor_dtype_to_field(tensor.data_type))) == 0


def zeros_of(tensor: TensorProto) -> np.ndarray:
    """Zeros of `tensor`'s dims and type (the OS maps the pages only when written)."""
    return np.zeros(tuple(tensor.dims), helper.tensor_dtype_to_np_dtype(tensor.data_type))


class DenseBudget:
    """The bytes the dense forms of a model's sparse tensors may take together: each is bounded as one dense tensor
    in the proto is (sparse_to_dense's `max_bytes`), and all of them as all of a model's dense tensors in the proto
    are, by `limit`. Many sparse tensors, a few bytes of the file each, had exhausted host memory at load."""

    def __init__(self, limit: int):
        self.limit = limit
        self.taken = 0

    def take(self, nbytes: int, label: str) -> None:
        if self.taken + nbytes > self.limit:
            raise ModelLoadError(f"{label}: its dense form of {nbytes} bytes takes the dense forms of the model's "
                                 f"sparse tensors past {self.limit} bytes together ({self.taken} before it); store "
                                 "the large ones dense")
        self.taken += nbytes


def sparse_to_dense(sparse: onnx.SparseTensorProto, label: str, max_bytes: int,
                    budget: DenseBudget | None = None) -> np.ndarray:
    """A SparseTensorProto as a dense array (indices are flat positions, or one coordinate row per value).
    Its dense size is bounded by `max_bytes`, and taken from `budget`: unlike a dense tensor, no data in the file
    backs it."""
    values = tensor_value(sparse.values, f"{label} (values)")
    indices = tensor_value(sparse.indices, f"{label} (indices)")
    dims = tuple(sparse.dims)
    size = checked_dims(dims, label)
    if size * values.dtype.itemsize > max_bytes:
        raise ModelLoadError(f"{label}: its dense form {list(dims)} would exceed {max_bytes} bytes")
    nnz = values.size
    shapes = [(nnz,), (nnz, len(dims))] if dims else [(nnz,)]
    if values.ndim != 1 or indices.dtype != np.int64 or indices.shape not in shapes:
        raise ModelLoadError(
            f"{label}: values must be 1-D and indices int64 of shape [{nnz}] or [{nnz}, {len(dims)}], got values "
            f"{list(values.shape)} and indices {indices.dtype} {list(indices.shape)}"
        )
    if indices.ndim == 2:
        bounds = np.asarray(dims, np.int64)
        if ((indices < 0) | (indices >= bounds)).any():
            raise ModelLoadError(f"{label}: an index lies outside dims {list(dims)}")
        flat = np.ravel_multi_index(tuple(indices.T), dims)
    else:
        if ((indices < 0) | (indices >= size)).any():
            raise ModelLoadError(f"{label}: an index lies outside the {size} elements of dims {list(dims)}")
        flat = indices
    if budget is not None:  # once the tensor is known well formed: a malformed one is refused for what it is
        budget.take(size * values.dtype.itemsize, label)
    try:
        dense = np.zeros(size, values.dtype)
    except MemoryError:  # each dense form is bounded, not all of them: a few bytes of the file each
        raise ModelLoadError(f"{label}: its dense form {list(dims)} does not fit in host memory") from None
    dense[flat] = values
    return dense.reshape(dims)


class DecodedOnRead(Mapping[str, np.ndarray]):
    """Tensors by name, each decoded when read and not kept: a check that visits every weight of a big model
    holds one decoded weight at a time, not a second copy of the model."""

    def __init__(self, tensors: Mapping[str, TensorProto]):
        self.tensors = tensors

    def __getitem__(self, name: str) -> np.ndarray:
        return tensor_value(self.tensors[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)
