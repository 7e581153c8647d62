"""Models past protobuf's 2 GiB: when a model must keep its weights in external data, which tensors go there,
and how such a model is still validated by onnx.checker.

PROTOBUF_LIMIT, INLINE_BYTES and SKELETON_CHECK_BYTES are read at call time, so tests shrink them to exercise big-model paths with
small models.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Callable

import onnx
from google.protobuf.message import EncodeError, Message
from onnx import TensorProto
from onnx.helper import tensor_dtype_to_np_dtype

from .tensor_data import KNOWN_TYPES

PROTOBUF_LIMIT = 2**31 - 1  # protobuf refuses to serialize or parse a message larger than this
INLINE_BYTES = 1024  # smaller tensors stay in the model file: ONNX Runtime reads some (shapes) while loading
SKELETON_CHECK_BYTES = 64 * 2**20  # past this many bytes of weights, onnx.checker checks a skeleton (below)


def exceeds_protobuf_limit(model: onnx.ModelProto, more: int = 0) -> bool:
    """True when `model`, with at most `more` bytes to come, cannot be serialized as one protobuf message.
    ByteSize is exact, so no margin is needed; past 2 GiB it cannot even count (EncodeError)."""
    try:
        return model.ByteSize() + more > PROTOBUF_LIMIT
    except EncodeError:
        return True


def weight_tensors(model: onnx.ModelProto) -> list[TensorProto]:
    """The initializers of the main graph and of every training graph whose bytes may live in external data."""
    return [t for g in initializer_graphs(model) for t in g.initializer if is_weight(t)]


def weight_bytes(model: onnx.ModelProto) -> int:
    """The bytes the weights' dims and types declare (reading no data)."""
    return sum(math.prod(t.dims) * tensor_dtype_to_np_dtype(t.data_type).itemsize for t in weight_tensors(model))


def initializer_graphs(model: onnx.ModelProto) -> list[onnx.GraphProto]:
    """The graphs whose initializers hold a model's weights and state: main, then each training graph."""
    return [model.graph] + [g for info in model.training_info for g in (info.initialization, info.algorithm)]


def is_weight(tensor: TensorProto) -> bool:
    """INLINE_BYTES or more, and neither int64 (shapes and indices, which ONNX Runtime needs inline at load time
    to fold shapes) nor strings (which external data cannot hold). Node attributes (Constant values) always stay
    inline for the same reason."""
    if tensor.data_type in (TensorProto.INT64, TensorProto.STRING) or tensor.data_type not in KNOWN_TYPES:
        return False  # an unknown type stays inline, where the checker and the decoder name it
    return math.prod(tensor.dims) * tensor_dtype_to_np_dtype(tensor.data_type).itemsize >= INLINE_BYTES


def lean_copy(model: onnx.ModelProto, without_data: Callable[[TensorProto], bool]) -> onnx.ModelProto:
    """A copy of `model` in which the initializers (of every graph) `without_data` picks lack their raw_data.
    Cheaper than CopyFrom then clearing: the bytes are never copied (protobuf's arenas would keep them)."""
    result = onnx.ModelProto()
    copy_fields(model, result, skip={"graph", "training_info"})
    copy_graph(model.graph, result.graph, without_data)
    for info in model.training_info:
        copied = result.training_info.add()
        copy_fields(info, copied, skip={"initialization", "algorithm"})
        if info.HasField("initialization"):
            copy_graph(info.initialization, copied.initialization, without_data)
        copy_graph(info.algorithm, copied.algorithm, without_data)
    return result


def copy_graph(graph: onnx.GraphProto, target: onnx.GraphProto, without_data: Callable[[TensorProto], bool]) -> None:
    copy_fields(graph, target, skip={"initializer"})
    target.SetInParent()  # an empty graph is still present
    for tensor in graph.initializer:
        copy_fields(tensor, target.initializer.add(), skip={"raw_data"} if without_data(tensor) else set())


def copy_fields(source: Message, target: Message, skip: set[str]) -> None:
    """Field by field (not ListFields, which would read a skipped field's bytes); onnx.proto is proto2, so every
    singular field has presence."""
    for field in source.DESCRIPTOR.fields:
        if field.name in skip:
            continue
        if field.is_repeated:
            getattr(target, field.name).extend(getattr(source, field.name))
        elif not source.HasField(field.name):
            continue
        elif field.type == field.TYPE_MESSAGE:
            getattr(target, field.name).CopyFrom(getattr(source, field.name))
        else:
            setattr(target, field.name, getattr(source, field.name))


def check_skeleton(model: onnx.ModelProto) -> None:
    """onnx.checker on a skeleton of `model` in which each weight's bytes, and each external reference, are an
    external reference to an empty file (the checker verifies a reference's file exists, not its bytes): a model
    too large to serialize, or too large to serialize cheaply, or whose state stays in its external data
    (model.read_model's `keep`), is checked without copying its weights."""
    def set_aside(tensor: TensorProto) -> bool:
        return is_weight(tensor) and tensor.HasField("raw_data") or is_external(tensor)

    skeleton = lean_copy(model, set_aside)
    with tempfile.TemporaryDirectory(prefix="onnxtrain-check-") as folder:
        (Path(folder) / "weights").touch()
        originals = (t for g in initializer_graphs(model) for t in g.initializer)
        copies = (t for g in initializer_graphs(skeleton) for t in g.initializer)
        for original, tensor in zip(originals, copies):
            if set_aside(original):
                del tensor.external_data[:]
                tensor.external_data.add(key="location", value="weights")
                tensor.data_location = TensorProto.EXTERNAL
        (Path(folder) / "skeleton.onnx").write_bytes(skeleton.SerializeToString())
        onnx.checker.check_model(str(Path(folder) / "skeleton.onnx"))


def is_external(tensor: TensorProto) -> bool:
    return tensor.data_location == TensorProto.EXTERNAL


def holds_external(model: onnx.ModelProto) -> bool:
    """Whether an initializer of `model` still references external data (model.read_model's `keep`)."""
    return any(is_external(t) for g in initializer_graphs(model) for t in g.initializer)
