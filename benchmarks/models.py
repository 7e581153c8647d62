"""The benchmark models, each as an ONNX inference graph plus the same math hand-written in JAX and PyTorch.

The MLP and CNN graphs are written with onnx.helper (their PyTorch peer is built from the same weights); the
transformer and LSTM are PyTorch modules exported with the TorchScript exporter, as users get them, and their
JAX peer reads the module's own parameters. Every model maps X [N, ...] to logits Y [N, CLASSES].
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
EXPORT_OPSET = 20  # the first opset with a Gelu operator, so the exporter writes one node, not its erf expansion
CLASSES = 10


def _model(nodes, inputs, outputs, weights) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "bench", inputs, outputs,
                              [numpy_helper.from_array(v, k) for k, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])


def mlp(rng: np.random.Generator, sizes=(784, 256, 256, 10)):
    """Gemm(transB=1) + Relu layers, as PyTorch exports nn.Linear."""
    weights, nodes, x = {}, [], "X"
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        weights[f"W{i}"] = (rng.normal(size=(n_out, n_in)) * np.sqrt(2 / n_in)).astype(np.float32)
        weights[f"B{i}"] = np.zeros(n_out, np.float32)
        nodes.append(helper.make_node("Gemm", [x, f"W{i}", f"B{i}"], [f"Z{i}"], transB=1))
        x = f"Z{i}"
        if i < len(sizes) - 2:
            nodes.append(helper.make_node("Relu", [x], [f"H{i}"]))
            x = f"H{i}"
    nodes[-1].output[0] = "Y"
    model = _model(nodes, [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", sizes[0]])],
                   [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", sizes[-1]])], weights)

    def forward(p, x):
        for i in range(len(sizes) - 1):
            x = x @ p[f"W{i}"].T + p[f"B{i}"]
            if i < len(sizes) - 2:
                x = jax.nn.relu(x)
        return x

    return model, weights, forward, (784,)


def cnn(rng: np.random.Generator):
    """Conv(1->8) Relu MaxPool Conv(8->16) Relu MaxPool Flatten Gemm(784->64) Relu Gemm(64->10), NCHW in ONNX."""
    shapes = {"C1": (8, 1, 3, 3), "C2": (16, 8, 3, 3), "F1": (64, 16 * 7 * 7), "F2": (10, 64)}
    weights = {}
    for name, shape in shapes.items():
        fan_in = int(np.prod(shape[1:]))
        weights[name] = (rng.normal(size=shape) * np.sqrt(2 / fan_in)).astype(np.float32)
        weights[f"{name}b"] = np.zeros(shape[0], np.float32)
    nodes = [
        helper.make_node("Conv", ["X", "C1", "C1b"], ["a1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["a1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "C2", "C2b"], ["a2"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["a2"], ["r2"]),
        helper.make_node("MaxPool", ["r2"], ["p2"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["p2"], ["f"]),
        helper.make_node("Gemm", ["f", "F1", "F1b"], ["h"], transB=1),
        helper.make_node("Relu", ["h"], ["hr"]),
        helper.make_node("Gemm", ["hr", "F2", "F2b"], ["Y"], transB=1),
    ]
    model = _model(nodes, [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 1, 28, 28])],
                   [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 10])], weights)

    def pool(x):  # NHWC 2x2 stride-2 max pooling by reshape: what a JAX user writes for XLA-CPU
        n, h, w, c = x.shape
        return x.reshape(n, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))

    def conv(x, w, b):  # NHWC activations, weights OIHW -> HWIO
        y = jax.lax.conv_general_dilated(x, jnp.transpose(w, (2, 3, 1, 0)), (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return y + b

    def forward(p, x):
        x = jnp.transpose(x, (0, 2, 3, 1))
        x = pool(jax.nn.relu(conv(x, p["C1"], p["C1b"])))
        x = pool(jax.nn.relu(conv(x, p["C2"], p["C2b"])))
        x = jnp.transpose(x, (0, 3, 1, 2)).reshape(x.shape[0], -1)  # ONNX Flatten order (C, H, W)
        x = jax.nn.relu(x @ p["F1"].T + p["F1b"])
        return x @ p["F2"].T + p["F2b"]

    return model, weights, forward, (1, 28, 28)


# ----- transformer encoder and LSTM: PyTorch modules, exported ---------------------------------------------------


class EncoderBlock(torch.nn.Module):
    """Pre-norm multi-head self-attention + GELU feed-forward, written out op by op (torch's fused
    TransformerEncoderLayer does not trace)."""

    def __init__(self, d: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.ff1, self.ff2 = torch.nn.Linear(d, ffn), torch.nn.Linear(ffn, d)
        for norm in (self.norm1, self.norm2):  # distinct values: the exporter would merge identical initializers
            torch.nn.init.normal_(norm.weight, 1.0, 0.02)
            torch.nn.init.normal_(norm.bias, 0.0, 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attention = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1)
        x = x + self.proj((attention @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.ff2(torch.nn.functional.gelu(self.ff1(self.norm2(x))))


class Encoder(torch.nn.Module):
    """Encoder blocks, mean over the sequence, linear classifier."""

    def __init__(self, layers: int, d: int, heads: int, ffn: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList(EncoderBlock(d, heads, ffn) for _ in range(layers))
        self.head = torch.nn.Linear(d, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=1))


class LSTMClassifier(torch.nn.Module):
    """One LSTM layer, then a linear classifier on the last step's hidden state."""

    def __init__(self, inputs: int, hidden: int):
        super().__init__()
        self.lstm = torch.nn.LSTM(inputs, hidden, batch_first=True)
        self.head = torch.nn.Linear(hidden, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


def export(module: torch.nn.Module, input_shape: tuple[int, ...]) -> onnx.ModelProto:
    """The TorchScript exporter's graph with a symbolic batch dimension."""
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        # about sequences of different lengths in one batch, which these models are never fed
        warnings.filterwarnings("ignore", message="Exporting a model to ONNX with a batch_size other than 1")
        torch.onnx.export(module, (torch.zeros(2, *input_shape),), buffer, dynamo=False, input_names=["X"],
                          output_names=["Y"], dynamic_axes={"X": {0: "N"}, "Y": {0: "N"}}, opset_version=EXPORT_OPSET)
    return onnx.load_from_string(buffer.getvalue())


def torch_params(module: torch.nn.Module) -> dict[str, np.ndarray]:
    return {name: value.detach().numpy().copy() for name, value in module.state_dict().items()}


def linear(x: jax.Array, p: dict, name: str) -> jax.Array:
    """nn.Linear with PyTorch's [out, in] weight; XLA folds the transpose into the dot."""
    return x @ p[f"{name}.weight"].T + p[f"{name}.bias"]


def layer_norm(x: jax.Array, p: dict, name: str, eps: float = 1e-5) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * p[f"{name}.weight"] + p[f"{name}.bias"]


def transformer(layers: int = 2, d: int = 128, heads: int = 4, seq: int = 64, ffn: int = 256):
    """(ONNX model, params, JAX forward, torch module, input shape) of the pre-norm encoder classifier."""
    torch.manual_seed(0)
    module = Encoder(layers, d, heads, ffn)
    head_dim = d // heads

    def block(p: dict, name: str, x: jax.Array) -> jax.Array:
        b, t, _ = x.shape
        qkv = linear(layer_norm(x, p, f"{name}.norm1"), p, f"{name}.qkv").reshape(b, t, 3, heads, head_dim)
        q, k, v = qkv.transpose(2, 0, 3, 1, 4)  # [b, heads, t, head_dim]: batched matmuls beat einsum here on CPU
        attention = jax.nn.softmax(q @ k.swapaxes(-1, -2) / head_dim**0.5, axis=-1)
        x = x + linear((attention @ v).swapaxes(1, 2).reshape(b, t, d), p, f"{name}.proj")
        hidden = jax.nn.gelu(linear(layer_norm(x, p, f"{name}.norm2"), p, f"{name}.ff1"), approximate=False)
        return x + linear(hidden, p, f"{name}.ff2")

    def forward(p: dict, x: jax.Array) -> jax.Array:
        for i in range(layers):
            x = block(p, f"blocks.{i}", x)
        return linear(x.mean(axis=1), p, "head")

    return export(module, (seq, d)), torch_params(module), forward, module, (seq, d)


def lstm(inputs: int = 64, hidden: int = 128, seq: int = 32):
    """(ONNX model, params, JAX forward, torch module, input shape) of the LSTM classifier."""
    torch.manual_seed(0)
    module = LSTMClassifier(inputs, hidden)

    def forward(p: dict, x: jax.Array) -> jax.Array:
        # the input projection of every step is one matmul; the scan carries only h @ W_hh
        bias = p["lstm.bias_ih_l0"] + p["lstm.bias_hh_l0"]
        projected = jnp.swapaxes(x, 0, 1) @ p["lstm.weight_ih_l0"].T + bias  # [T, N, 4H]
        w_hh = p["lstm.weight_hh_l0"].T

        def step(carry: tuple, xt: jax.Array) -> tuple:
            h, c = carry
            i, f, g, o = jnp.split(xt + h @ w_hh, 4, axis=-1)  # PyTorch's gate order
            c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
            return (jax.nn.sigmoid(o) * jnp.tanh(c), c), None

        zeros = jnp.zeros((x.shape[0], hidden), x.dtype)
        (h, _), _ = jax.lax.scan(step, (zeros, zeros), projected)
        return linear(h, p, "head")

    return export(module, (seq, inputs)), torch_params(module), forward, module, (seq, inputs)


# ----- PyTorch peers of the onnx.helper models ---------------------------------------------------------------------


def load_weights(module: torch.nn.Module, weights: dict[str, np.ndarray]) -> torch.nn.Module:
    """`weights`: state_dict name -> array; every parameter of the module must be given."""
    module.load_state_dict({name: torch.from_numpy(value.copy()) for name, value in weights.items()})
    return module


def torch_mlp(weights: dict[str, np.ndarray], sizes=(784, 256, 256, 10)) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for n_in, n_out in zip(sizes[:-1], sizes[1:]):
        layers += [torch.nn.Linear(n_in, n_out), torch.nn.ReLU()]
    module = torch.nn.Sequential(*layers[:-1])
    return load_weights(module, {f"{2 * i}.{kind}": weights[f"{prefix}{i}"] for i in range(len(sizes) - 1)
                                 for kind, prefix in (("weight", "W"), ("bias", "B"))})


def torch_cnn(weights: dict[str, np.ndarray]) -> torch.nn.Module:
    nn = torch.nn
    module = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1),
                           nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(16 * 7 * 7, 64), nn.ReLU(),
                           nn.Linear(64, 10))
    layer_of = {"C1": 0, "C2": 3, "F1": 7, "F2": 9}
    return load_weights(module, {f"{index}.{kind}": weights[name + suffix] for name, index in layer_of.items()
                                 for kind, suffix in (("weight", ""), ("bias", "b"))})


MODELS = ("mlp", "cnn", "transformer", "lstm")


@dataclass(frozen=True)
class Bench:
    """One benchmark model in every form the peers need."""

    name: str
    model: onnx.ModelProto  # inference graph: X -> logits Y [N, CLASSES]
    params: dict[str, np.ndarray]  # the JAX peer's parameters
    forward: Callable[[dict, jax.Array], jax.Array]  # the same math in JAX
    module: torch.nn.Module  # the same math in PyTorch, holding the same weights
    input_shape: tuple[int, ...]  # of one sample


def build(name: str) -> Bench:
    """The named model (mlp, cnn, transformer, lstm) with deterministic weights."""
    if name == "mlp":
        model, weights, forward, shape = mlp(np.random.default_rng(0))
        return Bench(name, model, weights, forward, torch_mlp(weights), shape)
    if name == "cnn":
        model, weights, forward, shape = cnn(np.random.default_rng(0))
        return Bench(name, model, weights, forward, torch_cnn(weights), shape)
    if name in ("transformer", "lstm"):
        model, params, forward, module, shape = transformer() if name == "transformer" else lstm()
        return Bench(name, model, params, forward, module, shape)
    raise ValueError(f"unknown model {name!r}; expected one of {MODELS}")

