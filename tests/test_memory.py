"""The host keeps no second decoded copy of a model's weights: not make_trainable while it reads them, not the
engine once they are on the device. NumPy reports its allocations to tracemalloc (the proto's bytes and the device
buffers are not Python allocations), so what tracemalloc sees is the decoded copies. One exception: on the CPU,
jax.device_put adopts a 64-byte-aligned NumPy array as the device buffer instead of copying it; such an array
stays allocated, but it is the weight, not a copy. Whether a decoded weight happens to be aligned is chance (about
one in four here), so the model has many weights and the bound leaves room for that share of them. (The state is
always copied: XLA cannot donate a buffer it adopted.)"""

from __future__ import annotations

import gc
import tracemalloc
import weakref

import jax
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain.errors import ExternalDataError, ModelLoadError

WIDTHS = [512] * 33  # 32 weights of 1 MB


def wide_mlp() -> tuple[onnx.ModelProto, int]:
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal((a, b), np.float32) / 23, f"W{i}")
               for i, (a, b) in enumerate(zip(WIDTHS, WIDTHS[1:]))]
    nodes = [helper.make_node("MatMul", ["X" if i == 0 else f"h{i}", f"W{i}"], [f"h{i + 1}"])
             for i in range(len(weights))]
    graph = helper.make_graph(
        nodes, "wide", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", WIDTHS[0]])],
        [helper.make_tensor_value_info(f"h{len(weights)}", TensorProto.FLOAT, ["batch", WIDTHS[-1]])], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return model, sum(len(w.raw_data) for w in weights)


def traced(call):
    """(result, bytes still allocated after the call, peak bytes during it) of Python/NumPy allocations."""
    tracemalloc.start()
    try:
        result = call()
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return result, current, peak


def test_make_trainable_reads_the_weights_one_at_a_time():
    model, size = wide_mlp()
    trainable, _, peak = traced(lambda: onnxtrain.make_trainable(model, loss="mse", optimizer="sgd"))
    # a weight or two decoded at a time, never the whole model (was: two decoded copies, 2x size)
    assert peak < 0.5 * size, (peak, size)
    assert len(trainable.training_info) == 1


def test_a_loaded_engine_keeps_no_host_copy_of_the_weights():
    model, size = wide_mlp()
    trainable = onnxtrain.make_trainable(model, loss="mse", optimizer="sgd", learning_rate=0.1)
    engine, kept, _ = traced(lambda: onnxtrain.load(trainable))
    assert kept < 0.6 * size, (kept, size)  # was 1.0x: every weight stayed decoded beside the device state
    # the state still starts at, and resets to, the model's initializers
    x = np.random.default_rng(1).standard_normal((4, WIDTHS[0]), np.float32)
    engine.train_step({"X": x, "target": np.zeros((4, WIDTHS[-1]), np.float32)})
    engine.reset()
    for tensor in model.graph.initializer:
        np.testing.assert_array_equal(np.asarray(engine.state[tensor.name]), numpy_helper.to_array(tensor))


def test_a_trainable_model_carries_its_zero_optimizer_state_once(tmp_path):
    """Adam's moments start at zero and are each as large as the weights: they are initializers (the spec's
    state), and the initialization graph resets them without a second full-size copy; training from that
    reset matches the initializers' zeros."""
    model, size = wide_mlp()
    trainable = onnxtrain.make_trainable(model, loss="mse", optimizer="adam", learning_rate=0.01)
    assert trainable.ByteSize() < 3.1 * size  # weights, m, v (was 5x: m and v again as Constant zeros)
    engine = onnxtrain.load(trainable)
    engine.init()
    moments = [n for n in engine.state if n.endswith((".adam_m", ".adam_v"))]
    assert len(moments) == 2 * (len(WIDTHS) - 1)
    for name in moments:
        assert np.asarray(engine.state[name]).shape == (512, 512) and not np.any(np.asarray(engine.state[name]))
    x = np.random.default_rng(1).standard_normal((4, WIDTHS[0]), np.float32)
    engine.train_step({"X": x, "target": np.zeros((4, WIDTHS[-1]), np.float32)})
    assert np.any(np.asarray(engine.state["W0.adam_m"])) and np.any(np.asarray(engine.state["W0.adam_v"]))


def test_an_engine_that_read_the_file_keeps_no_bytes_of_zero_state(tmp_path):
    """load(path) owns the proto it reads, so it keeps a copy without the zero state's bytes (Adam's moments,
    as large as the weights each), and still resets, trains and exports that state as the spec says."""
    model, size = wide_mlp()
    trainable = onnxtrain.make_trainable(model, loss="mse", optimizer="adam", learning_rate=0.01)
    path = tmp_path / "adam.onnx"
    onnx.save(trainable, path)
    engine = onnxtrain.load(path)
    assert engine.model.ByteSize() < 1.2 * size < 0.5 * path.stat().st_size  # the weights' bytes, not 3x
    x = np.random.default_rng(1).standard_normal((4, WIDTHS[0]), np.float32)
    engine.train_step({"X": x, "target": np.zeros((4, WIDTHS[-1]), np.float32)})
    out = tmp_path / "trained.onnx"
    engine.export(out)
    exported = onnx.load(out)
    onnx.checker.check_model(exported)
    saved = {t.name: numpy_helper.to_array(t) for info in exported.training_info for t in info.algorithm.initializer}
    assert np.any(saved["W0.adam_m"]) and np.any(saved["W0.adam_v"])
    for name in saved:
        if name in engine.state:
            np.testing.assert_array_equal(saved[name], np.asarray(engine.state[name]), err_msg=name)
    engine.reset()
    assert not np.any(np.asarray(engine.state["W0.adam_m"])) and not np.any(np.asarray(engine.state["W0.adam_v"]))
    np.testing.assert_array_equal(np.asarray(engine.state["W0"]), numpy_helper.to_array(model.graph.initializer[0]))
    before = trainable.SerializeToString()  # a proto handed in is the caller's: left whole
    onnxtrain.load(trainable)
    assert trainable.SerializeToString() == before


def test_an_engine_that_read_the_file_keeps_the_initial_state_there(tmp_path):
    """load(path): once the state is on the device, the engine's proto holds none of its bytes (in memory: 0.47 GB
    less resident for GPT-2); reset reads the initial values from the file again, and a file changed since
    load is refused by name, the trained state left as it was."""
    model, size = wide_mlp()
    path = tmp_path / "sgd.onnx"
    onnx.save(onnxtrain.make_trainable(model, loss="mse", optimizer="sgd", learning_rate=0.1), path)
    engine = onnxtrain.load(path)
    assert engine.model.ByteSize() < 0.01 * size
    x = np.random.default_rng(1).standard_normal((4, WIDTHS[0]), np.float32)
    engine.train_step({"X": x, "target": np.zeros((4, WIDTHS[-1]), np.float32)})
    trained = np.asarray(engine.state["W0"]).copy()
    original = numpy_helper.to_array(model.graph.initializer[0])
    assert not np.array_equal(trained, original)
    out = tmp_path / "trained.onnx"
    engine.export(out)  # the state's bytes come from the device
    np.testing.assert_array_equal(numpy_helper.to_array(onnx.load(out).graph.initializer[0]), trained)
    engine.reset()
    for tensor in model.graph.initializer:
        np.testing.assert_array_equal(np.asarray(engine.state[tensor.name]), numpy_helper.to_array(tensor))
    engine.train_step({"X": x, "target": np.zeros((4, WIDTHS[-1]), np.float32)})
    np.testing.assert_array_equal(np.asarray(engine.state["W0"]), trained)  # the same step from the same start
    changed = onnx.load(path)
    changed.graph.initializer[3].CopyFrom(numpy_helper.from_array(np.zeros((512, 512), np.float32), "W3"))
    onnx.save(changed, path)
    with pytest.raises(ModelLoadError, match=r"no longer holds the initial state .*'W3'"):
        engine.reset()
    np.testing.assert_array_equal(np.asarray(engine.state["W0"]), trained)


def test_reset_reads_the_file_it_was_loaded_from_after_a_change_of_directory(tmp_path, monkeypatch):
    model, _ = wide_mlp()
    (tmp_path / "a").mkdir()
    trainable = onnxtrain.make_trainable(model, loss="mse", optimizer="sgd", learning_rate=0.1)
    onnx.save(trainable, tmp_path / "a" / "m.onnx")
    monkeypatch.chdir(tmp_path / "a")
    engine = onnxtrain.load("m.onnx")
    x = np.random.default_rng(1).standard_normal((4, WIDTHS[0]), np.float32)
    engine.train_step({"X": x, "target": np.zeros((4, WIDTHS[-1]), np.float32)})
    monkeypatch.chdir(tmp_path)
    engine.reset()
    np.testing.assert_array_equal(np.asarray(engine.state["W0"]), numpy_helper.to_array(model.graph.initializer[0]))


def test_exporting_over_the_loaded_file_keeps_reset_working(tmp_path):
    """The file a loaded engine reads its initial state from, overwritten by its own export: reset still puts the
    initializer values back (the engine reads them into memory before the export replaces the file)."""
    model, _ = wide_mlp()
    path = tmp_path / "m.onnx"
    onnx.save(onnxtrain.make_trainable(model, loss="mse", optimizer="sgd", learning_rate=0.1), path)
    engine = onnxtrain.load(path)
    x = np.random.default_rng(1).standard_normal((4, WIDTHS[0]), np.float32)
    engine.train_step({"X": x, "target": np.zeros((4, WIDTHS[-1]), np.float32)})
    trained = np.asarray(engine.state["W0"]).copy()
    engine.export(path)
    np.testing.assert_array_equal(numpy_helper.to_array(onnx.load(path).graph.initializer[0]), trained)
    engine.reset()
    np.testing.assert_array_equal(np.asarray(engine.state["W0"]), numpy_helper.to_array(model.graph.initializer[0]))


def test_init_right_after_load_does_not_read_the_file_again(tmp_path):
    """`onnxtrain train` (and a notebook) calls init right after load: the state already holds the stored values,
    so nothing is read again (for a model of several GB, seconds of I/O). Seen by the file being gone: init and
    reset still give the initializer values, a first step the same values as from a fresh engine; once a step has
    changed the state, reset needs the file and says so."""
    model, _ = wide_mlp()
    path = tmp_path / "m.onnx"
    onnx.save(onnxtrain.make_trainable(model, loss="mse", optimizer="sgd", learning_rate=0.1), path)
    engine = onnxtrain.load(path)
    path.unlink()
    engine.init()
    engine.reset()
    for tensor in model.graph.initializer:
        np.testing.assert_array_equal(np.asarray(engine.state[tensor.name]), numpy_helper.to_array(tensor))
    assert engine.step_count == 0
    x = np.random.default_rng(1).standard_normal((4, WIDTHS[0]), np.float32)
    engine.train_step({"X": x, "target": np.zeros((4, WIDTHS[-1]), np.float32)})
    weights = [numpy_helper.to_array(t) for t in model.graph.initializer]
    out = x
    for w in weights:
        out = out @ w
    # SGD on mean(out^2) (target 0): W0's gradient is x^T @ (2 out / n) @ (W1 ... W_last)^T
    upstream = 2 * out / out.size
    for w in reversed(weights[1:]):
        upstream = upstream @ w.T
    np.testing.assert_allclose(np.asarray(engine.state["W0"]), weights[0] - 0.1 * x.T @ upstream, rtol=1e-4,
                               atol=1e-6)
    with pytest.raises(ModelLoadError):
        engine.reset()


def test_a_few_zero_biases_are_not_worth_a_copy_of_the_model(tmp_path):
    """Dropping the zero state's bytes costs a copy of the rest of the model: load makes it for an optimizer's
    moments (as large as the weights), not for a freshly initialised model's zero biases (BERT-base by SGD: a
    0.35 s copy of 439 MB at load, and 370 MB more resident after it). Such a bias still trains and resets as
    the spec says."""
    from onnxtrain.export import without_zero_state

    model, _ = wide_mlp()
    last = model.graph.output[0].name
    model.graph.initializer.append(numpy_helper.from_array(np.zeros(WIDTHS[-1], np.float32), "B"))
    model.graph.node.append(helper.make_node("Add", [last, "B"], ["Y"]))
    model.graph.output[0].name = "Y"
    sgd = onnxtrain.make_trainable(model, loss="mse", optimizer="sgd", learning_rate=0.1)
    assert without_zero_state(sgd)[:2] == (sgd, frozenset())
    adam = onnxtrain.make_trainable(model, loss="mse", optimizer="adam", learning_rate=0.1)
    lean, zero, _ = without_zero_state(adam)
    assert lean is not adam and {"B", "W0.adam_m", "W0.adam_v"} <= zero

    path = tmp_path / "sgd.onnx"
    onnx.save(sgd, path)
    engine = onnxtrain.load(path)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, WIDTHS[0]), np.float32)
    target = rng.standard_normal((4, WIDTHS[-1]), np.float32)
    engine.train_step({"X": x, "target": target})
    h = x.astype(np.float64)
    for w in model.graph.initializer[:-1]:
        h = h @ numpy_helper.to_array(w)
    bias_gradient = (2 * (h - target) / h.size).sum(axis=0)  # of mean((X W0 ... W31 + B - target)^2) at B = 0
    np.testing.assert_allclose(np.asarray(engine.state["B"]), -0.1 * bias_gradient, rtol=1e-4, atol=1e-7)
    engine.reset()
    np.testing.assert_array_equal(np.asarray(engine.state["B"]), np.zeros(WIDTHS[-1], np.float32))


def test_a_zero_state_name_held_non_zero_by_another_graph_keeps_those_bytes():
    """The lean copy drops the bytes of zero state only: where another graph holds an initializer of the same
    name with other values, that one keeps them (only such shared names are read a second time)."""
    from onnxtrain.export import without_zero_state

    model, _ = wide_mlp()
    adam = onnxtrain.make_trainable(model, loss="mse", optimizer="adam", learning_rate=0.1)
    moment = next(t for t in adam.training_info[0].algorithm.initializer if t.name == "W0.adam_m")
    ones = numpy_helper.from_array(np.ones(numpy_helper.to_array(moment).shape, np.float32), moment.name)
    adam.graph.initializer.append(ones)
    lean, zero, _ = without_zero_state(adam)
    assert "W0.adam_m" in zero
    kept = [t for t in lean.graph.initializer if t.name == "W0.adam_m"]
    assert len(kept) == 1 and np.array_equal(numpy_helper.to_array(kept[0]), numpy_helper.to_array(ones))
    dropped = next(t for t in lean.training_info[0].algorithm.initializer if t.name == "W0.adam_m")
    assert not dropped.HasField("raw_data")


def test_a_train_step_updates_its_weights_in_place():
    """A weight that the backward pass reads (here W1, by the input gradient of its product) is updated in the
    buffer it was donated in: XLA-CPU's default copy insertion copied every such weight at the start of a step
    (onnxtrain.program's IN_PLACE_UPDATES). The step's values are NumPy's SGD step."""
    if jax.default_backend() != "cpu":
        pytest.skip("the copies were XLA-CPU's")
    rng = np.random.default_rng(0)
    w0, w1 = rng.standard_normal((8, 16), np.float32) / 3, rng.standard_normal((16, 4), np.float32) / 4
    x, target = rng.standard_normal((5, 8), np.float32), rng.standard_normal((5, 4), np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W0"], ["H"]), helper.make_node("MatMul", ["H", "W1"], ["Y"])], "mlp",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", 4])],
        [numpy_helper.from_array(w0, "W0"), numpy_helper.from_array(w1, "W1")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    engine = onnxtrain.load(onnxtrain.make_trainable(model, loss="mse", optimizer="sgd", learning_rate=0.1))
    feeds = {"X": x, "target": target}
    hlo = engine.lower(feeds, 0).compile().as_text()
    entry = hlo[hlo.index("ENTRY"):]
    parameters = [line.split("=")[0].strip() for line in entry.splitlines() if " parameter(" in line]
    copied = [p for p in parameters if f"copy({p})" in entry]
    assert parameters and not copied, copied
    engine.train_step(feeds)
    h = x @ w0
    dy = 2 * (h @ w1 - target) / target.size
    state = {name: np.asarray(value) for name, value in engine.state.items()}
    np.testing.assert_allclose(state["W1"], w1 - 0.1 * h.T @ dy, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state["W0"], w0 - 0.1 * x.T @ (dy @ w1.T), rtol=1e-5, atol=1e-6)


def external_trainable(folder) -> tuple[onnx.ModelProto, int, object]:
    """wide_mlp made trainable and saved as onnx writes external data (every tensor in `m.onnx.data`)."""
    model, size = wide_mlp()
    path = folder / "m.onnx"
    onnx.save(onnxtrain.make_trainable(model, loss="mse", optimizer="sgd", learning_rate=0.1), path,
              save_as_external_data=True, all_tensors_to_one_file=True, location="m.onnx.data", size_threshold=0)
    return model, size, path


def test_an_engine_that_read_external_data_reads_the_state_there_again(tmp_path):
    """load(path) of a model whose state is in external data leaves it there (the proto never holds the bytes:
    a 2.7 GB model's load peaked 2.4 GB lower); reset reads it again, and a data file
    changed since load is refused by name, even one of the same size, the trained state left as it was."""
    model, size, path = external_trainable(tmp_path)
    engine = onnxtrain.load(path)
    assert engine.model.ByteSize() < 0.01 * size
    x = np.random.default_rng(1).standard_normal((4, WIDTHS[0]), np.float32)
    engine.train_step({"X": x, "target": np.zeros((4, WIDTHS[-1]), np.float32)})
    trained = np.asarray(engine.state["W0"]).copy()
    engine.export(tmp_path / "trained.onnx")
    np.testing.assert_array_equal(numpy_helper.to_array(onnx.load(tmp_path / "trained.onnx").graph.initializer[0]),
                                  trained)
    engine.reset()
    for tensor in model.graph.initializer:
        np.testing.assert_array_equal(np.asarray(engine.state[tensor.name]), numpy_helper.to_array(tensor))
    engine.train_step({"X": x, "target": np.zeros((4, WIDTHS[-1]), np.float32)})
    np.testing.assert_array_equal(np.asarray(engine.state["W0"]), trained)  # the same step from the same start
    with open(tmp_path / "m.onnx.data", "r+b") as data:  # W3's bytes overwritten in place, the size unchanged
        data.seek(3 * 512 * 512 * 4)
        data.write(bytes(512 * 512 * 4))
    with pytest.raises(ExternalDataError, match=r"'W\d+'.*'m\.onnx\.data' has changed since the model was loaded"):
        engine.reset()
    np.testing.assert_array_equal(np.asarray(engine.state["W0"]), trained)


def test_exporting_over_a_loaded_file_with_external_data_keeps_reset_working(tmp_path):
    """The export replaces the model file and removes the data file the engine reads its initial state from: the
    engine reads that state into memory first."""
    model, _, path = external_trainable(tmp_path)
    engine = onnxtrain.load(path)
    x = np.random.default_rng(1).standard_normal((4, WIDTHS[0]), np.float32)
    engine.train_step({"X": x, "target": np.zeros((4, WIDTHS[-1]), np.float32)})
    trained = np.asarray(engine.state["W0"]).copy()
    engine.export(path, external_data=True)
    assert not (tmp_path / "m.onnx.data").exists()  # the export's data went to a new file, the old one removed
    np.testing.assert_array_equal(numpy_helper.to_array(onnx.load(path).graph.initializer[0]), trained)
    engine.reset()
    for tensor in model.graph.initializer:
        np.testing.assert_array_equal(np.asarray(engine.state[tensor.name]), numpy_helper.to_array(tensor))


@pytest.mark.parametrize("external", [False, True], ids=["model file", "external data"])
def test_an_export_over_a_loaded_file_changed_since_load_writes_the_trained_state(tmp_path, external):
    """The file the engine reads its initial state from changed on disk since load (another writer): an export
    over it had been refused, saying to load the model again, which loses the trained state. The export needs none
    of the initial state: it writes the trained one; reset, which can no longer read the initial state, refuses,
    saying why: the file changed since load (the export then removed the data file, and reset had said only that it
    "cannot be read")."""
    if external:
        _, _, path = external_trainable(tmp_path)
    else:
        path = tmp_path / "m.onnx"
        onnx.save(onnxtrain.make_trainable(wide_mlp()[0], loss="mse", optimizer="sgd", learning_rate=0.1), path)
    engine = onnxtrain.load(path)
    x = np.random.default_rng(1).standard_normal((4, WIDTHS[0]), np.float32)
    engine.train_step({"X": x, "target": np.zeros((4, WIDTHS[-1]), np.float32)})
    trained = {name: np.array(value) for name, value in engine.state.items()}
    changed = onnx.load(path)  # W3 zeroed, the model file (and its data file) written anew
    changed.graph.initializer[3].CopyFrom(numpy_helper.from_array(np.zeros((512, 512), np.float32), "W3"))
    onnx.save(changed, path, save_as_external_data=external, location="m.onnx.data", size_threshold=0)
    engine.export(path, external_data=external)
    reloaded = onnxtrain.load(path)
    assert reloaded.step_count == 1 and reloaded.state.keys() == trained.keys()
    for name, value in trained.items():
        np.testing.assert_array_equal(np.asarray(reloaded.state[name]), value, err_msg=name)
    changed = (r"initializer 'W\d+': external data file 'm\.onnx\.data' has changed since the model was loaded "
               r"\(now it cannot be read: No such file or directory\): .* load the model again from its original "
               r"files \(an export over the loaded model replaces them" if external
               else r"m\.onnx' no longer holds the initial state it was loaded with .*load the model again")
    with pytest.raises(ExternalDataError if external else ModelLoadError, match=changed):
        engine.reset()
    for name, value in trained.items():
        np.testing.assert_array_equal(np.asarray(engine.state[name]), value, err_msg=name)

@pytest.mark.parametrize("source", ["proto", "external data"])
def test_the_first_train_step_updates_every_state_buffer_in_place(tmp_path, source):
    """The state goes to the device as buffers XLA owns, which a step can donate: on the CPU, jax.device_put
    adopts a NumPy array that happens to be 64-byte aligned (a quarter of the weights decoded from a proto)
    instead of copying it, XLA cannot donate such a buffer, and the first step held the old state beside the
    new (for the 2.7 GB GPT-2 read straight from its data file, 2.7 GB more at its peak)."""
    if source == "proto":
        model, _ = wide_mlp()
        engine = onnxtrain.load(onnxtrain.make_trainable(model, loss="mse", optimizer="sgd", learning_rate=0.1))
    else:
        engine = onnxtrain.load(external_trainable(tmp_path)[2])
    before = {name: value.unsafe_buffer_pointer() for name, value in engine.state.items()}
    x = np.random.default_rng(1).standard_normal((4, WIDTHS[0]), np.float32)
    engine.train_step({"X": x, "target": np.zeros((4, WIDTHS[-1]), np.float32)})
    after = {name: value.unsafe_buffer_pointer() for name, value in engine.state.items()}
    assert len(before) == len(WIDTHS) - 1
    assert [name for name in before if after[name] != before[name]] == []


def test_the_state_is_put_as_buffers_xla_owns_without_compiling_anything():
    """Arrays of several shapes, each at a 64-byte-aligned address (the ones jax.device_put adopts on the CPU):
    put as state, each is a buffer of its own holding the same values, and no program is compiled for it (a copy
    through jnp.array compiled one per shape: MobileNetV3-small's load held 80 MB more)."""
    from onnxtrain.placement import Placement

    compiles = []

    def listen(event: str, seconds: float, **_) -> None:
        if event.endswith("backend_compile_duration"):
            compiles.append(event)

    values = {}
    for k, shape in enumerate([(3, 5), (7, 2), (4, 4, 4), (64,)]):
        spare = np.empty(int(np.prod(shape)) * 4 + 64, np.uint8)
        start = -spare.ctypes.data % 64
        values[f"v{k}"] = spare[start:start + int(np.prod(shape)) * 4].view(np.float32).reshape(shape)
        values[f"v{k}"][...] = np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + k
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        placed = Placement().put(values, donated=True)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert compiles == []
    for name, value in values.items():
        assert placed[name].unsafe_buffer_pointer() != value.ctypes.data, name
        np.testing.assert_array_equal(np.asarray(placed[name]), value)


def test_reset_reads_state_split_between_the_model_file_and_its_data_file(tmp_path):
    """onnx's writer keeps tensors under 1 KB in the model file (Adam's step count) and the rest in the data file
    (weights and moments): reset reads the first from the model file (checksummed) and the second from the data
    file (stamped), and restores every variable to what onnx reads from the pair."""
    model, _ = wide_mlp()
    path = tmp_path / "adam.onnx"
    onnx.save(onnxtrain.make_trainable(model, loss="mse", optimizer="adam", learning_rate=0.01), path,
              save_as_external_data=True, location="adam.onnx.data", size_threshold=1024)
    stored = onnx.load(path)  # onnx's reading of both files
    values = {t.name: numpy_helper.to_array(t) for g in [stored.graph, stored.training_info[0].algorithm]
              for t in g.initializer}
    references = onnx.load(path, load_external_data=False)
    external = {t.name for g in [references.graph, references.training_info[0].algorithm] for t in g.initializer
                if t.data_location == TensorProto.EXTERNAL}
    engine = onnxtrain.load(path)
    assert set(engine.state) & external and set(engine.state) - external  # the state is in both files
    x = np.random.default_rng(1).standard_normal((4, WIDTHS[0]), np.float32)
    for _ in range(2):
        engine.train_step({"X": x, "target": np.zeros((4, WIDTHS[-1]), np.float32)})
    engine.reset()
    for name in engine.state:
        np.testing.assert_array_equal(np.asarray(engine.state[name]), values[name], err_msg=name)


@pytest.mark.parametrize("source", ["file", "proto"])
def test_a_dropped_engine_is_freed_without_the_cycle_collector(tmp_path, source):
    """Nothing an engine holds refers back to it, so dropping the last reference frees it, its state and its
    programs at once, as a notebook cell re-running `engine = onnxtrain.load(...)` drops the last one. Its
    programs' bodies, their store and the rebuild after reset and init had held it in reference cycles: each
    replaced engine waited for Python's full collection (the zoo's BERT: 9 engines kept)."""
    weight = numpy_helper.from_array(np.full((3, 2), 0.5, np.float32), "W")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["Y"])], "linear",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", 3])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", 2])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    trainable = onnxtrain.make_trainable(model, loss="mse", optimizer="adam")
    onnx.save(trainable, tmp_path / "m.onnx")
    feeds = {"X": np.ones((4, 3), np.float32), "target": np.zeros((4, 2), np.float32)}
    arrays = len(jax.live_arrays())
    engine = onnxtrain.load(tmp_path / "m.onnx" if source == "file" else trainable)
    engine.train_step(feeds)
    engine.infer({"X": feeds["X"]})
    engine.reset()
    engine.init(1)
    engine.train_step(feeds)
    refs = [weakref.ref(engine), weakref.ref(engine._train[0]), weakref.ref(engine._infer)]
    gc.disable()  # what is freed now is freed by reference counting
    try:
        del engine
        assert [ref() for ref in refs] == [None] * len(refs)
        assert len(jax.live_arrays()) == arrays
    finally:
        gc.enable()
