"""External data is read only from the model's folder, for every tensor of the model, and exactly as declared."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain import external_data
from onnxtrain.errors import ExternalDataError
from onnxtrain.external_data import ExternalValues
from onnxtrain.tensor_data import raw_size
from training_models import mlp_adam

SECRET = np.arange(1, 3, dtype=np.float32)  # what a hostile location would pull in: 8 bytes, fits a [2] tensor


def params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"W1": rng.normal(size=(3, 4)).astype(np.float32), "B1": np.zeros(4, np.float32),
            "W2": rng.normal(size=(4, 2)).astype(np.float32), "B2": np.zeros(2, np.float32)}


def make_external(tensor: onnx.TensorProto, location: str, **entries) -> None:
    tensor.ClearField("raw_data")
    tensor.ClearField("float_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in {"location": location, **entries}.items():
        entry = tensor.external_data.add()
        entry.key, entry.value = key, str(value)


def sparse_b2_model() -> tuple[onnx.ModelProto, onnx.SparseTensorProto]:
    """The MLP with its bias B2 as a sparse initializer (values at flat positions 0 and 1)."""
    model = mlp_adam(params(), 0.1)
    kept = [t for t in model.graph.initializer if t.name != "B2"]
    model.graph.ClearField("initializer")
    model.graph.initializer.extend(kept)
    sparse = helper.make_sparse_tensor(numpy_helper.from_array(np.zeros(2, np.float32), "B2"),
                                       numpy_helper.from_array(np.array([0, 1], np.int64), "B2_indices"), [2])
    model.graph.sparse_initializer.append(sparse)
    return model, model.graph.sparse_initializer[0]


def with_constant(model: onnx.ModelProto, graph: onnx.GraphProto) -> onnx.TensorProto:
    """A Constant [2] node added to `graph` (its output unused); returns its value tensor."""
    graph.node.insert(0, helper.make_node("Constant", [], ["C_unused"], value=numpy_helper.from_array(
        np.zeros(2, np.float32))))
    return graph.node[0].attribute[0].t


def algorithm_initializer(model):
    return next(t for t in model.training_info[0].algorithm.initializer if t.name == "V_B2")


def initialization_constant(model):
    return with_constant(model, model.training_info[0].initialization)


def main_constant(model):
    return with_constant(model, model.graph)


def function_constant(model):
    """A model-local function whose body holds a Constant, called from the main graph."""
    function = helper.make_function("local", "Two", [], ["c"], [helper.make_node("Constant", [], ["c"], value=(
        numpy_helper.from_array(np.zeros(2, np.float32))))], [helper.make_opsetid("", 17)])
    model.functions.append(function)
    model.opset_import.append(helper.make_opsetid("local", 1))
    model.graph.node.insert(0, helper.make_node("Two", [], ["C_unused"], domain="local"))
    return model.functions[0].node[0].attribute[0].t


def if_branch_initializer(model):
    """An If node (its output unused) whose then-branch has an initializer."""
    def branch(name):
        return helper.make_graph([helper.make_node("Identity", ["k"], ["o"])], name, [],
                                 [helper.make_tensor_value_info("o", TensorProto.FLOAT, [2])],
                                 [numpy_helper.from_array(np.zeros(2, np.float32), "k")])
    model.graph.initializer.append(numpy_helper.from_array(np.array(True), "cond"))
    model.graph.node.insert(0, helper.make_node("If", ["cond"], ["I_unused"], then_branch=branch("then"),
                                                else_branch=branch("else")))
    return model.graph.node[0].attribute[0].g.initializer[0]


def sparse_values(model):
    model.CopyFrom(sparse_b2_model()[0])
    return model.graph.sparse_initializer[0].values


def sparse_indices(model):
    model.CopyFrom(sparse_b2_model()[0])
    return model.graph.sparse_initializer[0].indices


PLACES = [algorithm_initializer, initialization_constant, main_constant, function_constant, if_branch_initializer,
          sparse_values]


@pytest.mark.parametrize("place", PLACES + [sparse_indices], ids=lambda f: f.__name__)
def test_every_tensor_is_confined_to_the_model_folder(tmp_path, monkeypatch, place):
    """Run from inside the model's folder, so a location resolved against the working directory (as onnx's helper
    does for the tensors it does not visit) would find the secret one level up."""
    folder = tmp_path / "model"
    folder.mkdir()
    (tmp_path / "secret.bin").write_bytes(SECRET.tobytes() * 2)
    monkeypatch.chdir(folder)
    model = mlp_adam(params(), 0.1)
    make_external(place(model), "../secret.bin")
    (folder / "m.onnx").write_bytes(model.SerializeToString())
    with pytest.raises(ExternalDataError, match=r"'\.\./secret\.bin' is outside the model's folder"):
        onnxtrain.load(folder / "m.onnx")


@pytest.mark.parametrize("place", PLACES, ids=lambda f: f.__name__)
def test_external_data_inside_the_folder_loads_wherever_the_tensor_is(tmp_path, place):
    model = mlp_adam(params(), 0.1)
    tensor = place(model)
    make_external(tensor, "weights/data.bin", offset=4, length=8)
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "data.bin").write_bytes(b"head" + SECRET.tobytes() + b"tail")
    (tmp_path / "m.onnx").write_bytes(model.SerializeToString())
    engine = onnxtrain.load(tmp_path / "m.onnx")
    assert engine is not None
    if place is algorithm_initializer:
        np.testing.assert_array_equal(engine.state["V_B2"], SECRET)
    if place is sparse_values:
        x = np.ones((1, 3), np.float32)
        p = params()
        expected = np.maximum(x @ p["W1"] + p["B1"], 0) @ p["W2"] + SECRET
        np.testing.assert_allclose(engine.infer({"X": x})["Y"], expected, rtol=1e-6)


def test_symlink_out_of_the_folder_is_refused(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (tmp_path / "secret.bin").write_bytes(SECRET.tobytes())
    (folder / "link.bin").symlink_to(tmp_path / "secret.bin")
    model = mlp_adam(params(), 0.1)
    make_external(model.graph.initializer[3], "link.bin")
    (folder / "m.onnx").write_bytes(model.SerializeToString())
    with pytest.raises(ExternalDataError, match="'link.bin' is outside the model's folder"):
        onnxtrain.load(folder / "m.onnx")


@pytest.mark.parametrize("as_", ["bytes", "proto"])
def test_a_model_without_a_folder_may_not_reference_external_data(tmp_path, monkeypatch, as_):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "b2.bin").write_bytes(SECRET.tobytes())
    model = mlp_adam(params(), 0.1)
    make_external(model.graph.initializer[3], "b2.bin")
    source = model.SerializeToString() if as_ == "bytes" else model
    with pytest.raises(ExternalDataError, match="initializer 'B2'.*load the model from its file path"):
        onnxtrain.load(source)


def fifo(folder):
    os.mkfifo(folder / "data.bin")


def directory(folder):
    (folder / "data.bin").mkdir()


def short_file(folder):
    (folder / "data.bin").write_bytes(SECRET.tobytes()[:6])


def long_file(folder):
    (folder / "data.bin").write_bytes(SECRET.tobytes() * 2)


def exact_file(folder):
    (folder / "data.bin").write_bytes(SECRET.tobytes())


@pytest.mark.parametrize("setup, entries, message", [
    (exact_file, {"location": "/etc/hostname"}, "'/etc/hostname' is outside the model's folder"),
    (exact_file, {"location": "data.bin\0.txt"}, "contains a NUL byte"),
    (exact_file, {"location": ""}, "has no location"),
    (exact_file, {"location": "data.bin", "offset": "-4"}, "offset '-4' is not a non-negative integer"),
    (exact_file, {"location": "data.bin", "offset": "1.5"}, "offset '1.5' is not a non-negative integer"),
    (exact_file, {"location": "data.bin", "length": "x"}, "length 'x' is not a non-negative integer"),
    (exact_file, {"location": "data.bin", "length": "4"}, "length 4 does not match the 8 bytes"),
    (exact_file, {"location": "data.bin", "offset": "4", "length": "8"}, r"has 8 bytes; the tensor needs .*\[4, 12\)"),
    (exact_file, {"location": "data.bin", "offset": str(2**70)}, "has 8 bytes; the tensor needs"),
    # int() refuses a string of over 4300 digits with a ValueError of its own
    (exact_file, {"location": "data.bin", "length": "9" * 5000}, "length of 5000 digits is past any file's size"),
    (exact_file, {"location": "data.bin", "offset": "0" * 5000}, None),  # leading zeros: still 0
    (short_file, {"location": "data.bin"}, r"has 6 bytes; the tensor needs bytes \[0, 8\)"),
    (long_file, {"location": "data.bin"}, r"has 16 bytes; the tensor needs bytes \[0, 8\)"),  # no length: to EOF
    (exact_file, {"location": "missing.bin"}, "'missing.bin' cannot be read: No such file"),
    (directory, {"location": "data.bin"}, "'data.bin' is not a regular file"),
    (fifo, {"location": "data.bin"}, "'data.bin' is not a regular file"),
    (exact_file, {"location": "data.bin", "offset": "0", "offset ": "0"}, None),
])
def test_malformed_external_data_is_a_clear_error(tmp_path, setup, entries, message):
    setup(tmp_path)
    model = mlp_adam(params(), 0.1)
    tensor = model.graph.initializer[3]  # B2, float [2]
    make_external(tensor, **entries)
    (tmp_path / "m.onnx").write_bytes(model.SerializeToString())
    if message is None:  # unknown keys are ignored, as onnx does
        np.testing.assert_array_equal(onnxtrain.load(tmp_path / "m.onnx").state["B2"], SECRET)
        return
    with pytest.raises(ExternalDataError, match=f"initializer 'B2'.*{message}"):
        onnxtrain.load(tmp_path / "m.onnx")


def test_duplicate_keys_are_refused(tmp_path):
    exact_file(tmp_path)
    model = mlp_adam(params(), 0.1)
    make_external(model.graph.initializer[3], "data.bin")
    entry = model.graph.initializer[3].external_data.add()
    entry.key, entry.value = "location", "../secret.bin"
    (tmp_path / "m.onnx").write_bytes(model.SerializeToString())
    with pytest.raises(ExternalDataError, match="key 'location' is given twice"):
        onnxtrain.load(tmp_path / "m.onnx")


def test_engine_given_an_unresolved_proto_refuses_it():
    """Engine(proto) skips read_model: the decoder itself refuses a tensor whose data is still elsewhere."""
    model = mlp_adam(params(), 0.1)
    make_external(model.graph.initializer[3], "b2.bin")
    with pytest.raises(ExternalDataError, match="'B2' references external data"):
        onnxtrain.Engine(model, check=False)


def test_make_trainable_of_a_model_read_without_its_data_says_how_to_read_it(tmp_path):
    """make_trainable takes a ModelProto, so "load it from its path" alone named a call it does not have."""
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
                              [numpy_helper.from_array(np.ones((8, 8), np.float32), "w")])
    onnx.save(helper.make_model(graph), tmp_path / "m.onnx", save_as_external_data=True, size_threshold=0)
    with pytest.raises(ExternalDataError, match=r"'w' references external data.*onnx.load\(path\)"):
        onnxtrain.make_trainable(onnx.load(tmp_path / "m.onnx", load_external_data=False), loss="mse")
    onnxtrain.make_trainable(onnx.load(tmp_path / "m.onnx"), loss="mse")  # read with its data: accepted


@pytest.mark.parametrize("data_type", sorted(set(TensorProto.DataType.values()) - {TensorProto.UNDEFINED,
                                                                                  TensorProto.STRING}),
                         ids=TensorProto.DataType.Name)
def test_a_kept_external_tensor_decodes_as_the_same_tensor_inline(tmp_path, data_type):
    """What load reads straight from a file (a state variable kept in external data) is what onnx decodes from
    the same bytes held inline, for every element type, whole bytes or packed, at an unaligned offset."""
    inline = TensorProto(name="v", data_type=data_type, dims=[3, 5])
    inline.raw_data = np.random.default_rng(data_type).bytes(raw_size(inline, "v"))
    (tmp_path / "data.bin").write_bytes(b"pad" + inline.raw_data)
    external = TensorProto(name="v", data_type=data_type, dims=[3, 5])
    make_external(external, "data.bin", offset=3)
    value = ExternalValues(tmp_path).value(external, "initializer 'v'")
    expected = numpy_helper.to_array(inline)
    assert (value.dtype, value.shape) == (expected.dtype, expected.shape)
    assert value.tobytes() == expected.tobytes()


def test_a_kept_external_tensor_is_confined_at_every_read(tmp_path):
    """The data file swapped for a link out of the folder after load: reset refuses it, it reads nothing there."""
    folder = tmp_path / "model"
    folder.mkdir()
    (tmp_path / "secret.bin").write_bytes(SECRET.tobytes())
    model = mlp_adam(params(), 0.1)
    make_external(algorithm_initializer(model), "v.bin")
    (folder / "v.bin").write_bytes(np.zeros(2, np.float32).tobytes())
    (folder / "m.onnx").write_bytes(model.SerializeToString())
    engine = onnxtrain.load(folder / "m.onnx")
    engine.train_step({"X": np.ones((2, 3), np.float32), "Target": np.ones((2, 2), np.float32)})
    (folder / "v.bin").unlink()
    (folder / "v.bin").symlink_to(tmp_path / "secret.bin")
    with pytest.raises(ExternalDataError, match="'v.bin' is outside the model's folder"):
        engine.reset()


@pytest.mark.parametrize("swapped", ["sub", "sub/b2.bin"])
def test_a_link_out_swapped_in_after_the_check_is_refused_by_what_was_opened(tmp_path, monkeypatch, swapped):
    """A folder on the path, or the file, replaced by a link out of the model's folder between confined_path's
    resolve and the open: the file opened is checked (on Linux), not only the path resolved before."""
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("the system does not name an open file: the window stays (docs/semantics.md)")
    folder = tmp_path / "model"
    (folder / "sub").mkdir(parents=True)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "b2.bin").write_bytes(SECRET.tobytes())
    (folder / "sub" / "b2.bin").write_bytes(np.zeros(2, np.float32).tobytes())
    model = mlp_adam(params(), 0.1)
    make_external(sparse_values(model), "sub/b2.bin")  # read once, at load
    (folder / "m.onnx").write_bytes(model.SerializeToString())
    resolve = external_data.confined_path

    def resolve_then_swap(location, folder_, label):
        target = resolve(location, folder_, label)
        os.rename(folder / swapped, folder / f"{swapped}.old")
        (folder / swapped).symlink_to(tmp_path / "out" / Path(swapped).relative_to("sub"))
        return target

    monkeypatch.setattr(external_data, "confined_path", resolve_then_swap)
    with pytest.raises(ExternalDataError, match="'sub/b2.bin' is outside the model's folder"):
        onnxtrain.load(folder / "m.onnx")


def test_a_hard_link_in_the_folder_is_a_file_of_the_folder(tmp_path):
    """No path leaves the folder: a hard link to a file elsewhere is read, as documented (docs/semantics.md)."""
    folder = tmp_path / "model"
    folder.mkdir()
    (tmp_path / "b2.bin").write_bytes(SECRET.tobytes())
    os.link(tmp_path / "b2.bin", folder / "b2.bin")
    model = mlp_adam(params(), 0.1)
    make_external(model.graph.initializer[3], "b2.bin")
    (folder / "m.onnx").write_bytes(model.SerializeToString())
    np.testing.assert_array_equal(onnxtrain.load(folder / "m.onnx").state["B2"], SECRET)


def test_external_data_that_no_host_memory_holds_is_an_external_data_error(tmp_path):
    """dims declaring 64 GiB, backed by a sparse file as large: reading it had let Python's MemoryError out of load.
    A child process with its address space capped at 8 GiB reads it, so that no system's overcommit lets it pass."""
    model = mlp_adam(params(), 0.1)
    tensor = model.graph.initializer[3]
    tensor.dims[:] = [2**34]
    make_external(tensor, "big.bin")
    with open(tmp_path / "big.bin", "wb") as f:
        f.truncate(2**36)  # sparse: no disk spent
    (tmp_path / "m.onnx").write_bytes(model.SerializeToString())
    child = ("import resource, sys, onnxtrain\n"
             "resource.setrlimit(resource.RLIMIT_AS, (2**33, 2**33))\n"
             "try:\n    onnxtrain.load(sys.argv[1])\n"
             "except onnxtrain.errors.ExternalDataError as exc:\n    print(exc)\n")
    done = subprocess.run([sys.executable, "-c", child, str(tmp_path / "m.onnx")], capture_output=True, text=True,
                          timeout=300)
    assert done.stdout.strip() == ("initializer 'B2': its 68719476736 bytes of external data (dims [17179869184]) do "
                                   "not fit in host memory"), done.stderr[-2000:]
