"""Writing checkpoints and exports: exact paths, atomic replacement, strict and safe reading, external data
(which tensors go there, when it is chosen, what is left behind), models past protobuf's limit (simulated by
shrinking the limit)."""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import threading

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import ExternalDataInfo, uses_external_data

import onnxtrain
import onnxtrain.atomic
import onnxtrain.big_models
import onnxtrain.export
import onnxtrain.external_data
from onnxtrain.errors import ExportError, ModelLoadError, StateError
from onnxtrain.state.store import save_npz
from test_export import T, X, trained  # an MLP trained with Adam for `steps` steps on (X, T)

RNG = np.random.default_rng(5)


def host_state(engine: onnxtrain.Engine) -> dict[str, np.ndarray]:
    return {name: np.array(value) for name, value in engine.state.items()}


def assert_same_state(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        np.testing.assert_array_equal(actual[name], expected[name], err_msg=name)


# ----- save_state / load_state -----

def test_save_state_writes_exactly_the_given_path(tmp_path):
    """No suffix is appended: `ckpt` is written and read back, even over an older file named `ckpt`."""
    path = tmp_path / "ckpt"
    trained(1).save_state(path)
    source = trained(3)
    source.save_state(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    resumed = trained(0)
    resumed.load_state(path)
    assert resumed.step_count == 3
    assert_same_state(host_state(resumed), host_state(source))


@pytest.mark.parametrize("through_link", [False, True], ids=["the file", "a link to it"])
def test_save_state_over_the_loaded_model_is_refused_and_the_model_kept(tmp_path, through_link):
    """An .npz holds no graph: written over the file the engine was loaded from, the model would be gone (and
    reset, which reads its initial state there, with it)."""
    path = tmp_path / "model.onnx"
    onnx.save(onnx.load_from_string(trained(0).model.SerializeToString()), path)
    original = path.read_bytes()
    engine = onnxtrain.load(path)
    engine.train_step({"X": X, "Target": T})
    target = path
    if through_link:
        target = tmp_path / "link.onnx"
        target.symlink_to(path)
    with pytest.raises(StateError, match=r"the model this engine was loaded from.*export\(path\)"):
        engine.save_state(target)
    assert path.read_bytes() == original
    engine.reset()
    assert_same_state(host_state(engine), host_state(onnxtrain.load(path)))


def test_a_folder_as_the_target_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """Naming a folder where a file goes failed at the rename, after the whole checkpoint or model (and its
    data file) had been written; now it is refused first, and the folder is left as it was."""
    engine = trained(1)
    target = tmp_path / "runs"
    target.mkdir()
    (target / "kept.txt").write_text("mine")
    written = []
    monkeypatch.setattr(onnxtrain.export, "write_durably", lambda *args, **kwargs: written.append(args))
    with pytest.raises(StateError, match="cannot write state checkpoint .*it is a folder; name the file in it"):
        engine.save_state(target)
    with pytest.raises(ExportError, match="cannot write model .*it is a folder; name the file in it"):
        engine.export(target, external_data=True)
    assert written == [] and sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
    assert sorted(p.name for p in target.iterdir()) == ["kept.txt"]


def test_a_missing_folder_is_named_before_anything_is_written(tmp_path, monkeypatch):
    """A checkpoint or model in a folder that does not exist: refused naming the folder, nothing serialized."""
    engine = trained(1)
    missing = tmp_path / "runs" / "today"
    serialized = []
    monkeypatch.setattr(onnxtrain.state.store.np, "savez", lambda *args, **kwargs: serialized.append(args))
    with pytest.raises(StateError, match=f"state checkpoint .*: folder {re.escape(repr(str(missing)))} does not exist"):
        engine.save_state(missing / "ckpt.npz")
    with pytest.raises(ExportError, match=f"model .*: folder {re.escape(repr(str(missing)))} does not exist"):
        engine.export(missing / "model.onnx")
    assert serialized == [] and list(tmp_path.iterdir()) == []


def test_a_read_only_folder_is_named_before_anything_is_written_or_trained(tmp_path, monkeypatch, capsys):
    """A read-only mount (or a folder without write permission: root passes that one, so access() is faked here)
    was found by the staging file's open() at the first checkpoint: `train -o` ran all its steps, then lost them."""
    from onnxtrain.cli import main

    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kwargs: (os.fspath(path) != os.fspath(locked) or
                                                                     not mode & os.W_OK) and real_access(path, mode))
    engine = trained(1)
    folder = re.escape(repr(str(locked)))
    with pytest.raises(StateError, match=f"cannot write state checkpoint .*: folder {folder} is not writable"):
        engine.save_state(locked / "ckpt.npz")
    with pytest.raises(ExportError, match=f"cannot write model .*: folder {folder} is not writable"):
        engine.export(locked / "m.onnx")
    with pytest.raises(ExportError, match=f"cannot write model .*: folder {folder} is not writable"):
        onnxtrain.fit(engine, [{"X": X, "Target": T}] * 3, steps=3, progress=False, checkpoint=locked / "m.onnx")
    assert engine.step_count == 1  # refused before its first step
    np.savez(tmp_path / "data.npz", X=X, Target=T)
    engine.export(tmp_path / "model.onnx")
    assert main(["train", str(tmp_path / "model.onnx"), "--data", str(tmp_path / "data.npz"), "--steps", "2",
                 "-o", str(locked / "out.onnx")]) == 2
    assert f"folder {str(locked)!r} is not writable" in capsys.readouterr().err
    assert list(locked.iterdir()) == []


def test_a_path_with_a_nul_byte_is_refused_before_anything_is_written(tmp_path):
    """The OS cannot name such a file: it was a raw ValueError from open(), and the cleanup's unlink raised another."""
    engine = trained(1)
    with pytest.raises(StateError, match=r"cannot write state checkpoint .*a\\x00b'.*contains a NUL byte"):
        engine.save_state(str(tmp_path / "a\0b"))
    with pytest.raises(ExportError, match=r"cannot write model .*a\\x00b.onnx'.*contains a NUL byte"):
        engine.export(str(tmp_path / "a\0b.onnx"))
    assert list(tmp_path.iterdir()) == []


def test_save_state_fsyncs_the_file_and_its_folder(tmp_path, monkeypatch):
    kinds = []
    real_fsync = os.fsync

    def recording_fsync(descriptor):
        kinds.append("folder" if stat.S_ISDIR(os.fstat(descriptor).st_mode) else "file")
        real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    trained(1).save_state(tmp_path / "state.npz")
    assert kinds == ["file", "folder"]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names an open file through /proc/self/fd")
def test_export_with_external_data_has_the_data_file_on_disk_before_the_model_names_it(tmp_path, monkeypatch):
    """The commit order of an export with external data: the data file written and fsync'ed, its folder entry
    fsync'ed, then the model file's, renamed in, and the rename fsync'ed. The data file's entry had reached the disk
    only with the folder's fsync after the rename: a power loss between (the rename persisted first, as a file
    system may) left the model naming a missing file. A power loss cannot be tested: the calls' order is."""
    monkeypatch.setattr(onnxtrain.big_models, "INLINE_BYTES", 0)
    engine = trained(1)
    calls = []
    real_fsync, real_replace = os.fsync, os.replace

    def recording_fsync(descriptor):
        opened = os.readlink(f"/proc/self/fd/{descriptor}")
        calls.append(("fsync", "folder" if stat.S_ISDIR(os.fstat(descriptor).st_mode) else os.path.basename(opened)))
        real_fsync(descriptor)

    def recording_replace(source, target):
        calls.append(("replace", os.path.basename(target)))
        real_replace(source, target)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    engine.export(tmp_path / "m.onnx", external_data=True)
    monkeypatch.undo()
    (data_file,) = [name for name in os.listdir(tmp_path) if name.endswith(".data")]
    assert [(call, re.sub(r"\.[0-9a-f]{16}\.tmp$", ".TOKEN.tmp", name)) for call, name in calls] == [
        ("fsync", data_file), ("fsync", "folder"), ("fsync", ".m.onnx.TOKEN.tmp"), ("replace", "m.onnx"),
        ("fsync", "folder")]
    assert locations(tmp_path / "m.onnx") and set(locations(tmp_path / "m.onnx").values()) == {data_file}


def test_failed_save_state_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "state.npz"
    previous = trained(2)
    previous.save_state(path)

    def savez_then_disk_full(file, *args, **kwargs):  # writes a torn archive wherever it is pointed, then fails
        target = open(file, "wb") if isinstance(file, (str, os.PathLike)) else file
        target.write(b"PK\x03\x04 torn")
        target.flush()
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", savez_then_disk_full)
    with pytest.raises(StateError, match="disk full"):
        trained(5).save_state(path)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.npz"]
    resumed = trained(0)
    resumed.load_state(path)
    assert resumed.step_count == 2
    assert_same_state(host_state(resumed), host_state(previous))


def test_load_state_refuses_a_checkpoint_that_does_not_fit_and_keeps_the_state(tmp_path):
    engine = trained(2)
    state = host_state(engine)
    partial = {name: value for name, value in state.items() if name != "W2"}
    partial["B1"] = np.zeros(9, np.float32)  # the model's B1 has 8 values
    partial["extra"] = np.zeros(2, np.float32)
    save_npz(tmp_path / "partial.npz", partial, {"step": 7})
    with pytest.raises(StateError) as caught:
        engine.load_state(tmp_path / "partial.npz")
    message = str(caught.value)
    assert "partial.npz" in message and "['W2']" in message and "['extra']" in message
    assert "'B1' is float32[9]" in message
    assert engine.step_count == 2
    assert_same_state(host_state(engine), state)


@pytest.mark.parametrize("step", [-1, True])
def test_load_state_refuses_a_step_count_that_is_no_count(tmp_path, step):
    """A checkpoint of this model whose step is -1 had been loaded, and the next train_step raised OverflowError
    putting it on the device as a uint32."""
    engine = trained(1)
    state = host_state(engine)
    save_npz(tmp_path / "c.npz", state, {"step": step})
    with pytest.raises(StateError, match="c.npz' is damaged.*non-negative integer 'step'"):
        engine.load_state(tmp_path / "c.npz")
    assert engine.step_count == 1
    assert_same_state(host_state(engine), state)


def test_a_step_count_past_uint32_trains_on(tmp_path):
    """The device's step counter (a uint32, the seed of the random streams) wraps; the count itself is kept."""
    engine = trained(1)
    save_npz(tmp_path / "c.npz", host_state(engine), {"step": 2**32 + 5})
    engine.load_state(tmp_path / "c.npz")
    engine.train_step({"X": X, "Target": T})
    assert engine.step_count == 2**32 + 6


def header(dtypes, meta) -> np.ndarray:
    return np.frombuffer(json.dumps({"dtypes": dtypes, "meta": meta}).encode(), np.uint8)


def write_truncated(path, good: bytes) -> None:
    path.write_bytes(good[: len(good) // 2])


def write_bad_crc(path, good: bytes) -> None:
    """One bit of W1 flipped: the archive is stored uncompressed, so its bytes appear as they are."""
    damaged = bytearray(good)
    damaged[good.index(np.load(path.with_name("good.npz"))["W1"].tobytes())] ^= 1
    path.write_bytes(bytes(damaged))


def write_npz(**arrays):
    def write(path, good: bytes) -> None:
        with open(path, "wb") as stream:
            np.savez(stream, **arrays)
    return write


def write_npy(path, good: bytes) -> None:
    with open(path, "wb") as stream:
        np.save(stream, np.zeros(3))


DAMAGED = {
    "truncated": write_truncated,
    "not an archive": lambda path, good: path.write_bytes(b"not a zip file at all"),
    "npy not npz": write_npy,
    "bad crc": write_bad_crc,
    "header not json": write_npz(__onnxtrain__=np.frombuffer(b"{not json", np.uint8)),
    "header lacks dtypes": write_npz(__onnxtrain__=np.frombuffer(b'{"meta": {}}', np.uint8)),
    "header dtypes is a list": write_npz(__onnxtrain__=header(["W1"], {})),
    "step is a string": write_npz(__onnxtrain__=header({}, {"step": "7"})),
    "array missing": write_npz(__onnxtrain__=header({"W1": "float32"}, {"step": 1})),
    "unknown dtype": write_npz(__onnxtrain__=header({"W1": "float33"}, {}), W1=np.zeros((4, 8), np.float32)),
}


@pytest.mark.parametrize("damage", DAMAGED.values(), ids=DAMAGED.keys())
def test_damaged_checkpoint_raises_state_error_naming_the_file(tmp_path, damage):
    engine = trained(1)
    engine.save_state(tmp_path / "good.npz")
    state = host_state(engine)
    path = tmp_path / "damaged.npz"
    damage(path, (tmp_path / "good.npz").read_bytes())
    with pytest.raises(StateError, match="damaged.npz"):
        engine.load_state(path)
    assert engine.step_count == 1
    assert_same_state(host_state(engine), state)


def exported(change):
    """A damage of the good export: `change` applied to its model proto, which is saved in place."""
    def write(path, good: bytes) -> None:
        model = onnx.load_from_string(good)
        change(model)
        onnx.save(model, path)
    return write


def shorten_w1(model: onnx.ModelProto) -> None:
    tensor = next(t for t in model.graph.initializer if t.name == "W1")
    tensor.raw_data = tensor.raw_data[:-4]


def escape_folder(model: onnx.ModelProto) -> None:
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "../" + entry.value


DAMAGED_EXPORTS = {
    "truncated": write_truncated,
    "step is no count": exported(lambda m: m.metadata_props.add(key="onnxtrain.step", value="-1")),
    "state tensor short": exported(shorten_w1),
    "external data outside the folder": exported(escape_folder),
}


@pytest.mark.parametrize("damage", DAMAGED_EXPORTS.values(), ids=DAMAGED_EXPORTS.keys())
def test_damaged_exported_checkpoint_raises_state_error_naming_the_file(tmp_path, monkeypatch, damage):
    """load_state reads an exported model (fit's checkpoints) as strictly as an .npz, external data as `load`
    reads it: confined to the model's folder. The export escaping it keeps its weights in external data (a copy in
    the folder above, where the escaping location would find them)."""
    monkeypatch.setattr(onnxtrain.big_models, "INLINE_BYTES", 0)
    engine = trained(1)
    (tmp_path / "good").mkdir()
    engine.export(tmp_path / "good" / "good.onnx", external_data=damage is DAMAGED_EXPORTS["external data outside "
                                                                                          "the folder"])
    for data in (tmp_path / "good").glob("*.data"):
        (tmp_path / data.name).write_bytes(data.read_bytes())
    state = host_state(engine)
    path = tmp_path / "good" / "damaged.onnx"
    damage(path, (tmp_path / "good" / "good.onnx").read_bytes())
    with pytest.raises(StateError, match="damaged.onnx"):
        engine.load_state(path)
    assert engine.step_count == 1
    assert_same_state(host_state(engine), state)


def test_load_state_reads_an_export_with_external_data(tmp_path, monkeypatch):
    monkeypatch.setattr(onnxtrain.big_models, "INLINE_BYTES", 0)
    source = trained(3)
    source.export(tmp_path / "ckpt.onnx", external_data=True)
    assert uses_external_data(next(t for t in onnx.load(tmp_path / "ckpt.onnx", load_external_data=False)
                                   .graph.initializer if t.name == "W1"))
    engine = trained(1)
    engine.load_state(tmp_path / "ckpt.onnx")
    assert engine.step_count == 3
    assert_same_state(host_state(engine), host_state(source))


def test_load_state_of_an_export_opens_it_once(tmp_path, monkeypatch):
    """load_state reads a checkpoint's first bytes to tell an .npz from an exported model, and the model from that
    same open file: it had opened the file a second time to read the model."""
    source = trained(2)
    source.export(tmp_path / "ckpt.onnx")
    opened = []
    real_open_if_regular = onnxtrain.external_data.open_if_regular
    monkeypatch.setattr(onnxtrain.external_data, "open_if_regular",
                        lambda path: (opened.append(str(path)), real_open_if_regular(path))[1])
    engine = trained(1)
    engine.load_state(tmp_path / "ckpt.onnx")
    assert opened.count(str(tmp_path / "ckpt.onnx")) == 1
    assert engine.step_count == 2
    assert_same_state(host_state(engine), host_state(source))


def test_load_state_refuses_what_is_not_a_regular_zip_file_without_reading_it(tmp_path):
    """A FIFO blocked np.load forever; /dev/zero and other non-archives got NumPy's advice to allow pickles."""
    engine = trained(1)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "plain").write_bytes(b"\0" * 64)
    for path, message in [(tmp_path / "fifo", "/fifo' is not a regular file"),
                          (tmp_path / "plain", r"/plain' is not an onnxtrain state checkpoint \(not an .npz"),
                          (tmp_path, "is not a regular file"),
                          (tmp_path / "missing", "/missing' cannot be read: No such file")]:
        with pytest.raises(StateError, match=message):
            engine.load_state(path)
    assert engine.step_count == 1


# ----- export -----

def regression_model(width: int = 64) -> onnx.ModelProto:
    """Y = Reshape(X @ W, shape) + B: W is a weight past INLINE_BYTES, `shape` an int64 shape tensor that ONNX
    Runtime reads while loading, B a small weight."""
    rng = np.random.default_rng(0)
    weights = {
        "W": rng.normal(size=(8, width)).astype(np.float32),
        "shape": np.array([-1, width // 4, 4], np.int64),
        "B": rng.normal(size=(4,)).astype(np.float32),
    }
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["XW"]), helper.make_node("Reshape", ["XW", "shape"], ["R"]),
         helper.make_node("Add", ["R", "B"], ["Y"])],
        "regression",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["rows", width // 4, 4])],
        [numpy_helper.from_array(v, n) for n, v in weights.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def reference_output(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    return (x @ weights["W"]).reshape(weights["shape"]) + weights["B"]


def onnxruntime_output(path, x: np.ndarray) -> np.ndarray:
    ort = pytest.importorskip("onnxruntime")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {"X": x})[0]


def data_files(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".data"))


def locations(path) -> dict[str, str]:
    """tensor name -> external data file, for the tensors of every graph stored outside the model file."""
    model = onnx.load(path, load_external_data=False)
    graphs = [model.graph] + [g for i in model.training_info for g in (i.initialization, i.algorithm)]
    return {t.name: ExternalDataInfo(t).location for g in graphs for t in g.initializer if uses_external_data(t)}


@pytest.mark.parametrize("inline_bytes", [1024, 0])
def test_external_data_keeps_small_and_shape_tensors_inline_for_onnxruntime(tmp_path, monkeypatch, inline_bytes):
    monkeypatch.setattr(onnxtrain.big_models, "INLINE_BYTES", inline_bytes)
    model = regression_model()
    onnxtrain.load(model).export(tmp_path / "m.onnx", external_data=True)
    expected_external = {"W"} if inline_bytes else {"W", "B"}  # 2 KiB W; 16-byte B; int64 shape never
    (data_file,) = data_files(tmp_path)
    assert locations(tmp_path / "m.onnx") == dict.fromkeys(expected_external, data_file)
    x = RNG.normal(size=(3, 8)).astype(np.float32)
    np.testing.assert_allclose(onnxruntime_output(tmp_path / "m.onnx", x), reference_output(model, x), rtol=1e-5)


def test_repeated_external_export_in_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(onnxtrain.big_models, "INLINE_BYTES", 0)
    engine = trained(1)
    engine.export("m.onnx", external_data=True)
    first = data_files(tmp_path)
    engine.train_step({"X": X, "Target": T})
    engine.export("m.onnx", external_data=True)
    second = data_files(tmp_path)
    assert len(first) == len(second) == 1 and first != second  # the previous pair's data file is gone
    assert set(locations("m.onnx").values()) == set(second)
    graphs = [engine.model.graph] + [engine.model.training_info[0].algorithm]
    floats = {t.name for g in graphs for t in g.initializer if t.data_type != TensorProto.INT64}
    assert len(floats) == 13 and set(locations("m.onnx")) == floats  # weights, moments, rate; not step count T
    reloaded = onnxtrain.load("m.onnx")
    assert reloaded.step_count == 2
    assert_same_state(host_state(reloaded), host_state(engine))


def test_export_removes_leftovers_of_killed_exports_to_the_same_path_only(tmp_path):
    leftovers = [".m.onnx.0123456789abcdef.tmp", "m.onnx.fedcba9876543210.data", "m.onnx.data"]
    unrelated = ["other.onnx.0123456789abcdef.data", ".other.onnx.0123456789abcdef.tmp", "m.onnx.notes",
                 "m.onnx.0123.data"]
    for name in leftovers + unrelated:
        (tmp_path / name).write_bytes(b"x")
    trained(1).export(tmp_path / "m.onnx", external_data=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(unrelated + ["m.onnx"])  # MLP: all inline


def test_export_keeps_a_data_file_another_model_of_the_folder_references(tmp_path, monkeypatch):
    """torch.onnx.export's pair `m.onnx` + `m.onnx.data`, and `copy.onnx`, a copy of `m.onnx` that references the
    same data file: an export over `m.onnx` had removed `m.onnx.data`, and `copy.onnx` lost its weights. The same
    for a copy of an external-data export (its `m.onnx.<hex>.data`). A data file no model references still goes."""
    monkeypatch.setattr(onnxtrain.big_models, "INLINE_BYTES", 0)
    model = regression_model()
    onnx.save_model(model, tmp_path / "m.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
                    location="m.onnx.data", size_threshold=1024)  # W: 2 KiB
    (tmp_path / "copy.onnx").write_bytes((tmp_path / "m.onnx").read_bytes())
    engine = onnxtrain.load(tmp_path / "m.onnx")
    engine.export(tmp_path / "m.onnx", external_data=True)
    (ours,) = set(data_files(tmp_path)) - {"m.onnx.data"}
    (tmp_path / "copy2.onnx").write_bytes((tmp_path / "m.onnx").read_bytes())
    engine.export(tmp_path / "m.onnx", external_data=True)
    assert ours in data_files(tmp_path) and "m.onnx.data" in data_files(tmp_path)
    x = RNG.normal(size=(3, 8)).astype(np.float32)
    expected = reference_output(regression_model(), x)  # (save_model moved `model`'s W out)
    for copy in ("copy.onnx", "copy2.onnx"):
        np.testing.assert_allclose(onnxruntime_output(tmp_path / copy, x), expected, rtol=1e-5)
    (tmp_path / "copy.onnx").unlink()
    (tmp_path / "copy2.onnx").unlink()
    engine.export(tmp_path / "m.onnx")  # in one file now: no model references any data file
    assert data_files(tmp_path) == []


def test_export_skips_a_fifo_put_in_the_folder_as_another_model(tmp_path, monkeypatch):
    """A FIFO named `other.onnx`, there at the scan for models referencing stale data files or swapped in after
    it (the scan's is_file() made True here): a plain open() of it blocked the export until a writer came."""
    os.mkfifo(tmp_path / "other.onnx")
    (tmp_path / "m.onnx.data").write_bytes(b"x")  # a stale data file: the scan runs
    scandir = os.scandir

    class Swapped:  # the DirEntry as is_file() saw it before the swap
        def __init__(self, entry):
            self.name, self.path = entry.name, entry.path

        def is_file(self) -> bool:
            return True

    monkeypatch.setattr(os, "scandir", lambda folder=".": [Swapped(e) for e in scandir(folder)]
                        if os.fspath(folder) == os.fspath(tmp_path) else scandir(folder))
    engine = trained(1)
    export = threading.Thread(target=engine.export, args=(tmp_path / "m.onnx",), daemon=True)
    export.start()
    export.join(30)
    if export.is_alive():  # unblock it (a writer opens the FIFO), then fail
        os.close(os.open(tmp_path / "other.onnx", os.O_WRONLY | os.O_NONBLOCK))
        export.join()
        pytest.fail("export blocked opening the FIFO other.onnx")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "other.onnx"]
    assert onnxtrain.load(tmp_path / "m.onnx").step_count == 1


def interrupted_as_the_rename_returns(monkeypatch, path) -> None:
    """Ctrl-C's KeyboardInterrupt as os.replace returns from renaming the model file in: where Python runs the
    handler of a SIGINT that came during the fsync or the rename (8-16 of 160-185 Ctrl-Cs timed at random)."""
    real_replace = os.replace

    def replace_then_interrupt(source, target):
        real_replace(source, target)
        if os.fspath(target) == os.fspath(path):
            raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", replace_then_interrupt)


def failing_folder_fsync(failure: BaseException):
    def install(monkeypatch, path) -> None:
        def fail(folder):
            raise failure

        monkeypatch.setattr(onnxtrain.atomic, "fsync_folder", fail)
    return install


AFTER_THE_COMMIT = {"fsync fails": (failing_folder_fsync(OSError(errno.EIO, "Input/output error")), ExportError),
                    "ctrl-c at the fsync": (failing_folder_fsync(KeyboardInterrupt()), KeyboardInterrupt),
                    "ctrl-c as the rename returns": (interrupted_as_the_rename_returns, KeyboardInterrupt)}


@pytest.mark.parametrize("failure, expected", AFTER_THE_COMMIT.values(), ids=AFTER_THE_COMMIT.keys())
def test_a_failure_after_the_commit_point_keeps_the_new_models_data_file(tmp_path, monkeypatch, failure, expected):
    """A failure once the model file was renamed in had the export remove the new data file as a failed export's,
    and `m.onnx` named a missing file, neither old nor new."""
    monkeypatch.setattr(onnxtrain.big_models, "INLINE_BYTES", 0)
    trained(1).export(tmp_path / "m.onnx", external_data=True)
    engine = trained(2)
    failure(monkeypatch, tmp_path / "m.onnx")
    with pytest.raises(expected, match="the new model file is in place" if expected is ExportError else None):
        engine.export(tmp_path / "m.onnx", external_data=True)
    monkeypatch.undo()
    onnx.checker.check_model(str(tmp_path / "m.onnx"))
    reloaded = onnxtrain.load(tmp_path / "m.onnx")
    assert reloaded.step_count == 2
    assert_same_state(host_state(reloaded), host_state(engine))


def test_export_over_a_symlink_replaces_the_link_not_its_target(tmp_path):
    """docs/semantics.md: a link often points at a file not to be changed (a cache's shared blob)."""
    (tmp_path / "blobs").mkdir()
    target = tmp_path / "blobs" / "0123abcd"
    target.write_bytes(b"pretrained")
    (tmp_path / "m.onnx").symlink_to(target)
    engine = trained(1)
    engine.export(tmp_path / "m.onnx")
    assert target.read_bytes() == b"pretrained" and not (tmp_path / "m.onnx").is_symlink()
    assert onnxtrain.load(tmp_path / "m.onnx").step_count == 1


def test_export_past_the_protobuf_limit_switches_to_external_data(tmp_path, monkeypatch):
    model = regression_model(width=256)  # W: 8 KiB
    engine = onnxtrain.load(model)
    engine.export(tmp_path / "small.onnx")
    assert data_files(tmp_path) == []
    monkeypatch.setattr(onnxtrain.big_models, "PROTOBUF_LIMIT", 4096)
    engine.export(tmp_path / "big.onnx")
    assert list(locations(tmp_path / "big.onnx")) == ["W"]
    assert (tmp_path / "big.onnx").stat().st_size < 4096
    x = RNG.normal(size=(2, 8)).astype(np.float32)
    np.testing.assert_allclose(onnxruntime_output(tmp_path / "big.onnx", x), reference_output(model, x), rtol=1e-5)
    with pytest.raises(ExportError, match="external_data=True"):
        engine.export(tmp_path / "inline.onnx", external_data=False)
    assert not (tmp_path / "inline.onnx").exists()


def test_model_past_the_protobuf_limit_is_validated_trained_and_exported(tmp_path, monkeypatch):
    """With the limit shrunk below the model's size every big-model path runs: the checker on a skeleton, a
    train step, the automatic external-data export, reloads in onnxtrain and ONNX Runtime."""
    monkeypatch.setattr(onnxtrain.big_models, "PROTOBUF_LIMIT", 4096)
    monkeypatch.setattr(onnxtrain.big_models, "SKELETON_CHECK_BYTES", 4096)
    model = regression_model(width=256)
    broken = onnx.ModelProto()
    broken.CopyFrom(model)
    broken.graph.node[0].input[1] = "undefined"
    with pytest.raises(ModelLoadError, match="undefined"):
        onnxtrain.load(broken)
    trainable = onnxtrain.make_trainable(model, loss="mse", optimizer="sgd", learning_rate=0.1)
    serialized = trainable.SerializeToString()
    engine = onnxtrain.load(trainable)
    assert trainable.SerializeToString() == serialized  # the check put every tensor's bytes back
    x = RNG.normal(size=(2, 8)).astype(np.float32)
    target = np.zeros((2, 64, 4), np.float32)
    before = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    engine.train_step({"X": x, "target": target})
    # one SGD step on mean((X W reshaped + B)^2): W -= lr * X^T dL/d(XW)
    residual = reference_output(model, x)
    grad_w = x.T @ (2 * residual / residual.size).reshape(2, 256)
    np.testing.assert_allclose(np.asarray(engine.state["W"]), before["W"] - 0.1 * grad_w, rtol=1e-4, atol=1e-6)
    engine.export(tmp_path / "trained.onnx")
    assert "W" in locations(tmp_path / "trained.onnx")
    reloaded = onnxtrain.load(tmp_path / "trained.onnx")
    np.testing.assert_array_equal(np.asarray(reloaded.state["W"]), np.asarray(engine.state["W"]))
    inference = onnx.load(tmp_path / "trained.onnx", load_external_data=False)
    del inference.training_info[:]
    onnx.save_model(inference, tmp_path / "inference.onnx")
    trained_weights = dict(before, W=np.asarray(engine.state["W"]), B=np.asarray(engine.state["B"]))
    expected = (x @ trained_weights["W"]).reshape(trained_weights["shape"]) + trained_weights["B"]
    np.testing.assert_allclose(onnxruntime_output(tmp_path / "inference.onnx", x), expected, rtol=1e-5)


def test_load_state_of_an_export_reads_no_weight_but_the_state(tmp_path, monkeypatch):
    """A checkpoint's reader needs the state alone: a frozen weight in external data (a fine-tuned model's base)
    is left unread, not inlined into memory and dropped."""
    monkeypatch.setattr(onnxtrain.big_models, "INLINE_BYTES", 0)
    frozen = RNG.normal(size=(3, 4)).astype(np.float32)
    head = RNG.normal(size=(4, 2)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "frozen"], ["h"]), helper.make_node("MatMul", ["h", "head"], ["y"])],
        "frozen_base", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [5, 2])],
        [numpy_helper.from_array(frozen, "frozen"), numpy_helper.from_array(head, "head")])
    model = onnxtrain.make_trainable(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                                     loss="mse", optimizer="sgd", trainable=["head"])
    x, target = RNG.normal(size=(5, 3)).astype(np.float32), RNG.normal(size=(5, 2)).astype(np.float32)
    source = onnxtrain.load(model)
    source.train_step({"x": x, "target": target, "learning_rate": np.float32(0.1)})
    source.export(tmp_path / "ckpt.onnx", external_data=True)
    exported = onnx.load(tmp_path / "ckpt.onnx", load_external_data=False)
    assert uses_external_data(next(t for t in exported.graph.initializer if t.name == "frozen"))
    inlined = []
    real_hold_inline = onnxtrain.external_data.hold_inline
    monkeypatch.setattr(onnxtrain.external_data, "hold_inline",
                        lambda tensor, data: (inlined.append(tensor.name), real_hold_inline(tensor, data)))
    engine = onnxtrain.load(model)
    engine.load_state(tmp_path / "ckpt.onnx")
    assert inlined == []
    np.testing.assert_array_equal(np.asarray(engine.state["head"]), np.asarray(source.state["head"]))
    assert engine.step_count == 1
