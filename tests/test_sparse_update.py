"""SGD of a lookup table on the rows looked up (onnxtrain/lower/sparse_update.py): the same numbers as PyTorch's
dense SGD, rows not looked up untouched, and the whole-table update wherever a rate makes it differ."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import onnxtrain

RNG = np.random.default_rng(0)
VOCABULARY, WIDTH, BATCH, LENGTH, OUT = 11, 4, 2, 6, 3
TABLE = RNG.standard_normal((VOCABULARY, WIDTH)).astype(np.float32)
TABLE[9, 1] = -0.0  # a row no batch looks up: its sign of zero shows which update ran
PROJECTION = RNG.standard_normal((WIDTH, OUT)).astype(np.float32)
# repeated ids (summed in one row), a negative one (counted from the end: row 10), rows 4 and 6-9 not looked up
IDS = np.array([[1, 1, 3, -1, 3, 1], [0, 2, 2, 10, 1, 5]], np.int64)
TARGET = RNG.standard_normal((BATCH, OUT)).astype(np.float32)
UNTOUCHED = [4, 6, 7, 8, 9]


def embedding_model() -> onnx.ModelProto:
    """ids -> mean over positions of E[ids] @ W."""
    n = helper.make_node
    graph = helper.make_graph(
        [n("Gather", ["E", "ids"], ["e"], axis=0), n("MatMul", ["e", "W"], ["y"]),
         n("ReduceMean", ["y"], ["Z"], axes=[1], keepdims=0)],
        "embedding", [helper.make_tensor_value_info("ids", TensorProto.INT64, [BATCH, LENGTH])],
        [helper.make_tensor_value_info("Z", TensorProto.FLOAT, [BATCH, OUT])],
        [numpy_helper.from_array(TABLE, "E"), numpy_helper.from_array(PROJECTION, "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def trained(steps: int, lr: float, optimizer: str = "sgd", **options) -> onnxtrain.Engine:
    engine = onnxtrain.load(onnxtrain.make_trainable(embedding_model(), loss="mse", optimizer=optimizer,
                                                     learning_rate=lr, **options))
    for _ in range(steps):
        engine.train_step({"ids": IDS, "target": TARGET})
    return engine


def torch_trained(steps: int, lr: float, clip: float | None = None) -> dict[str, np.ndarray]:
    table, projection = torch.tensor(TABLE, requires_grad=True), torch.tensor(PROJECTION, requires_grad=True)
    optimizer = torch.optim.SGD([table, projection], lr=lr)
    ids = torch.tensor(IDS % VOCABULARY)
    for _ in range(steps):
        optimizer.zero_grad()
        z = (torch.nn.functional.embedding(ids, table) @ projection).mean(1)
        torch.nn.functional.mse_loss(z, torch.tensor(TARGET)).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([table, projection], clip)
        optimizer.step()
    return {"E": table.detach().numpy(), "W": projection.detach().numpy()}


def test_sgd_of_a_lookup_table_trains_as_pytorch_and_leaves_other_rows_alone():
    engine = trained(3, 0.5)
    for name, value in torch_trained(3, 0.5).items():
        np.testing.assert_allclose(np.asarray(engine.state[name]), value, rtol=1e-5, atol=1e-6, err_msg=name)
    table = np.asarray(engine.state["E"])
    assert table[UNTOUCHED].tobytes() == TABLE[UNTOUCHED].tobytes()
    # the rows-only update is chosen at run time against the whole-table one (see the next test)
    assert "stablehlo.case" in engine.lower({"ids": IDS, "target": TARGET}, 0).as_text()


@pytest.mark.parametrize("rate", [float("nan"), -0.5])
def test_a_rate_for_which_the_whole_table_update_differs_gets_it(rate):
    engine = trained(0, 0.5)
    engine.train_step({"ids": IDS, "target": TARGET, "learning_rate": np.array(rate, np.float32)})
    table = np.asarray(engine.state["E"])
    if np.isnan(rate):  # W - nan * 0: every row
        assert np.isnan(table).all()
    else:  # W - (-0.5 * 0) = W + 0: a negative zero becomes a positive one, in rows not looked up too
        assert table[9, 1] == 0 and not np.signbit(table[9, 1])
        assert np.array_equal(table[UNTOUCHED], TABLE[UNTOUCHED])


def test_a_table_also_read_inside_a_subgraph_trains_whole_and_right():
    """An If branch sums the whole table too: its gradient reaches every row, so the rows-only update must not
    be taken (it was, before readers inside subgraphs counted: rows not looked up kept their old values)."""
    n = helper.make_node
    model = embedding_model()
    branch = [helper.make_graph([n("ReduceSum", ["E"], [f"{name}_sum"], keepdims=0)], name, [],
                                [helper.make_tensor_value_info(f"{name}_sum", TensorProto.FLOAT, [])])
              for name in ("then", "else")]
    model.graph.node[-1].output[0] = "mean"
    model.graph.node.extend([n("If", ["flag"], ["sum"], then_branch=branch[0], else_branch=branch[1]),
                             n("Mul", ["sum", "tiny"], ["small"]), n("Add", ["mean", "small"], ["Z"])])
    model.graph.initializer.extend([numpy_helper.from_array(np.array(True), "flag"),
                                    numpy_helper.from_array(np.array(0.01, np.float32), "tiny")])
    engine = onnxtrain.load(onnxtrain.make_trainable(model, loss="mse", optimizer="sgd", learning_rate=0.5,
                                                     trainable=["E", "W"]))
    for _ in range(3):
        engine.train_step({"ids": IDS, "target": TARGET})
    table, projection = torch.tensor(TABLE, requires_grad=True), torch.tensor(PROJECTION, requires_grad=True)
    optimizer = torch.optim.SGD([table, projection], lr=0.5)
    for _ in range(3):
        optimizer.zero_grad()
        z = (torch.nn.functional.embedding(torch.tensor(IDS % VOCABULARY), table) @ projection).mean(1)
        torch.nn.functional.mse_loss(z + 0.01 * table.sum(), torch.tensor(TARGET)).backward()
        optimizer.step()
    np.testing.assert_allclose(np.asarray(engine.state["E"]), table.detach().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer, options, row", [("sgd", {}, 1), ("sgd", {}, -1),
                                                     ("adamw", {"weight_decay": 0.1}, 3)])
def test_a_padding_row_trains_as_pytorchs_and_sgd_still_updates_rows_only(optimizer, options, row):
    """padding_idx: the row's gradient is zero, as torch's embedding gives it (row 1 is looked up four times, row
    10 as -1 and as 10); AdamW's decay still moves it, as torch.optim's does. SGD keeps its rows-only update."""
    engine = trained(3, 0.5, optimizer, padding_idx={"E": row}, **options)
    table, projection = torch.tensor(TABLE, requires_grad=True), torch.tensor(PROJECTION, requires_grad=True)
    optimizer_class = torch.optim.SGD if optimizer == "sgd" else torch.optim.AdamW
    update = optimizer_class([table, projection], lr=0.5, **options)
    for _ in range(3):
        update.zero_grad()
        z = (torch.nn.functional.embedding(torch.tensor(IDS % VOCABULARY), table, padding_idx=row) @ projection)
        torch.nn.functional.mse_loss(z.mean(1), torch.tensor(TARGET)).backward()
        update.step()
    np.testing.assert_allclose(np.asarray(engine.state["E"]), table.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(engine.state["W"]), projection.detach().numpy(), rtol=1e-5, atol=1e-6)
    if optimizer == "sgd":
        assert np.asarray(engine.state["E"])[row].tobytes() == TABLE[row].tobytes()
        assert "stablehlo.case" in engine.lower({"ids": IDS, "target": TARGET}, 0).as_text()


def test_a_gradient_read_by_more_than_the_update_is_whole_and_right():
    engine = trained(3, 0.5, clip_grad_norm=0.05)  # the norm reads every gradient
    for name, value in torch_trained(3, 0.5, clip=0.05).items():
        np.testing.assert_allclose(np.asarray(engine.state[name]), value, rtol=1e-5, atol=1e-6, err_msg=name)


OVER_DEVICES = r"""
import sys
import jax
import numpy as np
sys.path.insert(0, sys.argv[1])
import onnxtrain
from test_sparse_update import IDS, TARGET, embedding_model, torch_trained

assert len(jax.devices()) == 2, jax.devices()
expected = torch_trained(3, 0.5)
for shard_state in (False, True):  # the batch split over the devices; the table replicated, then split
    model = onnxtrain.make_trainable(embedding_model(), loss="mse", optimizer="sgd", learning_rate=0.5)
    engine = onnxtrain.load(model, devices=jax.devices(), shard_state=shard_state)
    for _ in range(3):
        engine.train_step({"ids": IDS, "target": TARGET})
    for name, value in expected.items():
        np.testing.assert_allclose(np.asarray(engine.state[name]), value, rtol=1e-5, atol=1e-6, err_msg=name)
    print("MATCH", shard_state)
"""


def test_the_rows_update_over_two_devices_trains_as_pytorch():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-c", OVER_DEVICES, str(Path(__file__).parent)], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "MATCH False" in result.stdout and "MATCH True" in result.stdout
