"""Reading and checking a model: its bytes from a file (or bytes, or a ModelProto), external data inlined, and
onnx.checker's verdict. Building its graphs and binding their nodes is lower/build.py.
"""

from __future__ import annotations

import os
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Iterator, Mapping

import onnx
from google.protobuf.message import DecodeError

from . import lower  # noqa: F401  (registers every op)
from . import big_models
from .big_models import PROTOBUF_LIMIT, check_skeleton, holds_external, initializer_graphs, weight_bytes
from .errors import ModelLoadError
from .external_data import inline_external_data, model_tensors, open_regular_file
from .state.bindings import binding_owners, owner_graphs

ModelSource = str | os.PathLike | bytes | onnx.ModelProto
Kept = Callable[[onnx.ModelProto], Iterable[onnx.TensorProto]] | None  # read_model's `keep`


def read_model(source: ModelSource, keep: Kept = None,
               opened: tuple[BinaryIO, os.stat_result] | None = None) -> tuple[onnx.ModelProto, Path | None]:
    """Parse `source` and inline its external data; returns the proto and the folder it was read from, resolved
    here once for every external data check (external_data.confined_path). A model given as bytes or a ModelProto
    has no folder, so external data in it is refused (see external_data.py).
    `keep`: the tensors whose external data stays where it is, checked, for an ExternalValues of the folder to
    read: `state_tensors` (those with_state replaces on export), or `every_tensor` (a checkpoint's reader, which
    needs the state alone, so reads no other weight).
    `opened`: the file at the path `source`, opened and its status (external_data.open_regular_file) by a caller
    that read its first bytes (store.load_checkpoint, telling a model from an archive): read from its start
    here, not opened again."""
    if isinstance(source, onnx.ModelProto):
        inline_external_data(source, None)
        return source, None
    folder = None
    hint = ""
    if isinstance(source, (bytes, bytearray)):
        data, what = bytes(source), "the given bytes"
        if len(data) < 4096 and data.rstrip().endswith(b".onnx"):  # os.fsencode(path) is no path here
            hint = "; bytes are a model's contents: give its path as a str or a pathlib.Path"
    elif not isinstance(source, (str, os.PathLike)):
        raise ModelLoadError(f"a model is a path, bytes or an onnx.ModelProto, not {type(source).__name__}")
    else:
        path = Path(source)
        what = f"file {str(path)!r}"
        if not os.path.lexists(path) and (missing := shell_path_hint(str(path))):
            raise ModelLoadError(f"model {what} does not exist: {missing}")
        data = read_model_file(path, what, opened)
        folder = path.resolve().parent
        if path.suffix == ".data":  # torch.onnx.export's and onnxtrain's external data files end so
            hint = "; it looks like the external data file of a model: load the .onnx file that references it"
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise ModelLoadError(f"{what} is not an ONNX model (protobuf parse failed: {exc}){hint}") from exc
    if model.ir_version <= 0 or not model.HasField("graph"):
        raise ModelLoadError(f"{what} is not an ONNX model (no ir_version or graph){hint}")
    inline_external_data(model, folder, keep(model) if keep else ())
    return model, folder


def state_tensors(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    """The initializer of each state variable (state.bindings.binding_owners) that is the only initializer of its
    name: the tensors export.with_state replaces, so the engine's proto never needs their bytes once they are on
    the device."""
    count = Counter(t.name for g in initializer_graphs(model) for t in g.initializer)
    owners = binding_owners(model)
    return [t for owner, graph in owner_graphs(model).items() for t in graph.initializer
            if owners.get(t.name, -1) == owner and count[t.name] == 1]


def every_tensor(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    return (tensor for _, tensor in model_tensors(model))


def same_file(a: Path, b: Path) -> bool:
    """Whether `a` and `b` name one existing file (through links too)."""
    return a.exists() and b.exists() and os.path.samefile(a, b)


@dataclass(frozen=True)
class StateFile:
    """The model file an engine read, where the initial values of its state variables stay instead of in memory
    (`load(path)`): `reset`, and the rebuild after a failed first step, read them there again. `checksums`: the
    CRC-32 of each variable's bytes when loaded; a file whose bytes differ since is refused, not trained from."""

    path: Path
    checksums: Mapping[str, int]

    def is_file(self, path: Path) -> bool:
        """Whether `path` names this file (through links too)."""
        return same_file(path, self.path)

    def read(self) -> onnx.ModelProto:
        model, _ = read_model(self.path, keep=state_tensors)
        held = {t.name: t for g in initializer_graphs(model) for t in g.initializer if t.name in self.checksums}
        changed = sorted(n for n, crc in self.checksums.items()
                         if n not in held or not held[n].HasField("raw_data") or zlib.crc32(held[n].raw_data) != crc)
        if changed:
            raise ModelLoadError(
                f"file {str(self.path)!r} no longer holds the initial state it was loaded with ({changed[:5]} "
                f"differ): the engine reads the state's initial values there for reset() and to recover from a "
                "failed first step; load the model again")
        return model


def shell_path_hint(path: str) -> str:
    """What a shell would have made of a path that does not exist, where that one exists or may: a leading '~'
    (expanded by shells, not by open()), white space around it (a line read from a file)."""
    if path.startswith("~"):
        return f"'~' is expanded by shells, not here: os.path.expanduser gives {os.path.expanduser(path)!r}"
    if path != path.strip() and os.path.exists(path.strip()):
        return f"it has white space around it, and {path.strip()!r} exists"
    return ""


def read_model_file(path: Path, what: str, opened: tuple[BinaryIO, os.stat_result] | None = None) -> bytes:
    """The bytes of a model file: a regular file no larger than a protobuf message can be (`opened`: read_model's)."""
    if "\0" in str(path):
        raise ModelLoadError(f"model path {str(path)!r} contains a NUL byte")
    file, info = opened or open_regular_file(path, ModelLoadError, f"model {what}")
    size = info.st_size
    with file:
        file.seek(0)  # an `opened` file was read from already
        if size > PROTOBUF_LIMIT:
            raise ModelLoadError(
                f"model {what} has {size} bytes, more than a protobuf message can hold ({PROTOBUF_LIMIT}); "
                "keep large weights in external data"
            )
        return file.read(PROTOBUF_LIMIT + 1)


def check_model(model: onnx.ModelProto) -> None:
    """onnx.checker on the model. The in-memory checker serializes the whole model and parses it again in C++
    (two transient copies of the weights; BERT-base: 1.8 s of a 2.7 s load) and cannot past 2 GiB, so a model
    with more than SKELETON_CHECK_BYTES of weights, or with state kept in external data (read_model's
    `keep`), is checked as a skeleton whose weights are external references: the checker reads their names,
    types and dims, and tensor_data.py (external_data.py) checks every weight's bytes against its dims when it
    is decoded (read)."""
    try:
        if weight_bytes(model) > big_models.SKELETON_CHECK_BYTES or holds_external(model):
            check_skeleton(model)
        else:
            onnx.checker.check_model(model)
    except (onnx.checker.ValidationError, ValueError) as exc:
        raise ModelLoadError(f"onnx.checker rejected the model: {exc}") from exc
