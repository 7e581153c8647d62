"""State -> initializers of a copy of the ModelProto, written atomically (a crash never leaves a half file)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np
import onnx
from onnx import numpy_helper

from .errors import ExportError
from .placement import host_array

if TYPE_CHECKING:
    from .engine import Engine

PROTOBUF_LIMIT = 2**31 - 1  # a serialized ModelProto cannot exceed 2 GiB; past it weights go to external data


def trained_model(engine: "Engine") -> onnx.ModelProto:
    from .engine import STEP_METADATA_KEY

    model = onnx.ModelProto()
    model.CopyFrom(engine.model)
    graphs = [model.graph] + [info.algorithm for info in model.training_info]
    for name, value in engine.state.items():
        owner = engine.state_owner[name]
        graph = graphs[0 if owner is None else owner + 1]
        for tensor in graph.initializer:
            if tensor.name == name:
                tensor.CopyFrom(numpy_helper.from_array(host_array(value), name))
                break
    for prop in list(model.metadata_props):
        if prop.key == STEP_METADATA_KEY:
            model.metadata_props.remove(prop)
    if engine.step_count:
        model.metadata_props.add(key=STEP_METADATA_KEY, value=str(engine.step_count))
    return model


def export_model(engine: "Engine", path: Path, external_data: bool | None = None) -> None:
    """Save `engine`'s model with its current state."""
    save_atomic(trained_model(engine), path, external_data)


def with_initializers(model: onnx.ModelProto, values: Mapping[str, Any]) -> onnx.ModelProto:
    """A copy of `model` whose main-graph initializers named in `values` hold those values."""
    result = onnx.ModelProto()
    result.CopyFrom(model)
    unknown = set(values) - {t.name for t in result.graph.initializer}
    if unknown:
        raise ExportError(f"{sorted(unknown)} are not initializers of the model's main graph")
    for tensor in result.graph.initializer:
        if tensor.name in values:
            tensor.CopyFrom(numpy_helper.from_array(np.asarray(values[tensor.name]), tensor.name))
    return result


def save_atomic(model: onnx.ModelProto, path: Path, external_data: bool | None = None) -> None:
    """Large models (or external_data=True) keep their weights in `<name>.data` beside the model; the model
    file is written to a temporary name and renamed into place, so it is never half-written."""
    path = Path(path)
    if external_data is None:
        external_data = model.ByteSize() > PROTOBUF_LIMIT // 2
    folder = path.resolve().parent
    if not folder.is_dir():
        raise ExportError(f"cannot export to {str(path)!r}: folder {str(folder)!r} does not exist")
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=folder))
    try:
        staged = staging / path.name
        data_name = f"{path.name}.data"
        if external_data:
            onnx.save_model(model, staged, save_as_external_data=True, all_tensors_to_one_file=True,
                            location=data_name, size_threshold=0)
            if (staging / data_name).exists():
                os.replace(staging / data_name, folder / data_name)
        else:
            onnx.save_model(model, staged)
        os.replace(staged, path)
    except OSError as exc:
        raise ExportError(f"cannot export to {str(path)!r}: {exc}") from exc
    finally:
        for leftover in staging.iterdir():
            leftover.unlink()
        staging.rmdir()
