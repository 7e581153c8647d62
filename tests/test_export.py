"""Export: the trained .onnx is valid, runs in ONNX Runtime like `infer`, and is itself a checkpoint."""

from __future__ import annotations

import errno
import os

import numpy as np
import onnx
import pytest

import onnxtrain
import onnxtrain.big_models
from onnx.external_data_helper import ExternalDataInfo
from onnxtrain.errors import ExportError
from test_training import mlp_params
from training_models import mlp_adam

RNG = np.random.default_rng(3)
X = RNG.normal(size=(16, 4)).astype(np.float32)
T = RNG.normal(size=(16, 2)).astype(np.float32)


def trained(steps: int) -> onnxtrain.Engine:
    engine = onnxtrain.load(mlp_adam(mlp_params(), lr=0.01))
    engine.init()
    for _ in range(steps):
        engine.train_step({"X": X, "Target": T})
    return engine


def test_export_is_valid_and_onnxruntime_matches_infer(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    engine = trained(5)
    path = tmp_path / "trained.onnx"
    engine.export(path)
    exported = onnx.load(path)
    onnx.checker.check_model(exported)
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in exported.graph.initializer}
    np.testing.assert_array_equal(weights["W1"], np.asarray(engine.state["W1"]))
    moments = {t.name: onnx.numpy_helper.to_array(t) for t in exported.training_info[0].algorithm.initializer}
    assert int(moments["T"]) == 5
    inference_only = onnx.ModelProto()
    inference_only.CopyFrom(exported)
    del inference_only.training_info[:]
    session = ort.InferenceSession(inference_only.SerializeToString(), providers=["CPUExecutionProvider"])
    (ort_y,) = session.run(None, {"X": X})
    np.testing.assert_allclose(ort_y, np.asarray(engine.infer({"X": X})["Y"]), rtol=1e-5, atol=1e-6)


def resume_from_export(engine: onnxtrain.Engine, folder) -> onnxtrain.Engine:
    engine.export(folder / "ckpt.onnx")
    return onnxtrain.load(folder / "ckpt.onnx")


def resume_from_state(engine: onnxtrain.Engine, folder) -> onnxtrain.Engine:
    engine.save_state(folder / "state.npz")
    resumed = onnxtrain.load(mlp_adam(mlp_params(), lr=0.01))
    resumed.load_state(folder / "state.npz")
    return resumed


@pytest.mark.parametrize("resume", [resume_from_export, resume_from_state], ids=["onnx", "npz"])
def test_checkpoint_resumes_bit_for_bit(tmp_path, resume):
    """N steps, checkpoint, M more in a fresh engine == N + M uninterrupted (optimizer state and step count
    travel with the checkpoint)."""
    uninterrupted = trained(7)
    resumed = resume(trained(4), tmp_path)
    assert resumed.step_count == 4
    for _ in range(3):
        resumed.train_step({"X": X, "Target": T})
    for name, value in uninterrupted.state.items():
        np.testing.assert_array_equal(np.asarray(resumed.state[name]), np.asarray(value), err_msg=name)


def test_export_with_external_data(tmp_path, monkeypatch):
    monkeypatch.setattr(onnxtrain.big_models, "INLINE_BYTES", 0)  # the MLP's weights are all under 1 KiB
    engine = trained(1)
    engine.export(tmp_path / "m.onnx", external_data=True)
    (data_file,) = [p for p in tmp_path.iterdir() if p.name.endswith(".data")]
    written = onnx.load(tmp_path / "m.onnx", load_external_data=False)
    assert {ExternalDataInfo(t).location for t in written.graph.initializer} == {data_file.name}
    reloaded = onnxtrain.load(tmp_path / "m.onnx")
    np.testing.assert_array_equal(np.asarray(reloaded.state["W1"]), np.asarray(engine.state["W1"]))


@pytest.mark.parametrize("external_data", [False, True])
def test_failed_export_leaves_the_existing_file_untouched(tmp_path, monkeypatch, external_data):
    """The first fsync fails (the data file's, with external data): nothing of the export is left behind."""
    monkeypatch.setattr(onnxtrain.big_models, "INLINE_BYTES", 0)
    engine = trained(1)
    path = tmp_path / "keep.onnx"
    path.write_bytes(b"previous contents")

    def broken_fsync(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(ExportError, match=r"cannot export to .*keep.onnx'.*No space left on device"):
        engine.export(path, external_data=external_data)
    with pytest.raises(ExportError, match=r"cannot export to .*new.onnx'.*No space left on device"):
        engine.export(tmp_path / "new.onnx", external_data=external_data)  # where no model was before
    assert path.read_bytes() == b"previous contents"
    assert os.listdir(tmp_path) == ["keep.onnx"]


@pytest.mark.parametrize("external_data", [False, True])
def test_state_of_every_kind_is_written_as_onnx_reads_it(tmp_path, external_data):
    """with_state leaves a state variable whose bytes lie in memory as onnx stores them without bytes, and the
    save writes them straight from the array (into the data file, or the model file); packed and text state
    goes through onnx's encoder. onnx's own decoder reads back every value, dtype and shape."""
    import ml_dtypes
    from onnx import TensorProto, helper, numpy_helper
    from onnxtrain.export import save_atomic, with_state

    rng = np.random.default_rng(0)
    state = {
        "f32": rng.normal(size=(16, 32)).astype(np.float32),  # 2 KB: a weight, external with external_data
        "f16": rng.normal(size=(3, 5)).astype(np.float16),
        "bf16": rng.normal(size=(33, 17)).astype(ml_dtypes.bfloat16),
        "f8": rng.normal(size=(7,)).astype(ml_dtypes.float8_e4m3fn),
        "i64": np.arange(600, dtype=np.int64).reshape(20, 30),  # int64: always in the model file
        "flag": np.array([True, False, True]),
        "scalar": np.float32(2.5).reshape(()),
        "i4": np.array([-8, 7, 0, 3, 1], dtype=ml_dtypes.int4),  # packed two to a byte: onnx encodes it
        "text": np.array(["a", "bé"], dtype=object),
    }
    graph = helper.make_graph([], "g", [], [], [numpy_helper.from_array(np.zeros_like(v), n) if v.dtype != object
                                                 else helper.make_tensor(n, TensorProto.STRING, v.shape, [b""] * v.size)
                                                 for n, v in state.items()])
    model = helper.make_model(graph)
    exported, pending = with_state(model, state, {name: None for name in state}, step=3)
    assert {tensor.name for tensor, _ in pending} == {"f32", "f16", "bf16", "f8", "i64", "flag", "scalar"}
    save_atomic(exported, tmp_path / "m.onnx", external_data, pending)
    read = onnx.load(tmp_path / "m.onnx", load_external_data=False)
    external = {t.name for t in read.graph.initializer if t.data_location == TensorProto.EXTERNAL}
    assert external == ({"f32", "bf16"} if external_data else set())
    onnx.external_data_helper.load_external_data_for_model(read, str(tmp_path))
    values = {t.name: numpy_helper.to_array(t) for t in read.graph.initializer}
    for name, value in state.items():
        assert values[name].dtype == value.dtype and values[name].shape == value.shape, name
        assert values[name].tolist() == value.tolist(), name
