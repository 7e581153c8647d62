"""Build the bundled example: a small MLP regression model made trainable (Gradient + Adam) and its data.

    python examples/build_regression.py     # writes onnxtrain/examples/regression.{onnx,npz}

The model learns y = sin(2 x0) * cos(x1) from 1,024 samples. `make_trainable(..., reinitialize=True)` gives
it an initialization graph that draws the weights (He-scaled RandomNormal) and resets Adam's state, so `init()`
starts a fresh run.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import onnxtrain

HIDDEN = 32
OUT = Path(__file__).resolve().parent.parent / "onnxtrain" / "examples"


def inference_model() -> onnx.ModelProto:
    shapes = {
        "W1": (2, HIDDEN), "B1": (HIDDEN,), "W2": (HIDDEN, HIDDEN), "B2": (HIDDEN,), "W3": (HIDDEN, 1), "B3": (1,),
    }
    graph = helper.make_graph(
        [
            helper.make_node("Gemm", ["X", "W1", "B1"], ["Z1"]),
            helper.make_node("Relu", ["Z1"], ["H1"]),
            helper.make_node("Gemm", ["H1", "W2", "B2"], ["Z2"]),
            helper.make_node("Relu", ["Z2"], ["H2"]),
            helper.make_node("Gemm", ["H2", "W3", "B3"], ["Y"]),
        ],
        "regression_mlp",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", 2])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", 1])],
        [numpy_helper.from_array(np.zeros(s, np.float32), p) for p, s in shapes.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="onnxtrain-example")


def build() -> onnx.ModelProto:
    model = onnxtrain.make_trainable(inference_model(), loss="mse", optimizer="adam", learning_rate=3e-3,
                                     epsilon=1e-7, reinitialize=True)
    onnx.checker.check_model(model)
    return model


def data(n: int = 1024) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.uniform(-2, 2, size=(n, 2)).astype(np.float32)
    y = (np.sin(2 * x[:, :1]) * np.cos(x[:, 1:])).astype(np.float32)
    return {"X": x, "target": y}


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    onnx.save(build(), OUT / "regression.onnx")
    np.savez(OUT / "regression.npz", **data())
    print(f"wrote {OUT / 'regression.onnx'} and {OUT / 'regression.npz'}")
