"""Models past protobuf's 2 GiB: when a model must keep its weights in external data, which tensors go there,
and how such a model is still validated by onnx.checker.

PROTOBUF_LIMIT and INLINE_BYTES are read at call time, so tests shrink them to exercise big-model paths with
small models.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import onnx
from onnx import TensorProto
from onnx.external_data_helper import set_external_data

PROTOBUF_LIMIT = 2**31 - 1  # protobuf refuses to serialize or parse a message larger than this
INLINE_BYTES = 1024  # smaller tensors stay in the model file: ONNX Runtime reads some (shapes) while loading


def exceeds_protobuf_limit(model: onnx.ModelProto) -> bool:
    """True when `model` cannot be serialized as one protobuf message (ByteSize is exact; no margin needed)."""
    return model.ByteSize() > PROTOBUF_LIMIT


def weight_tensors(model: onnx.ModelProto) -> list[TensorProto]:
    """The initializers of the main graph and of every training graph whose bytes may live in external data:
    INLINE_BYTES or more, and not int64 (int64 tensors are shapes and indices, which ONNX Runtime needs inline
    at load time to fold shapes). Node attributes (Constant values) always stay inline for the same reason."""
    graphs = [model.graph]
    for info in model.training_info:
        graphs += [info.initialization, info.algorithm]
    return [
        t for g in graphs for t in g.initializer
        if t.data_type != TensorProto.INT64 and data_bytes(t) >= INLINE_BYTES
    ]


def data_bytes(tensor: TensorProto) -> int:
    if tensor.HasField("raw_data"):
        return len(tensor.raw_data)
    return tensor.ByteSize()  # typed fields: close enough to decide whether a tensor is small


def check_large_model(model: onnx.ModelProto) -> None:
    """onnx.checker on a model too large to serialize: its weights' bytes are set aside for the check (each
    becomes an external reference to an empty file; the checker verifies a reference's file exists, not its
    bytes), the path-based checker runs on the skeleton, and the bytes are put back, also on failure."""
    tensors = [t for t in weight_tensors(model) if t.HasField("raw_data")]
    set_aside = [(t.raw_data, t.HasField("data_location")) for t in tensors]
    try:
        with tempfile.TemporaryDirectory(prefix="onnxtrain-check-") as folder:
            (Path(folder) / "weights").touch()
            for tensor in tensors:
                skeleton_reference(tensor, "weights")
            skeleton = Path(folder) / "skeleton.onnx"
            skeleton.write_bytes(model.SerializeToString())
            onnx.checker.check_model(str(skeleton))
    finally:
        for tensor, (raw, had_location) in zip(tensors, set_aside):
            del tensor.external_data[:]
            tensor.ClearField("data_location")
            if had_location:
                tensor.data_location = TensorProto.DEFAULT
            tensor.raw_data = raw


def skeleton_reference(tensor: TensorProto, location: str) -> None:
    set_external_data(tensor, location, offset=0, length=len(tensor.raw_data))
    tensor.data_location = TensorProto.EXTERNAL
    tensor.ClearField("raw_data")
