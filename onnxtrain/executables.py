"""Compiled programs kept on disk, so a later process runs a model's step without tracing its graph again.

JAX's persistent compilation cache (cache.py) saves XLA's compile, but a new process still traces the graph to
find the program's cache key: on the 2-core CPU the trace and its lowering were 1.9 of MobileNetV3-small's 2.9 s
warm first train step and 1.3 of BERT-base's 3-4 s. This store keys the executable on what the trace would read
instead: the model without its state's values (those are arguments of the program, never read by the trace),
the engine's options, onnxtrain's own source, JAX's version and configuration, the device, and the signature of
the arguments. A hit loads the executable and what its trace had noted (host-only outputs, facts the engine
keeps); anything unexpected in a file (truncated, another version's) is a miss, and the program is traced,
compiled and stored again.

The files are in a folder of the user's cache, beside JAX's, and are trusted as JAX's are: a serialized
executable is native code, and JAX serializes it with pickle.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import pickle
import re
import time
from pathlib import Path
from typing import Any, Iterator, Mapping, NamedTuple

import jax
import onnx
from jax.experimental import serialize_executable

from .atomic import replace_atomically, unlink_quietly
from .big_models import initializer_graphs, lean_copy

FOLDER = "onnxtrain-programs"  # inside the compilation cache folder
# The store's size: past it, the programs least recently used go (each new onnxtrain version, and each model,
# option and feed shape, adds its own; a real-size model's train step is 1-5 MB)
MAX_BYTES = 2**30
FORMAT = b"onnxtrain-program-1"


@functools.cache
def source_digest() -> bytes:
    """onnxtrain's own code: a program traced by another version of it may differ."""
    digest = hashlib.sha256()
    package = Path(__file__).parent
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    return digest.digest()


# what a tensor's values are stored in, besides raw_data (which lean_copy leaves out)
VALUE_FIELDS = ("float_data", "int32_data", "string_data", "int64_data", "double_data", "uint64_data",
                "external_data", "data_location")


def model_digest(model: onnx.ModelProto, arguments: set[str]) -> bytes:
    """The model as far as a trace reads it: without the values of the initializers in `arguments` (they reach a
    program as arguments: a checkpoint exported after training has the same programs) and without its metadata
    (the train step count an export writes there is an argument too)."""
    lean = lean_copy(model, lambda tensor: tensor.name in arguments)
    for graph in initializer_graphs(lean):
        for tensor in graph.initializer:
            if tensor.name in arguments:
                for field in VALUE_FIELDS:
                    tensor.ClearField(field)
    lean.ClearField("metadata_props")
    return hashlib.sha256(lean.SerializeToString(deterministic=True)).digest()


def _compile_time_threshold() -> Any:
    """JAX's threshold of compile time below which its persistent cache writes nothing, as a setting that can be
    changed for one thread (JAX's internals: None where they moved)."""
    try:
        from jax._src import config

        return config.persistent_cache_min_compile_time_secs
    except (ImportError, AttributeError):
        return None


COMPILE_TIME_THRESHOLD = _compile_time_threshold()


@contextlib.contextmanager
def jax_cache_unwritten() -> Iterator[None]:
    """Compiles in this thread write nothing to JAX's persistent cache for the span: a program the store keeps is
    then serialized and kept on disk once, and JAX's cache never serves it (see `ExecutableStore.entry`). Where
    JAX's internals moved, nothing changes here, and engines keep no store (engine.py)."""
    if COMPILE_TIME_THRESHOLD is None:
        yield
        return
    with COMPILE_TIME_THRESHOLD(float("inf")):
        yield


class Entry(NamedTuple):
    path: Path
    module: str  # the name of the program's XLA module


class Loaded(NamedTuple):
    executable: jax.stages.Compiled
    host_outputs: dict[str, Any]
    notes: dict[str, Any]


class ExecutableStore:
    """The store of one engine's programs: `fingerprint` says everything but the arguments' signature and
    onnxtrain's own sources (the store adds those)."""

    def __init__(self, folder: Path, fingerprint: bytes, device: jax.Device):
        self.folder = folder / FOLDER
        self.fingerprint = fingerprint
        self.device = device

    def entry(self, program: str, args: tuple) -> Entry:
        """The file of `program` for `args`' signature, and its module name, which JAX's persistent cache keys on:
        unique to this version of onnxtrain too, because an executable JAX read from its cache serializes without
        its kernels (XLA-CPU, jaxlib 0.10.2: "Function ... not found" once loaded in another process). Were the
        name shared across versions, a new version would find each program in JAX's cache (written there by an
        older onnxtrain), could never store it, and would trace it in every process."""
        leaves, tree = jax.tree.flatten(args)
        digest = hashlib.sha256(FORMAT + self.fingerprint + program.encode() + str(tree).encode())
        for leaf in leaves:
            digest.update(str(jax.typeof(leaf)).encode() + b";")
        name = hashlib.sha256(source_digest() + digest.digest()).hexdigest()
        return Entry(self.folder / f"{name}.program", f"onnxtrain_{name[:16]}")

    def load(self, entry: Entry) -> Loaded | None:
        try:
            with open(entry.path, "rb") as stream:
                payload, in_tree, out_tree, host_outputs, notes = pickle.load(stream)
            executable = serialize_executable.deserialize_and_load(
                payload, in_tree, out_tree, backend=self.device.client, execution_devices=[self.device])
        except FileNotFoundError:
            return None
        except Exception:  # noqa: BLE001 - a damaged or foreign file is a miss: the program is traced again
            unlink_quietly(entry.path)
            return None
        with contextlib.suppress(OSError):  # used now: the last to go when the store is pruned
            os.utime(entry.path)
        return Loaded(executable, host_outputs, notes)

    def save(self, entry: Entry, executable: jax.stages.Compiled, host_outputs: Mapping[str, Any],
             notes: Mapping[str, Any]) -> None:
        """Best effort: a program that cannot be serialized, or a folder that cannot be written, only costs a
        later process the trace."""
        try:
            payload, in_tree, out_tree = serialize_executable.serialize(executable)
            data = pickle.dumps((payload, in_tree, out_tree, dict(host_outputs), dict(notes)))
            self.folder.mkdir(parents=True, exist_ok=True)
            replace_atomically(entry.path, lambda stream: stream.write(data), durable=False)
            pruned_once(self.folder)
        except (ValueError, NotImplementedError, OSError, pickle.PicklingError, jax.errors.JaxRuntimeError):
            return


def self_contained(lowered: jax.stages.Lowered) -> bool:
    """Whether the program `lowered` calls no kernel outside XLA: a kernel of jaxlib's (LAPACK's `lapack_*_ffi`
    for a determinant or a solve) is set up by the trace that lowers to it, and an executable read without that
    trace called it unset: a segmentation fault. Such a program is left to JAX's cache, which a trace reads."""
    return not re.search(r"custom_call @(?!__)", lowered.as_text())


@functools.cache
def pruned_once(folder: Path) -> None:
    """`prune` at the first program a process stores: a scan of the folder per program would cost a test suite's
    thousands of them more than storing them; what one process adds past the limit goes in the next."""
    prune(folder, MAX_BYTES)


def prune(folder: Path, limit: int, now: float | None = None) -> None:
    """Remove the least recently used programs of `folder` until the rest fit in `limit` bytes, and the staging
    files of writes killed over an hour ago."""
    now = time.time() if now is None else now
    files = []
    for entry in os.scandir(folder):
        stat = entry.stat()
        if entry.name.endswith(".program"):
            files.append((stat.st_mtime, stat.st_size, Path(entry.path)))
        elif entry.name.endswith(".tmp") and stat.st_mtime < now - 3600:
            unlink_quietly(Path(entry.path))
    total = sum(size for _, size, _ in files)
    for _, size, path in sorted(files):
        if total <= limit:
            return
        unlink_quietly(path)
        total -= size
