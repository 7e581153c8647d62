"""Build the bundled example: a small MLP regression training model (Gradient + Adam) and its data.

    python examples/build_regression.py     # writes onnxtrain/examples/regression.{onnx,npz}

The model learns y = sin(2 x0) * cos(x1) from 1,024 samples. Its initialization graph draws the weights
(RandomNormal, scaled for ReLU) and resets Adam's step count and moments, so `init()` starts a fresh run.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HIDDEN = 32
TRAINING = "ai.onnx.preview.training"
OUT = Path(__file__).resolve().parent.parent / "onnxtrain" / "examples"


def value(name: str, shape, elem_type=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem_type, shape)


def const(name: str, array) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(array), name)


def build() -> onnx.ModelProto:
    shapes = {"W1": (2, HIDDEN), "B1": (HIDDEN,), "W2": (HIDDEN, HIDDEN), "B2": (HIDDEN,), "W3": (HIDDEN, 1), "B3": (1,)}
    params = list(shapes)
    inference = helper.make_graph(
        [
            helper.make_node("Gemm", ["X", "W1", "B1"], ["Z1"]),
            helper.make_node("Relu", ["Z1"], ["H1"]),
            helper.make_node("Gemm", ["H1", "W2", "B2"], ["Z2"]),
            helper.make_node("Relu", ["Z2"], ["H2"]),
            helper.make_node("Gemm", ["H2", "W3", "B3"], ["Y"]),
        ],
        "regression_mlp",
        [value("X", ["batch", 2])],
        [value("Y", ["batch", 1])],
        [const(p, np.zeros(s, np.float32)) for p, s in shapes.items()],
    )
    moments = [f"{k}_{p}" for k in ("V", "H") for p in params]
    algorithm = helper.make_graph(
        [
            helper.make_node("Sub", ["Y", "Target"], ["Err"]),
            helper.make_node("Mul", ["Err", "Err"], ["Err2"]),
            helper.make_node("ReduceMean", ["Err2"], ["loss"], keepdims=0),
            helper.make_node("Gradient", params, [f"G_{p}" for p in params], domain=TRAINING, xs=params, y="loss"),
            helper.make_node(
                "Adam",
                ["LearningRate", "Step"] + params + [f"G_{p}" for p in params] + moments,
                [f"{p}_next" for p in params + moments],
                domain=TRAINING, alpha=0.9, beta=0.999, epsilon=1e-7,
            ),
            helper.make_node("Add", ["Step", "One"], ["Step_next"]),
        ],
        "adam_step",
        [value("Target", ["batch", 1])],
        [value("loss", [])]
        + [value(f"{p}_next", list(shapes[p])) for p in params]
        + [value(f"{m}_next", list(shapes[m[2:]])) for m in moments]
        + [value("Step_next", [], TensorProto.INT64)],
        [const("LearningRate", np.float32(3e-3)), const("Step", np.int64(0)), const("One", np.int64(1))]
        + [const(m, np.zeros(shapes[m[2:]], np.float32)) for m in moments],
    )
    init_nodes, init_outputs = [], []
    for p, shape in shapes.items():
        if p.startswith("W"):
            scale = float(np.sqrt(2.0 / shape[0]))
            init_nodes.append(helper.make_node("RandomNormal", [], [f"{p}_0"], shape=list(shape), scale=scale))
        else:
            init_nodes.append(helper.make_node("Constant", [], [f"{p}_0"], value=const(p, np.zeros(shape, np.float32))))
        init_outputs.append(value(f"{p}_0", list(shape)))
    for m in moments:
        init_nodes.append(helper.make_node("Constant", [], [f"{m}_0"], value=const(m, np.zeros(shapes[m[2:]], np.float32))))
        init_outputs.append(value(f"{m}_0", list(shapes[m[2:]])))
    init_nodes.append(helper.make_node("Constant", [], ["Step_0"], value=const("s", np.int64(0))))
    init_outputs.append(value("Step_0", [], TensorProto.INT64))
    initialization = helper.make_graph(init_nodes, "init_weights_and_adam", [], init_outputs)
    info = helper.make_training_info(
        algorithm,
        [(p, f"{p}_next") for p in params + moments] + [("Step", "Step_next")],
        initialization,
        [(p, f"{p}_0") for p in params + moments] + [("Step", "Step_0")],
    )
    model = helper.make_model(
        inference, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(TRAINING, 1)],
        producer_name="onnxtrain-example",
    )
    model.training_info.append(info)
    onnx.checker.check_model(model)
    return model


def data(n: int = 1024) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.uniform(-2, 2, size=(n, 2)).astype(np.float32)
    y = (np.sin(2 * x[:, :1]) * np.cos(x[:, 1:])).astype(np.float32)
    return {"X": x, "Target": y}


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    onnx.save(build(), OUT / "regression.onnx")
    np.savez(OUT / "regression.npz", **data())
    print(f"wrote {OUT / 'regression.onnx'} and {OUT / 'regression.npz'}")
