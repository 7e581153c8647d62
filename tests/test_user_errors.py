"""User mistakes around training get one onnxtrain error naming the culprit; the CLI prints it as one line."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import onnxtrain
from onnxtrain.cli import main
from onnxtrain.errors import FeedError, ModelLoadError, OnnxTrainError, OptionError, StateError

EXAMPLE = Path(onnxtrain.__file__).parent / "examples"
MODEL, DATA = EXAMPLE / "regression.onnx", EXAMPLE / "regression.npz"
ARRAYS = dict(np.load(DATA))


@pytest.mark.parametrize("value", ["abc", "-3", "1.5", ""])
def test_a_bad_step_count_in_the_metadata(value):
    model = onnx.load(MODEL)
    model.metadata_props.add(key="onnxtrain.step", value=value)
    with pytest.raises(ModelLoadError, match=rf"metadata_props\['onnxtrain.step'\] = '{value}'"):
        onnxtrain.load(model)


@pytest.mark.parametrize("options, message", [
    ({"log_every": 0}, "log_every must be a positive number of steps, got 0"),
    ({"eval_every": -1}, "eval_every must be a positive number of steps, got -1"),
    ({"loss": "nope"}, r"loss 'nope' is not an output of train step 0; it returns \['Y', 'loss'\]"),
    ({"algorithm": 5}, "algorithm 5 does not exist: the model has 1 TrainingInfoProto"),
])
def test_fit_options(options, message):
    engine = onnxtrain.load(MODEL)
    with pytest.raises(OnnxTrainError, match=message):
        onnxtrain.fit(engine, onnxtrain.array_batches(ARRAYS, 8), steps=3, progress=False, **options)
    assert engine.step_count == 0


@pytest.mark.parametrize("batch_size", [0, -1])
def test_array_batches_refuses_a_batch_size_below_one(batch_size):
    with pytest.raises(OnnxTrainError, match=f"batch_size must be a positive number of rows.*got {batch_size}"):
        next(onnxtrain.array_batches(ARRAYS, batch_size))


def test_array_batches_refuses_empty_or_ragged_data():
    with pytest.raises(FeedError, match=r"the data arrays \['X', 'target'\] have no rows"):
        next(onnxtrain.array_batches({"X": np.zeros((0, 2)), "target": np.zeros((0, 1))}))
    with pytest.raises(FeedError, match="differ in their first dimension"):
        next(onnxtrain.array_batches({"X": np.zeros((4, 2)), "target": np.zeros((3, 1))}))


def test_a_zero_row_batch_is_refused_before_it_counts_as_a_step():
    engine = onnxtrain.load(MODEL)
    engine.init()
    empty = {"X": np.zeros((0, 2), np.float32), "target": np.zeros((0, 1), np.float32)}
    with pytest.raises(FeedError, match=r"feed 'X' has no rows \(shape \(0, 2\)\)"):
        engine.train_step(empty)
    assert engine.step_count == 0 and int(engine.state["train.step"]) == 0  # Adam's own count too
    assert engine.infer({"X": empty["X"]})["Y"].shape == (0, 1)  # inference of nothing is fine


@pytest.mark.parametrize("call, error, message", [
    (lambda: onnxtrain.load(None), ModelLoadError, "a model is a path, bytes or an onnx.ModelProto, not NoneType"),
    (lambda: onnxtrain.load(MODEL, seed="a"), OptionError, "seed must be an integer of at most 64 bits, got str"),
    (lambda: onnxtrain.load(MODEL).init(seed=2**64), OptionError, "seed must be an integer of at most 64 bits"),
    (lambda: onnxtrain.load(MODEL, matmul_precision="fast"), OptionError,
     "matmul_precision='fast' is not a precision JAX knows"),
    (lambda: onnxtrain.load(MODEL).train_step(dict(ARRAYS), algorithm="0"), StateError,
     "algorithm is the index of a TrainingInfoProto, an int: got str '0'"),
    (lambda: onnxtrain.load(MODEL).train_step(dict(ARRAYS), algorithm=True), StateError, "an int: got bool True"),
    (lambda: onnxtrain.load(MODEL).train_step(list(ARRAYS.values())), FeedError,
     r"feeds are a mapping \{input name: value\}, not list"),
    (lambda: onnxtrain.load(MODEL).infer(None), FeedError, "feeds are a mapping"),
    (lambda: onnxtrain.load(MODEL, devices=["cpu"]), OptionError, r"devices is a list of JAX devices .* not \['cpu'\]"),
    (lambda: onnxtrain.load(MODEL, devices=jax.devices()[0]), OptionError, "devices is a list of JAX devices"),
    (lambda: onnxtrain.load(MODEL).export(None), onnxtrain.errors.ExportError,
     "model is written to a file path, not NoneType"),
    (lambda: onnxtrain.export_params(MODEL, {}, 3), onnxtrain.errors.ExportError, "written to a file path, not int"),
    (lambda: onnxtrain.load(MODEL).save_state(None), StateError, "state checkpoint is written to a file path"),
])
def test_wrong_kinds_of_argument_are_onnxtrain_errors_naming_them(call, error, message):
    """Each had escaped as a TypeError, AttributeError, OverflowError or ValueError from deep inside."""
    with pytest.raises(error, match=message):
        call()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="which algorithm presets a platform computes varies")
def test_an_algorithm_preset_the_platform_cannot_compute_is_refused_at_load():
    """JAX takes its dot algorithm presets as matmul precisions, and the CPU computes some of them: one it does not
    had loaded and then failed the first step with JAX's ValueError; one it does trains."""
    with pytest.raises(OptionError, match="matmul_precision='F16_F16_F32' is an algorithm preset that the cpu "
                                          "cannot compute"):
        onnxtrain.load(MODEL, matmul_precision="F16_F16_F32")
    engine = onnxtrain.load(MODEL, matmul_precision="BF16_BF16_F32")
    assert np.isfinite(float(engine.train_step(dict(ARRAYS))["loss"]))


def test_an_output_that_cannot_be_written_is_refused_before_training(tmp_path, capsys, monkeypatch):
    """The trained model's path (CLI `-o`, fit's `checkpoint`) is checked before the first step: a folder that
    does not exist, or a folder named as the file, had failed at the export after the whole run."""
    import onnxtrain.loop

    steps = []
    step = onnxtrain.Engine.train_step
    monkeypatch.setattr(onnxtrain.Engine, "train_step", lambda self, *a, **k: steps.append(1) or step(self, *a, **k))
    for target in (tmp_path / "nowhere" / "out.onnx", tmp_path):
        status, err = run_cli(capsys, "train", MODEL, "--data", DATA, "--steps", 2, "-o", target)
        assert status == 2 and "cannot write model" in err and len(err.strip().splitlines()) == 1, err
        with pytest.raises(onnxtrain.errors.ExportError, match="cannot write model"):
            onnxtrain.fit(onnxtrain.load(MODEL), onnxtrain.array_batches(ARRAYS, 8), steps=3, progress=False,
                          checkpoint=target)
    assert steps == [] and sorted(p.name for p in tmp_path.iterdir()) == []
    with pytest.raises(OnnxTrainError, match="steps must be a number of steps >= 0, got 2.5"):
        onnxtrain.loop.fit(onnxtrain.load(MODEL), onnxtrain.array_batches(ARRAYS, 8), steps=2.5, progress=False)


@pytest.mark.parametrize("rate", [lambda step: "a", lambda step: None, lambda step: -1.0, float("nan"), -0.5])
def test_a_learning_rate_that_is_no_rate_stops_fit_before_its_step(rate):
    """A schedule's value is checked as make_trainable checks a rate (a finite number >= 0): None had become NaN
    and a string a ValueError, a negative rate had climbed the loss until fit called it divergence."""
    engine = onnxtrain.load(MODEL)
    with pytest.raises(OnnxTrainError,
                       match=r"learning_rate at update 0 \(train step 0\) is .*: it must be a finite number >= 0"):
        onnxtrain.fit(engine, onnxtrain.array_batches(ARRAYS, 8), steps=3, progress=False, learning_rate=rate)
    assert engine.step_count == 0


def test_a_jax_scalar_from_a_schedule_is_a_rate():
    """optax's schedules return 0-d jax arrays: the step runs at that rate."""
    import jax.numpy as jnp

    engine, reference = onnxtrain.load(MODEL), onnxtrain.load(MODEL)
    batch = next(onnxtrain.array_batches(ARRAYS, 8, shuffle=False))
    onnxtrain.fit(engine, [batch], steps=1, progress=False, learning_rate=lambda step: jnp.float32(0.05))
    reference.train_step({**batch, "learning_rate": np.float32(0.05)})
    for name, value in reference.state.items():
        np.testing.assert_array_equal(np.asarray(engine.state[name]), np.asarray(value))


@pytest.mark.parametrize("arrays, message", [
    ([ARRAYS["X"]], "array_batches takes a mapping {input name: array} with at least one array, not list"),
    ({}, "with at least one array, not dict"),
    ({"X": np.float32(1.0)}, r"the data arrays \['X'\] are scalars"),
])
def test_array_batches_refuses_data_that_has_no_rows_to_take(arrays, message):
    with pytest.raises(FeedError, match=message.replace("{", "\\{").replace("}", "\\}")):
        next(onnxtrain.array_batches(arrays, 2))


def test_array_batches_of_nested_lists_train_as_the_same_float32_arrays():
    """Rows of a list stay Python values, which take the input's declared type (float32), not NumPy's float64."""
    lists = {name: a.tolist() for name, a in ARRAYS.items()}
    batch = next(onnxtrain.array_batches(lists, 4, shuffle=False))
    assert batch["X"] == lists["X"][:4]
    engine, reference = onnxtrain.load(MODEL), onnxtrain.load(MODEL)
    engine.train_step(batch)
    reference.train_step(next(onnxtrain.array_batches(ARRAYS, 4, shuffle=False)))
    for name, value in reference.state.items():
        np.testing.assert_array_equal(np.asarray(engine.state[name]), np.asarray(value))


def test_fit_names_batches_that_are_not_iterable():
    with pytest.raises(FeedError, match="batches are an iterable of feed mappings, not NoneType"):
        onnxtrain.fit(onnxtrain.load(MODEL), None, steps=1, progress=False)


def test_export_params_refuses_values_that_do_not_fit_their_initializers(tmp_path):
    """A value of another shape or type had been written as the initializer, a model its nodes cannot read."""
    model = onnx.load(MODEL)
    first = model.graph.initializer[0]
    wrong = {first.name: np.ones(7, np.float32)}
    with pytest.raises(onnxtrain.errors.ExportError, match=rf"'{first.name}' is float\[7\], the model's float\["):
        onnxtrain.export_params(model, wrong, tmp_path / "o.onnx")
    with pytest.raises(onnxtrain.errors.ExportError, match=rf"'{first.name}' is double"):
        onnxtrain.export_params(model, {first.name: np.ones(list(first.dims), np.float64)}, tmp_path / "o.onnx")
    assert not list(tmp_path.iterdir())


def run_cli(capsys, *args) -> tuple[int, str]:
    status = main([str(a) for a in args])
    return status, capsys.readouterr().err


def plain_model(tmp_path: Path) -> Path:
    graph = helper.make_graph([helper.make_node("Relu", ["X"], ["Y"])], "plain",
                              [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 2])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 2])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "plain.onnx")
    return tmp_path / "plain.onnx"


def test_cli_user_errors_are_one_line(tmp_path, capsys):
    np.save(tmp_path / "x.npy", ARRAYS["X"][:2])
    (tmp_path / "corrupt.npz").write_bytes(b"PK\x03\x04 not really a zip")
    train = ("train", MODEL, "--data", DATA, "--steps", 2)
    cases = [
        (("infer", MODEL, "--input", f"X={tmp_path / 'x.npy'}", "--output-dir", tmp_path / "nowhere"),
         "--output-dir"),
        (("train", MODEL, "--data", tmp_path / "corrupt.npz"), "--data: cannot read"),
        (("export", MODEL, "--state", tmp_path / "corrupt.npz", "-o", tmp_path / "o.onnx"), "corrupt.npz"),
        ((*train, "--algorithm", 5), "algorithm 5 does not exist"),
        ((*train, "--loss", "nope"), "loss 'nope' is not an output of train step 0"),
        (("train", plain_model(tmp_path), "--data", DATA), "carries no TrainingInfoProto"),
        (("make-trainable", plain_model(tmp_path), "--trainable", "W(", "-o", tmp_path / "t.onnx"),
         "trainable 'W(' is not a regular expression"),
        ((*train, "--batch-size", 0), "batch_size must be a positive number of rows"),
        ((*train[:-1], -1), "steps must be a number of steps >= 0, got -1"),
        (("train", MODEL, "--data", tmp_path / "x.npy"), "is a single array (.npy); give a .npz"),
        (("train", MODEL, "--data", MODEL), "not a .npz archive of named arrays"),
        (("infer", MODEL, "--input", f"X={DATA}"), "is a .npz archive; give a .npy file of one array"),
        (("infer", MODEL, "--input", f"X={tmp_path / 'x.npy'}", "--input", f"X={tmp_path / 'x.npy'}"),
         "--input X is given twice"),
    ]
    for args, fragment in cases:
        status, err = run_cli(capsys, *args)
        assert status == 2, (args, err)
        assert err.startswith("onnxtrain: error:") and fragment in err, (args, err)
        assert len(err.strip().splitlines()) == 1, (args, err)


def test_a_window_larger_than_the_padded_input_names_the_padded_size():
    """A 5x5 kernel over a 3x3 input padded by one on each side (5x5) fits; padded by 0 on the right it does not:
    the error names the size the pads make, not only the input's (the padding is the user's to change)."""
    node = helper.make_node("Conv", ["X", "W"], ["Y"], pads=[1, 1, 0, 0])
    graph = helper.make_graph([node], "conv", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 1, 3, 3])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["n", "c", "h", "w"])],
                              [onnx.numpy_helper.from_array(np.ones((1, 1, 5, 5), np.float32), "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    engine = onnxtrain.load(model)
    with pytest.raises(OnnxTrainError, match=r"does not fit the input \(3, 3\) padded to \(4, 4\)"):
        engine.infer({"X": np.ones((1, 1, 3, 3), np.float32)})
