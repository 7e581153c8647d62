"""The benchmark models, each as an ONNX inference graph plus the same math hand-written in JAX."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


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
