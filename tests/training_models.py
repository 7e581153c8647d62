"""Small training models (TrainingInfoProto) built with onnx.helper for the training tests."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

TRAINING = "ai.onnx.preview.training"
F = TensorProto.FLOAT


def tensor(name: str, value) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value), name)


def vi(name: str, elem_type: int = F, shape=None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, shape)


def model(graph, infos, opset: int = 17) -> onnx.ModelProto:
    m = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(TRAINING, 1)]
    )
    m.training_info.extend(infos)
    return m


def linear_regression(w0, b0, lr: float) -> onnx.ModelProto:
    """Y = X @ W + B; loss = mean((Y - T)^2); plain SGD through Gradient."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["XW"]), helper.make_node("Add", ["XW", "B"], ["Y"])],
        "linear",
        [vi("X", F, ["N", w0.shape[0]])],
        [vi("Y", F, ["N", w0.shape[1]])],
        [tensor("W", w0), tensor("B", b0)],
    )
    algorithm = helper.make_graph(
        [
            helper.make_node("Sub", ["Y", "T"], ["D"]),
            helper.make_node("Mul", ["D", "D"], ["D2"]),
            helper.make_node("ReduceMean", ["D2"], ["Loss"], keepdims=0),
            helper.make_node("Gradient", ["W", "B"], ["dW", "dB"], domain=TRAINING, xs=["W", "B"], y="Loss"),
            helper.make_node("Mul", ["LR", "dW"], ["sW"]),
            helper.make_node("Sub", ["W", "sW"], ["W_new"]),
            helper.make_node("Mul", ["LR", "dB"], ["sB"]),
            helper.make_node("Sub", ["B", "sB"], ["B_new"]),
        ],
        "sgd",
        [vi("T", F, ["N", w0.shape[1]])],
        [vi("Loss", F, []), vi("W_new", F, list(w0.shape)), vi("B_new", F, list(b0.shape))],
        [tensor("LR", np.float32(lr))],
    )
    info = helper.make_training_info(algorithm, [("W", "W_new"), ("B", "B_new")], None, None)
    return model(graph, [info])


def mlp_adam(params: dict[str, np.ndarray], lr: float, alpha=0.9, beta=0.999, epsilon=1e-6) -> onnx.ModelProto:
    """X -> Gemm(W1,B1) -> Relu -> Gemm(W2,B2) -> Y; MSE loss; Adam with its step count T and moments V, H as
    algorithm initializers (state); the initialization graph resets T, V and H."""
    names = ["W1", "B1", "W2", "B2"]
    n_in, n_out = params["W1"].shape[0], params["W2"].shape[1]
    graph = helper.make_graph(
        [
            helper.make_node("Gemm", ["X", "W1", "B1"], ["Z"]),
            helper.make_node("Relu", ["Z"], ["Hid"]),
            helper.make_node("Gemm", ["Hid", "W2", "B2"], ["Y"]),
        ],
        "mlp",
        [vi("X", F, ["N", n_in])],
        [vi("Y", F, ["N", n_out])],
        [tensor(n, params[n]) for n in names],
    )
    moments = [f"{k}_{n}" for k in ("V", "H") for n in names]
    algorithm = helper.make_graph(
        [
            helper.make_node("Sub", ["Y", "Target"], ["D"]),
            helper.make_node("Mul", ["D", "D"], ["D2"]),
            helper.make_node("ReduceMean", ["D2"], ["Loss"], keepdims=0),
            helper.make_node("Gradient", names, [f"G_{n}" for n in names], domain=TRAINING, xs=names, y="Loss"),
            helper.make_node(
                "Adam",
                ["R", "T"] + names + [f"G_{n}" for n in names] + moments,
                [f"{n}_new" for n in names] + [f"{m}_new" for m in moments],
                domain=TRAINING, alpha=alpha, beta=beta, epsilon=epsilon,
            ),
            helper.make_node("Add", ["T", "One"], ["T_new"]),
        ],
        "adam",
        [vi("Target", F, ["N", n_out])],
        [vi("Loss", F, [])] + [vi(f"{n}_new") for n in names + moments] + [vi("T_new", TensorProto.INT64, [])],
        [tensor("R", np.float32(lr)), tensor("T", np.int64(0)), tensor("One", np.int64(1))]
        + [tensor(m, np.zeros_like(params[m[2:]])) for m in moments],
    )
    initialization = helper.make_graph(
        [helper.make_node("Constant", [], ["T0"], value=tensor("t0", np.int64(0)))]
        + [
            helper.make_node("Constant", [], [f"{m}_0"], value=tensor(m, np.zeros_like(params[m[2:]])))
            for m in moments
        ],
        "reset_adam",
        [],
        [vi("T0", TensorProto.INT64, [])] + [vi(f"{m}_0") for m in moments],
    )
    info = helper.make_training_info(
        algorithm,
        [(n, f"{n}_new") for n in names + moments] + [("T", "T_new")],
        initialization,
        [("T", "T0")] + [(m, f"{m}_0") for m in moments],
    )
    return model(graph, [info])


def scaled_model_two_algorithms(w0, b0, lr_w: float, lr_b: float) -> onnx.ModelProto:
    """Y = W * X + B (elementwise). training_info[0] updates W, training_info[1] updates B, each by SGD on
    mean((Y - T)^2); each algorithm declares its own constant `LR` with a different value."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["W", "X"], ["WX"]), helper.make_node("Add", ["WX", "B"], ["Y"])],
        "scaled",
        [vi("X", F, ["N", w0.shape[0]])],
        [vi("Y", F, ["N", w0.shape[0]])],
        [tensor("W", w0), tensor("B", b0)],
    )

    def sgd(var: str, lr: float, suffix: str) -> onnx.TrainingInfoProto:
        algorithm = helper.make_graph(
            [
                helper.make_node("Sub", ["Y", "T"], ["D"]),
                helper.make_node("Mul", ["D", "D"], ["D2"]),
                helper.make_node("ReduceMean", ["D2"], [f"Loss{suffix}"], keepdims=0),
                helper.make_node("Gradient", [var], ["G"], domain=TRAINING, xs=[var], y=f"Loss{suffix}"),
                helper.make_node("Mul", ["LR", "G"], ["S"]),
                helper.make_node("Sub", [var, "S"], [f"{var}_new"]),
            ],
            f"sgd_{var}",
            [vi("T", F, ["N", w0.shape[0]])],
            [vi(f"Loss{suffix}", F, []), vi(f"{var}_new", F, list(w0.shape))],
            [tensor("LR", np.float32(lr))],
        )
        return helper.make_training_info(algorithm, [(var, f"{var}_new")], None, None)

    return model(graph, [sgd("W", lr_w, "0"), sgd("B", lr_b, "1")])


def matmul_sgd(learning_rate: float, optimizer: str = "sgd") -> onnx.ModelProto:
    """Y = X @ W (W zeros, [2, 1]) made trainable with make_trainable's MSE loss and SGD (or `optimizer`)."""
    import onnxtrain

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["Y"])], "lin",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 2])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 1])],
        [numpy_helper.from_array(np.zeros((2, 1), np.float32), "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return onnxtrain.make_trainable(model, loss="mse", optimizer=optimizer, learning_rate=learning_rate)
