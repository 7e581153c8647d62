"""Padding rows of embedding tables (onnxtrain/embedding_padding.py): what make_trainable reads from a dynamo
export, what it refuses, and the tied table it leaves as ONNX computes it, with a warning. tests/test_zoo.py
trains padded models of both exporters against PyTorch; tests/test_sparse_update.py the optimizers' numbers."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import onnxtrain
from onnxtrain.embedding_padding import exported_padding_rows
from onnxtrain.errors import AuthoringError
from test_sparse_update import IDS, TABLE, TARGET, embedding_model

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")


class Lookup(torch.nn.Module):
    def __init__(self, padding_idx: int | None):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4, padding_idx=padding_idx)
        self.other = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, ids):
        return self.head(self.embed(ids) + self.other(ids))


@pytest.mark.parametrize("padding_idx, expected", [(3, 3), (-1, 9), (None, None)])
def test_the_dynamo_exporters_record_of_padding_idx_is_read(padding_idx, expected, tmp_path):
    ids = torch.tensor([[1, 3, 5]])
    torch.onnx.export(Lookup(padding_idx), (ids,), tmp_path / "m.onnx", dynamo=True)
    found = exported_padding_rows(onnx.load(tmp_path / "m.onnx").graph)
    assert found == ({} if expected is None else {"embed.weight": expected})
    torch.onnx.export(Lookup(padding_idx), (ids,), tmp_path / "t.onnx", dynamo=False)  # keeps no record
    assert exported_padding_rows(onnx.load(tmp_path / "t.onnx").graph) == {}


@pytest.mark.parametrize("scaled", [True, False])
def test_a_table_looked_up_with_frequency_scaled_gradients_is_warned_about(scaled, tmp_path):
    """scale_grad_by_freq divides each row's gradient by its index's count in the batch in PyTorch; the ONNX
    Gradient does not, and the dynamo exporter's record says so."""
    module = torch.nn.Sequential(torch.nn.Embedding(10, 4, padding_idx=2, scale_grad_by_freq=scaled),
                                 torch.nn.Linear(4, 2))
    torch.onnx.export(module, (torch.tensor([[1, 2, 2]]),), tmp_path / "m.onnx", dynamo=True)
    model = onnx.load(tmp_path / "m.onnx")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainable = onnxtrain.make_trainable(model, loss="mse", optimizer="sgd")
    said = [str(w.message) for w in caught if issubclass(w.category, onnxtrain.ParameterizationWarning)]
    assert said == (["0.weight: looked up with scale_grad_by_freq=True, whose gradient PyTorch divides by each "
                     "index's count in the batch; the ONNX Gradient sums the lookups' gradients unscaled, so these "
                     "train differently (construct the embedding without scale_grad_by_freq to train as PyTorch "
                     "would)"] if scaled else [])
    assert [n.op_type for n in trainable.training_info[0].algorithm.node].count("ScatterND") == 1  # row 2 masked


@pytest.mark.parametrize("padding_idx, message", [
    ([1], "padding_idx is a mapping {embedding table: padding row}, not list"),
    ({"F": 1}, "padding_idx: 'F' is not a trained parameter"),
    ({"E": 11}, r"padding_idx: row 11 of 'E' is not an integer in \[-11, 11\)"),
    ({"E": True}, "padding_idx: row True of 'E' is not an integer"),
    ({"E": 1.0}, "padding_idx: row 1.0 of 'E' is not an integer"),
])
def test_a_wrong_padding_idx_is_refused(padding_idx, message):
    with pytest.raises(AuthoringError, match=message):
        onnxtrain.make_trainable(embedding_model(), loss="mse", optimizer="sgd", padding_idx=padding_idx)


def test_an_empty_padding_idx_masks_nothing():
    trainable = onnxtrain.make_trainable(embedding_model(), loss="mse", optimizer="sgd", padding_idx={})
    assert not [n for n in trainable.training_info[0].algorithm.node if n.op_type == "ScatterND"]


def test_a_table_tied_to_another_reader_keeps_the_onnx_gradient_with_a_warning():
    """The table also read by a MatMul (a tied output projection): PyTorch keeps that reader's gradient in the
    padding row and drops the lookups', which the sum ONNX's Gradient gives cannot tell apart."""
    model = embedding_model()
    model.graph.node.extend([helper.make_node("ReduceSum", ["E"], ["s"], keepdims=0),
                             helper.make_node("Add", ["Z", "s"], ["Z2"])])
    model.graph.output[0].name = "Z2"
    with pytest.warns(onnxtrain.ParameterizationWarning, match="'E' has a padding row .* also read by ReduceSum"):
        trainable = onnxtrain.make_trainable(model, loss="mse", optimizer="sgd", learning_rate=0.5,
                                             padding_idx={"E": 1})
    assert not [n for n in trainable.training_info[0].algorithm.node if n.op_type == "ScatterND"]
    engine = onnxtrain.load(trainable)
    engine.train_step({"ids": IDS, "target": TARGET})
    assert not np.array_equal(np.asarray(engine.state["E"])[1], TABLE[1])  # the looked-up row moved


def test_the_mask_is_plain_onnx_that_onnx_runtime_reads(tmp_path):
    """The exported model keeps the padding row's mask as ScatterND nodes of the algorithm graph."""
    ort = pytest.importorskip("onnxruntime")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainable = onnxtrain.make_trainable(embedding_model(), loss="mse", optimizer="sgd", padding_idx={"E": 2})
    onnx.checker.check_model(trainable, full_check=True)
    engine = onnxtrain.load(trainable)
    engine.train_step({"ids": IDS, "target": TARGET})
    engine.export(tmp_path / "trained.onnx")
    saved = onnx.load(tmp_path / "trained.onnx")
    assert [n.op_type for n in saved.training_info[0].algorithm.node].count("ScatterND") == 1
    session = ort.InferenceSession(str(tmp_path / "trained.onnx"), providers=["CPUExecutionProvider"])
    trained = {t.name: numpy_helper.to_array(t) for t in saved.graph.initializer}
    expected = (trained["E"][IDS % 11] @ trained["W"]).mean(1)
    np.testing.assert_allclose(session.run(None, {"ids": IDS})[0], expected, rtol=1e-5)
    assert trained["E"][2].tobytes() == TABLE[2].tobytes()

