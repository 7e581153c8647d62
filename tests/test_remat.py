"""load(..., remat=True): the Gradient node recomputes its forward pass in segments instead of keeping every
activation for the backward pass. The numbers are PyTorch's; the compiled train step plans far fewer temporary
bytes than without it."""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain.errors import OptionError

torch = pytest.importorskip("torch")
from test_train_mode import data, export, module  # noqa: E402 - needs torch

BLOCKS, WIDTH, HIDDEN, BATCH, LR = 12, 64, 512, 2048, 0.05


def residual_mlp() -> tuple[onnx.ModelProto, list[np.ndarray]]:
    """BLOCKS residual blocks h + Tanh(h @ W1) @ W2: each keeps its [BATCH, HIDDEN] Tanh for the backward pass
    (its derivative and W2's gradient read it), while only h (BATCH x WIDTH) crosses from one block to the next."""
    rng = np.random.default_rng(0)
    weights, nodes = [], []
    for b in range(BLOCKS):
        weights += [rng.standard_normal((WIDTH, HIDDEN), np.float32) / 8,
                    rng.standard_normal((HIDDEN, WIDTH), np.float32) / 23]
        nodes += [helper.make_node("MatMul", [f"h{b}", f"W{2 * b}"], [f"p{b}"]),
                  helper.make_node("Tanh", [f"p{b}"], [f"t{b}"]),
                  helper.make_node("MatMul", [f"t{b}", f"W{2 * b + 1}"], [f"q{b}"]),
                  helper.make_node("Add", [f"h{b}", f"q{b}"], [f"h{b + 1}"])]
    graph = helper.make_graph(
        nodes, "residual", [helper.make_tensor_value_info("h0", TensorProto.FLOAT, [BATCH, WIDTH])],
        [helper.make_tensor_value_info(f"h{BLOCKS}", TensorProto.FLOAT, [BATCH, WIDTH])],
        [numpy_helper.from_array(w, f"W{i}") for i, w in enumerate(weights)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), weights


def torch_steps(weights: list[np.ndarray], x: np.ndarray, target: np.ndarray, steps: int):
    params = [torch.tensor(w, requires_grad=True) for w in weights]
    optimizer = torch.optim.SGD(params, lr=LR)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        h = torch.from_numpy(x)
        for w1, w2 in zip(params[::2], params[1::2]):
            h = h + torch.tanh(h @ w1) @ w2
        loss = torch.nn.functional.mse_loss(h, torch.from_numpy(target))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, [p.detach().numpy() for p in params]


def test_recomputed_steps_train_like_pytorch_with_a_fraction_of_the_temporaries():
    model, weights = residual_mlp()
    trainable = onnxtrain.make_trainable(model, loss="mse", optimizer="sgd", learning_rate=LR)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((BATCH, WIDTH), np.float32)
    target = rng.standard_normal((BATCH, WIDTH), np.float32)
    feeds = {"h0": x, "target": target}
    engine = onnxtrain.load(trainable, remat=True)
    losses = [float(engine.train_step(feeds)["loss"]) for _ in range(3)]
    expected, trained = torch_steps(weights, x, target, 3)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    for i, w in enumerate(trained):
        np.testing.assert_allclose(np.asarray(engine.state[f"W{i}"]), w, rtol=1e-4, atol=1e-6, err_msg=f"W{i}")

    def temporaries(remat: bool) -> int:
        compiled = onnxtrain.load(trainable, remat=remat).lower(feeds, 0).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    kept = BLOCKS * BATCH * HIDDEN * 4  # every block's Tanh
    plain, recomputed = temporaries(False), temporaries(True)
    assert plain > kept, (plain, kept)  # without: the activations are all live at the turn
    assert recomputed < 0.35 * plain, (recomputed, plain)  # a jax.checkpoint'ed slice measured 1.0x here


def test_recomputed_dropout_draws_the_forward_pass_masks():
    """A recomputed Dropout must drop what the forward pass dropped, or the gradient is of another function: the
    same steps with and without remat (same seed) give the same losses and weights. (No other reference draws
    onnxtrain's masks; the PyTorch comparisons above run without dropout.)"""
    m = module(dropout=0.5)
    model = onnxtrain.make_trainable(export(m, "torchscript-train"), loss="cross_entropy", optimizer="sgd",
                                     learning_rate=0.1, train_mode=True)
    engines = [onnxtrain.load(model, seed=3, remat=remat) for remat in (False, True)]
    for x, y in data(3):
        losses = [float(e.train_step({"x": x, "target": y})["loss"]) for e in engines]
        np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    for name in engines[0].state:
        np.testing.assert_allclose(np.asarray(engines[1].state[name]), np.asarray(engines[0].state[name]),
                                   rtol=1e-4, atol=1e-6, err_msg=name)


class LoopModule(torch.nn.Module):
    """A recurrence over a fed step count: TorchScript exports it as an ONNX Loop."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.cell, self.head = torch.nn.Linear(16, 16), torch.nn.Linear(16, 3)

    def forward(self, x, steps):
        h = x
        for _ in range(int(steps)):
            h = torch.tanh(self.cell(h) + x)
        return self.head(h)


def test_a_loop_inside_a_recomputed_segment_trains_like_pytorch():
    module = LoopModule()
    x = np.random.default_rng(2).standard_normal((4, 16), np.float32)
    target = np.array([0, 2, 1, 2], np.int64)
    steps = np.array(4, np.int64)
    buffer = io.BytesIO()
    torch.onnx.export(torch.jit.script(module), (torch.from_numpy(x), torch.tensor(4)), buffer, dynamo=False,
                      input_names=["x", "steps"], output_names=["y"])
    model = onnx.load_from_string(buffer.getvalue())
    assert any(n.op_type == "Loop" for n in model.graph.node)
    trainable = onnxtrain.make_trainable(model, loss="cross_entropy", optimizer="sgd", learning_rate=LR)
    engine = onnxtrain.load(trainable, remat=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the trip count compiles in as a constant (docs/semantics.md)
        losses = [float(engine.train_step({"x": x, "steps": steps, "target": target})["loss"]) for _ in range(3)]
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    expected = []
    for _ in range(3):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(module(torch.from_numpy(x), 4), torch.from_numpy(target))
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    for name, p in module.named_parameters():
        np.testing.assert_allclose(np.asarray(engine.state[name]), p.detach().numpy(), rtol=1e-4, atol=1e-6,
                                   err_msg=name)


def test_an_unknown_remat_mode_raises_at_load():
    with pytest.raises(OptionError, match="remat='attn' is not one of False, True or 'attention'"):
        onnxtrain.load(residual_mlp()[0], remat="attn")


def test_an_attention_whose_probabilities_are_also_a_graph_output_trains_like_pytorch():
    """remat="attention" recomputes an attention only where nothing outside it reads its probabilities: here a
    Cast outside the differentiated slice makes them a graph output, so this one is kept as it is, and the
    steps are PyTorch's SGD ones."""
    rng = np.random.default_rng(4)
    w = rng.standard_normal((8, 8)).astype(np.float32) / 3
    nodes = [helper.make_node("MatMul", ["X", "W"], ["q"]),
             helper.make_node("Transpose", ["q"], ["kt"]),
             helper.make_node("MatMul", ["q", "kt"], ["scores"]),
             helper.make_node("Softmax", ["scores"], ["p"]),
             helper.make_node("MatMul", ["p", "q"], ["o"]),
             helper.make_node("Relu", ["o"], ["Y"]),
             helper.make_node("Cast", ["p"], ["P"], to=TensorProto.FLOAT)]
    graph = helper.make_graph(nodes, "attention", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [4, 8])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [4, 8]),
                               helper.make_tensor_value_info("P", TensorProto.FLOAT, [4, 4])],
                              [numpy_helper.from_array(w, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    trainable = onnxtrain.make_trainable(model, loss="mse", optimizer="sgd", learning_rate=LR)
    x, target = rng.standard_normal((4, 8)).astype(np.float32), rng.standard_normal((4, 8)).astype(np.float32)
    engine = onnxtrain.load(trainable, remat="attention")
    losses = [float(engine.train_step({"X": x, "target": target})["loss"]) for _ in range(3)]
    weight = torch.tensor(w, requires_grad=True)
    optimizer = torch.optim.SGD([weight], lr=LR)
    expected = []
    for _ in range(3):
        optimizer.zero_grad()
        q = torch.from_numpy(x) @ weight
        loss = torch.nn.functional.mse_loss(torch.relu(torch.softmax(q @ q.T, -1) @ q), torch.from_numpy(target))
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(engine.state["W"]), weight.detach().numpy(), rtol=1e-5, atol=1e-6)
