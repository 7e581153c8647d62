"""Loops whose trip count is decided at run time are differentiable: gradients against PyTorch autograd on the
same TorchScript module, and a huge static trip count compiles as a loop instead of unrolling."""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import onnxtrain


class ForRange(torch.nn.Module):
    """`for i in range(n)` with n a model input: a Loop whose M is fed at run time."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, n):
        for _ in range(int(n)):
            x = torch.tanh(self.lin(x))
        return x


class WhileSmall(torch.nn.Module):
    """A `while` loop whose condition depends on the data and the weights."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = x
        while bool(h.abs().sum() < 100.0):  # 4-5 iterations, doubling
            h = h * 2.0 + torch.tanh(self.lin(h))
        return h


def exported(m: torch.nn.Module, args: tuple, names: list[str]) -> onnx.ModelProto:
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(m, args, f, input_names=names, output_names=["y"], dynamo=False)
    model = onnx.load_from_string(f.getvalue())
    assert any(node.op_type == "Loop" for node in model.graph.node)
    return model


@pytest.mark.parametrize("kind", ["for_range", "while"])
def test_training_through_a_run_time_loop_matches_pytorch(kind):
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 4)).astype(np.float32)
    target = rng.normal(size=(3, 4)).astype(np.float32)
    if kind == "for_range":
        module, n = torch.jit.script(ForRange()), np.array(3, np.int64)
        feeds_per_step = [{"x": x, "n": np.array(k, np.int64)} for k in (3, 5, 2, 4)]
        model = exported(module, (torch.from_numpy(x), torch.from_numpy(n)), ["x", "n"])
    else:
        module = torch.jit.script(WhileSmall())
        feeds_per_step = [{"x": x}] * 4
        model = exported(module, (torch.from_numpy(x),), ["x"])
    engine = onnxtrain.load(onnxtrain.make_trainable(model, loss="mse", optimizer="sgd", learning_rate=0.002))
    opt = torch.optim.SGD(module.parameters(), lr=0.002)
    for feeds in feeds_per_step:
        loss = float(engine.train_step({**feeds, "target": target})["loss"])
        opt.zero_grad()
        args = [torch.from_numpy(v) for v in feeds.values()]
        expected = torch.nn.functional.mse_loss(module(*args), torch.from_numpy(target))
        expected.backward()
        opt.step()
        np.testing.assert_allclose(loss, expected.item(), rtol=1e-5)
    for name, value in module.state_dict().items():
        np.testing.assert_allclose(np.asarray(engine.state[name]), value.numpy(), rtol=1e-5, atol=1e-6,
                                   err_msg=name)


def loop_model(trip: int, body_nodes: list, body_outputs: list, initial: np.ndarray) -> onnx.ModelProto:
    """A model `y = Loop(M=trip, x0=initial)` (no condition) whose body is given; everything static."""
    shape = ["n"] * initial.ndim  # a symbolic length: the carried value may grow
    x = helper.make_tensor_value_info("x", TensorProto.INT64, shape)
    body = helper.make_graph(
        body_nodes, "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("c", TensorProto.BOOL, []), x],
        [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
         *[helper.make_tensor_value_info(name, TensorProto.INT64, shape) for name in body_outputs]],
    )
    graph = helper.make_graph(
        [helper.make_node("Loop", ["M", "", "x0"], ["y"], body=body)], "g", [],
        [helper.make_tensor_value_info("y", TensorProto.INT64, shape)],
        [numpy_helper.from_array(np.array(trip, np.int64), "M"), numpy_helper.from_array(initial, "x0")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_huge_static_trip_count_runs_as_a_compiled_loop():
    """Issue 16: a static M of a million was unrolled in Python (minutes); past the unrolling limit it is a
    lax loop. Checked against the closed form, sum of i for i < M."""
    trip = 1_000_000
    model = loop_model(trip, [helper.make_node("Add", ["x", "i"], ["y"])], ["y"], np.array(0, np.int64))
    assert int(onnxtrain.load(model).infer({})["y"]) == trip * (trip - 1) // 2


def test_a_huge_loop_that_cannot_compile_is_refused():
    """A body whose carried value grows cannot be a lax loop; unrolling it a million times is refused."""
    body = [helper.make_node("Constant", [], ["one"], value=numpy_helper.from_array(np.array([1], np.int64))),
            helper.make_node("Concat", ["x", "one"], ["y"], axis=0)]
    model = loop_model(1_000_000, body, ["y"], np.array([1], np.int64))
    with pytest.raises(onnxtrain.errors.NodeError, match="more than the 1024 iterations it may unroll"):
        onnxtrain.load(model).infer({})


def test_a_torchscript_while_runs_in_jax_function():
    """TorchScript exports `while` as a Loop with M = 2**63 - 1: trying it as a scan allocated range(M) eagerly
    outside jit and aborted the process."""
    import jax

    torch.manual_seed(0)
    module = torch.jit.script(WhileSmall())
    x = np.random.default_rng(1).normal(size=(3, 4)).astype(np.float32)
    fn, params = onnxtrain.jax_function(exported(module, (torch.from_numpy(x),), ["x"]))
    with jax.enable_x64(True):
        ours = np.asarray(fn(params, {"x": x})["y"])
    np.testing.assert_allclose(ours, module(torch.from_numpy(x)).detach().numpy(), rtol=1e-5, atol=1e-5)


class HigherOrderOps(torch.nn.Module):
    """torch's control-flow operators, which the dynamo exporter turns into If, Loop and Scan: `torch.cond` on the
    data, a `while_loop` over a counter (carried, as torch.export needs), and a `scan` over the sequence axis, each
    through the same Linear. `unrolled` computes the same in plain Python: the reference, since torch 2.13's own
    while_loop backward gives a closed-over parameter the wrong gradient when the carried value needs none, as
    the input here (the family of pytorch/pytorch#184528, fixed there for scan): onnxtrain's gradients are the
    unrolled module's, torch's while_loop's are not."""

    def __init__(self):
        super().__init__()
        self.cell, self.other, self.head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)

    def forward(self, xs):
        from torch._higher_order_ops import scan, while_loop

        x = xs[0]
        _, h = while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, torch.tanh(self.cell(v))),
                          (torch.zeros((), dtype=torch.int64), x))
        h = torch.cond(x.sum() > 0, lambda v: torch.tanh(self.cell(v)), lambda v: torch.relu(self.other(v)), (h,))

        def step(v, x_t):
            v = torch.tanh(self.cell(v) + x_t)
            return v.clone(), v.clone()

        h, ys = scan(step, h, xs, dim=0)
        return self.head(ys.mean(0) + h)

    def unrolled(self, xs):
        x = h = xs[0]
        for _ in range(3):
            h = torch.tanh(self.cell(h))
        h = torch.tanh(self.cell(h)) if x.sum() > 0 else torch.relu(self.other(h))
        ys = []
        for x_t in xs:
            h = torch.tanh(self.cell(h) + x_t)
            ys.append(h)
        return self.head(torch.stack(ys).mean(0) + h)


def test_torch_control_flow_operators_train_as_their_unrolled_module():
    """If (both branches taken over the steps), Loop and Scan from the dynamo exporter, differentiated through."""
    torch.manual_seed(0)
    module = HigherOrderOps().eval()
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(4, 3, 4)).astype(np.float32)
    target = rng.normal(size=(3, 1)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = onnxtrain.from_torch(module, (torch.from_numpy(xs),), input_names=["xs"], loss="mse",
                                     optimizer="sgd", learning_rate=0.1)
    assert {"If", "Loop", "Scan"} <= {node.op_type for node in model.graph.node}
    engine = onnxtrain.load(model)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    for sign in (1, -1, 1):  # the If's condition: the first element's sum, positive then negative
        feed = xs.copy()
        feed[0] = sign * np.abs(feed[0])
        loss = float(engine.train_step({"xs": feed, "target": target})["loss"])
        opt.zero_grad()
        expected = torch.nn.functional.mse_loss(module.unrolled(torch.from_numpy(feed)), torch.from_numpy(target))
        expected.backward()
        opt.step()
        np.testing.assert_allclose(loss, expected.item(), rtol=1e-5)
    for name, value in module.named_parameters():
        np.testing.assert_allclose(np.asarray(engine.state[name]), value.detach().numpy(), rtol=1e-5, atol=1e-6,
                                   err_msg=name)
