"""Channels-last activations between convolutions, pools and elementwise ops (onnxtrain/lower/layout.py):
every value the model can observe equals onnx's reference, whichever way it was held inside, and the layout
really saves the transposes it exists for."""

from __future__ import annotations

import jax
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import onnxtrain
from onnxtrain.placement import Placement
from nodes import graph_model, run_both, value

RNG = np.random.default_rng(0)


def rand(*shape) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def chain_model(opset: int = 21) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Conv, then elementwise ops of every operand kind (per-channel [C,1,1], scalar, full channels-first
    array, another channels-last value, a rank-5 operand that forces the channels-first form), pools and
    BatchNormalization, with intermediate values as graph outputs too."""
    n = helper.make_node
    nodes = [
        n("Conv", ["X", "W", "B"], ["c"], pads=[1, 1, 1, 1]),
        n("Relu", ["c"], ["r"]),
        n("Add", ["r", "bias"], ["a"]),  # [4, 1, 1] per-channel operand
        n("PRelu", ["a", "slope"], ["p"]),
        n("Mul", ["p", "half"], ["m"]),  # scalar operand
        n("Sub", ["m", "full"], ["s"]),  # full-size channels-first operand
        n("Add", ["s", "c"], ["res"]),  # two channels-last values
        n("MaxPool", ["res"], ["mp"], kernel_shape=[2, 2], strides=[2, 2]),
        n("BatchNormalization", ["mp", "scale", "shift", "mean", "var"], ["bn"]),
        n("Sigmoid", ["bn"], ["sg"]),
        n("AveragePool", ["sg"], ["ap"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], count_include_pad=0),
        n("Conv", ["ap", "W2"], ["c2"], strides=[2, 2]),
        n("Add", ["c2", "deep"], ["wide"]),  # [5, 1, 1, 1, 1] operand: the result has rank 5
        n("GlobalAveragePool", ["c2"], ["g"]),
        n("Flatten", ["g"], ["Y"]),
    ]
    weights = {
        "W": rand(4, 3, 3, 3), "B": rand(4), "bias": rand(4, 1, 1), "slope": np.abs(rand(4, 1, 1)),
        "half": np.array(0.5, np.float32), "full": rand(2, 4, 8, 8), "scale": rand(4), "shift": rand(4),
        "mean": rand(4), "var": np.abs(rand(4)) + 0.5, "W2": rand(6, 4, 3, 3), "deep": rand(5, 1, 1, 1, 1),
    }
    outputs = ["r", "res", "mp", "ap", "c2", "wide", "Y"]
    model = graph_model(nodes, [value("X", TensorProto.FLOAT, [2, 3, 8, 8])], outputs, weights, opset=opset)
    return model, {"X": rand(2, 3, 8, 8)}


def test_every_observable_value_matches_the_reference():
    model, feeds = chain_model()
    ours, theirs = run_both(model, feeds)
    for name, mine, ref in zip(["r", "res", "mp", "ap", "c2", "wide", "Y"], ours, theirs):
        assert mine.shape == ref.shape, name
        np.testing.assert_allclose(mine, ref, rtol=1e-4, atol=1e-5, err_msg=name)


def test_gradient_through_channels_last_values_matches_central_differences():
    model, feeds = chain_model()
    fn, params = onnxtrain.load(model, check=False).jax_function()

    def loss(p: dict) -> jax.Array:
        return (fn(p, feeds)["Y"] ** 2).sum()

    with jax.enable_x64(True):
        params64 = {k: np.asarray(v, np.float64) for k, v in params.items()}
        feeds = {k: v.astype(np.float64) for k, v in feeds.items()}
        grads = jax.grad(loss)(params64)
        rng = np.random.default_rng(1)
        for name in ("W", "bias", "scale", "W2"):
            direction = rng.standard_normal(params64[name].shape)
            eps = 1e-6
            plus = loss({**params64, name: params64[name] + eps * direction})
            minus = loss({**params64, name: params64[name] - eps * direction})
            np.testing.assert_allclose((grads[name] * direction).sum(), (plus - minus) / (2 * eps), rtol=1e-6,
                                       err_msg=name)


def count_transposes(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> int:
    fn, params = onnxtrain.load(model, check=False).jax_function()
    jaxpr = jax.make_jaxpr(lambda p: jax.grad(lambda q: fn(q, feeds)["Y"].sum())(p))(params)
    return sum(str(eq.primitive) == "transpose" for eq in jaxpr.jaxpr.eqns)


@pytest.mark.parametrize("between", ["Relu", "LeakyRelu", "Sigmoid"])
def test_a_cnn_gradient_transposes_only_at_the_boundaries(between: str):
    """Conv, an activation, MaxPool, Conv, an activation, Flatten: activations stay channels-last, so the
    forward and backward passes transpose X, the two kernels, the Flatten input and the gradients of those
    (at most 8), not every activation and its gradient (12 and more before). Four input channels: the
    convolutions are XLA's, not the first-layer multiply-adds (whose kernel gradient transposes each tap)."""
    n = helper.make_node
    nodes = [
        n("Conv", ["X", "W1"], ["c1"], pads=[1, 1, 1, 1]), n(between, ["c1"], ["a1"]),
        n("MaxPool", ["a1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        n("Conv", ["p1", "W2"], ["c2"]), n(between, ["c2"], ["a2"]), n("Flatten", ["a2"], ["Y"]),
    ]
    weights = {"W1": rand(4, 4, 3, 3), "W2": rand(5, 4, 3, 3)}
    model = graph_model(nodes, [value("X", TensorProto.FLOAT, [2, 4, 8, 8])], ["Y"], weights)
    assert count_transposes(model, {"X": rand(2, 4, 8, 8)}) <= 8


@pytest.mark.parametrize("pool", ["MaxPool", "AveragePool"])
@pytest.mark.parametrize(
    "conv_attrs", [dict(pads=[1, 1, 1, 1]), dict(strides=[2, 1], dilations=[1, 2], pads=[2, 0, 1, 3])]
)
@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_a_pool_reading_a_shallow_convolution_at_its_window_offsets(
    pool: str, conv_attrs: dict, group: int, platform: str, monkeypatch: pytest.MonkeyPatch
):
    """A tiled pool after a few-channel (group 1) or depthwise (group 2, 2 outputs per group) convolution and
    elementwise ops evaluates them at each window offset (layout.ChannelsLast.at) when traced for a CPU, an
    odd-sized remainder cropped; traced for a GPU it pools XLA's convolution, computed once and differentiated
    once. Values and gradients as the reference's either way."""
    monkeypatch.setattr(Placement, "platform", property(lambda self: platform))
    n = helper.make_node
    channels_out = 5 if group == 1 else 4
    nodes = [n("Conv", ["X", "W", "B"], ["c"], group=group, **conv_attrs), n("Relu", ["c"], ["r"]),
             n("Mul", ["r", "gain"], ["m"]), n(pool, ["m"], ["Y"], kernel_shape=[2, 3], strides=[2, 3])]
    weights = {"W": rand(channels_out, 2 // group, 3, 2), "B": rand(channels_out), "gain": rand(1, channels_out, 1, 1)}
    model = graph_model(nodes, [value("X", TensorProto.FLOAT, [3, 2, 9, 11])], ["Y"], weights)
    feeds = {"X": rand(3, 2, 9, 11)}
    ours, theirs = run_both(model, feeds)
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-5, atol=1e-5)
    fn, params = onnxtrain.load(model, check=False).jax_function()
    with jax.enable_x64(True):
        params64 = {k: np.asarray(v, np.float64) for k, v in params.items()}
        x64 = {"X": feeds["X"].astype(np.float64)}

        def loss(p: dict) -> jax.Array:
            return (fn(p, x64)["Y"] ** 2).sum()

        grad = jax.grad(loss)(params64)["W"]
        if platform == "gpu":  # one forward convolution, one kernel gradient (one per window offset before)
            assert str(jax.make_jaxpr(jax.grad(loss))(params64)).count("conv_general_dilated[") == 2
        direction = np.random.default_rng(2).standard_normal(grad.shape)
        eps = 1e-6
        numeric = (loss({**params64, "W": params64["W"] + eps * direction})
                   - loss({**params64, "W": params64["W"] - eps * direction})) / (2 * eps)
        np.testing.assert_allclose((grad * direction).sum(), numeric, rtol=1e-6)


def hlo_transposes(engine: onnxtrain.Engine, feeds: dict[str, np.ndarray], algorithm: int | None = None) -> int:
    return engine.lower(feeds, algorithm).as_text().count("stablehlo.transpose")


def test_a_constant_kernel_is_stored_in_the_convolutions_order():
    """An inference model's kernels that only convolutions read are held as (*kernel, I, O) from load on
    (layout.KernelLast): the program transposes X into channels-last and the result back, nothing else (the
    two kernels were transposed on every call before: ResNet-18's inference went from 79 to 53 ms). Values as
    the reference's; jax_function still hands out the kernels in ONNX's order."""
    n = helper.make_node
    nodes = [n("Conv", ["X", "W1", "B1"], ["c1"], pads=[1, 1, 1, 1]), n("Relu", ["c1"], ["r"]),
             n("Conv", ["r", "W2"], ["Y"], strides=[2, 2])]
    weights = {"W1": rand(6, 4, 3, 3), "B1": rand(6), "W2": rand(5, 6, 3, 3)}
    model = graph_model(nodes, [value("X", TensorProto.FLOAT, [2, 4, 8, 8])], ["Y"], weights)
    feeds = {"X": rand(2, 4, 8, 8)}
    ours, theirs = run_both(model, feeds)
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-5, atol=1e-5)
    assert hlo_transposes(onnxtrain.load(model, check=False), feeds) == 2
    _, params = onnxtrain.load(model, check=False).jax_function()
    for name, weight in weights.items():
        np.testing.assert_array_equal(np.asarray(params[name]), weight)


def test_a_kernel_read_by_other_ops_keeps_onnx_order_and_every_value_matches():
    """W is a convolution's kernel and also a graph output's operand (ReduceSum); V is read by a top-level Conv
    and by a Conv inside an If branch (a subgraph reads ONNX's order): both stay as ONNX lays them out, and every
    output equals the reference's."""
    n = helper.make_node
    branch = helper.make_graph([n("Conv", ["X", "V"], ["inner"], pads=[1, 1, 1, 1])], "then", [],
                               [helper.make_value_info("inner", helper.TypeProto())])
    other = helper.make_graph([n("Neg", ["X"], ["inner2"])], "else", [],
                              [helper.make_value_info("inner2", helper.TypeProto())])
    nodes = [n("Conv", ["X", "W"], ["a"], pads=[1, 1, 1, 1]), n("ReduceSum", ["W"], ["w_sum"], keepdims=0),
             n("Conv", ["X", "V"], ["b"], pads=[1, 1, 1, 1]), n("If", ["flag"], ["c"], then_branch=branch,
                                                                  else_branch=other),
             n("Add", ["b", "c"], ["Y"])]
    weights = {"W": rand(4, 4, 3, 3), "V": rand(4, 4, 3, 3), "flag": np.array(True)}
    model = graph_model(nodes, [value("X", TensorProto.FLOAT, [2, 4, 6, 6])], ["a", "w_sum", "Y"], weights)
    ours, theirs = run_both(model, {"X": rand(2, 4, 6, 6)})
    for name, mine, ref in zip(["a", "w_sum", "Y"], ours, theirs):
        np.testing.assert_allclose(mine, ref, rtol=1e-5, atol=1e-5, err_msg=name)


FROZEN_SEED = 3


def test_a_frozen_kernel_in_a_trained_model_trains_as_pytorch():
    """make_trainable with the convolution frozen: its kernel is a constant that only a convolution reads, held
    in the convolution's order, while the Gradient node differentiates the head through it. Three SGD steps
    against PyTorch with the same frozen convolution."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(FROZEN_SEED)

    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    n = helper.make_node
    nodes = [n("Conv", ["X", "W", "B"], ["c"], pads=[1, 1, 1, 1]), n("Relu", ["c"], ["r"]),
             n("Flatten", ["r"], ["f"]), n("Gemm", ["f", "H", "hb"], ["Y"], transB=1)]
    weights = {"W": normal(4, 3, 3, 3) * 0.3, "B": normal(4) * 0.1, "H": normal(5, 4 * 6 * 6) * 0.1,
               "hb": normal(5) * 0.1}
    x, labels = normal(8, 3, 6, 6), rng.integers(0, 5, 8).astype(np.int64)

    def frozen(also_output: str | None = None) -> onnxtrain.Engine:
        model = graph_model(nodes + ([n("Identity", ["W"], ["w_out"])] if also_output else []),
                            [value("X", TensorProto.FLOAT, ["N", 3, 6, 6])], [], weights)
        model.graph.output.append(value("Y", TensorProto.FLOAT, ["N", 5]))
        if also_output:  # W read by another op too: it keeps ONNX's order, and each step transposes it
            model.graph.output.append(value("w_out", TensorProto.FLOAT, [4, 3, 3, 3]))
        return onnxtrain.load(onnxtrain.make_trainable(model, loss="cross_entropy", optimizer="sgd",
                                                       learning_rate=0.1, trainable=["H", "hb"]))

    engine = frozen()
    feeds = {"X": x, "target": labels}
    assert hlo_transposes(engine, feeds, 0) == hlo_transposes(frozen(also_output="w_out"), feeds, 0) - 1

    conv = torch.nn.Conv2d(3, 4, 3, padding=1)
    head = torch.nn.Linear(4 * 6 * 6, 5)
    with torch.no_grad():
        conv.weight.copy_(torch.from_numpy(weights["W"]))
        conv.bias.copy_(torch.from_numpy(weights["B"]))
        head.weight.copy_(torch.from_numpy(weights["H"]))
        head.bias.copy_(torch.from_numpy(weights["hb"]))
    conv.requires_grad_(False)
    optimizer = torch.optim.SGD(head.parameters(), lr=0.1)
    for _ in range(3):
        outputs = engine.train_step({"X": x, "target": labels})
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(head(torch.relu(conv(torch.from_numpy(x))).flatten(1)),
                                                 torch.from_numpy(labels))
        loss.backward()
        optimizer.step()
        np.testing.assert_allclose(np.asarray(outputs["loss"]), loss.item(), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(engine.state["H"]), head.weight.detach().numpy(), rtol=1e-5, atol=1e-6)
