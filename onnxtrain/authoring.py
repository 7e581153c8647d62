"""Turn an inference model into a training model: a standard TrainingInfoProto with loss nodes, a Gradient
node, the optimizer as ai.onnx.preview.training ops (or plain ops for SGD), the optimizer state and step count as
algorithm initializers, and an initialization graph that resets the optimizer (and optionally the weights)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .errors import OnnxTrainError
from .lower.registry import TRAINING_DOMAIN
from .train_mode import add_training_forward

LOSSES = ("mse", "cross_entropy", "bce_logits")
OPTIMIZERS = ("sgd", "momentum", "nesterov", "adagrad", "adam")
FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16)
LEARNING_RATE = "learning_rate"  # an algorithm input with a default: feed it to schedule the rate
STEP = "train.step"


@dataclass
class Builder:
    """Nodes, initializers and bindings of the algorithm and initialization graphs being written."""

    nodes: list[onnx.NodeProto] = field(default_factory=list)
    initializers: list[onnx.TensorProto] = field(default_factory=list)
    outputs: list[onnx.ValueInfoProto] = field(default_factory=list)
    updates: list[tuple[str, str]] = field(default_factory=list)
    init_nodes: list[onnx.NodeProto] = field(default_factory=list)
    init_outputs: list[onnx.ValueInfoProto] = field(default_factory=list)
    init_bindings: list[tuple[str, str]] = field(default_factory=list)

    def node(self, op_type: str, inputs: list[str], outputs: list[str], domain: str = "", **attrs) -> None:
        self.nodes.append(helper.make_node(op_type, inputs, outputs, domain=domain, **attrs))

    def update(self, variable: str, new_value: str, value_type: onnx.TypeProto) -> None:
        """Bind `variable <- new_value`; the value is declared an algorithm output as the spec requires."""
        self.updates.append((variable, new_value))
        self.outputs.append(helper.make_value_info(new_value, value_type))

    def state(self, name: str, value: np.ndarray) -> None:
        """An algorithm initializer that the initialization graph resets to `value`."""
        tensor = numpy_helper.from_array(value, name)
        self.initializers.append(tensor)
        self.init_nodes.append(helper.make_node("Constant", [], [f"{name}.init"], value=tensor))
        self.init_outputs.append(helper.make_tensor_value_info(f"{name}.init", tensor.data_type, value.shape))
        self.init_bindings.append((name, f"{name}.init"))


def running_statistics(graph: onnx.GraphProto) -> set[str]:
    """The running mean and variance inputs of the graph's BatchNormalization nodes (subgraphs included)."""
    names: set[str] = set()
    for node in graph.node:
        if node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx"):
            names.update(node.input[3:5])
        for attribute in node.attribute:
            for sub in [attribute.g] if attribute.HasField("g") else list(attribute.graphs):
                names |= running_statistics(sub)
    return names


def select_trainable(model: onnx.ModelProto, trainable: str | Iterable[str] | None) -> list[str]:
    """Float initializers: all of them (None) or those matching a pattern, less BatchNormalization's running
    statistics (averages of activations, not parameters a gradient should move); or exactly the names given."""
    floats = [t.name for t in model.graph.initializer if t.data_type in FLOAT_TYPES]
    if trainable is None or isinstance(trainable, str):
        statistics = running_statistics(model.graph)
        chosen = [n for n in floats if n not in statistics and (trainable is None or re.fullmatch(trainable, n))]
    else:
        chosen = list(trainable)
        unknown = sorted(set(chosen) - set(floats))
        if unknown:
            raise OnnxTrainError(f"trainable: {unknown} are not float initializers of the model")
    if not chosen:
        raise OnnxTrainError(f"trainable: no float initializer matches {trainable!r}")
    return chosen


def tensor_type(graph: onnx.GraphProto, name: str) -> onnx.TypeProto:
    for value in list(graph.output) + list(graph.input) + list(graph.value_info):
        if value.name == name:
            return value.type
    raise OnnxTrainError(f"{name!r} is not a declared output of the model")


def add_loss(b: Builder, graph: onnx.GraphProto, loss: str, prediction: str, ignore_index: int | None) -> list:
    """Append loss nodes producing `loss`; returns the algorithm inputs (the target, if any)."""
    pred_type = tensor_type(graph, prediction)
    if loss.startswith("output:"):
        name = loss.partition(":")[2]
        tensor_type(graph, name)
        b.node("ReduceSum", [name], ["loss"], keepdims=0)
        return []
    if loss == "mse":
        b.node("Sub", [prediction, "target"], ["loss.diff"])
        b.node("Mul", ["loss.diff", "loss.diff"], ["loss.sq"])
        b.node("ReduceMean", ["loss.sq"], ["loss"], keepdims=0)
        return [helper.make_value_info("target", pred_type)]
    if loss == "cross_entropy":
        extra = {} if ignore_index is None else {"ignore_index": ignore_index}
        b.node("SoftmaxCrossEntropyLoss", [prediction, "target"], ["loss"], reduction="mean", **extra)
        rank = len(pred_type.tensor_type.shape.dim)
        dims = [d.dim_param or d.dim_value or None for d in pred_type.tensor_type.shape.dim]
        label_shape = [dims[0]] + dims[2:] if rank else None
        return [helper.make_tensor_value_info("target", TensorProto.INT64, label_shape)]
    if loss == "bce_logits":
        # mean(max(x, 0) - x * t + log(1 + exp(-|x|))): the overflow-free form of BCE on logits
        b.node("Relu", [prediction], ["loss.pos"])
        b.node("Mul", [prediction, "target"], ["loss.xt"])
        b.node("Abs", [prediction], ["loss.abs"])
        b.node("Neg", ["loss.abs"], ["loss.negabs"])
        b.node("Softplus", ["loss.negabs"], ["loss.log1p"])
        b.node("Sub", ["loss.pos", "loss.xt"], ["loss.a"])
        b.node("Add", ["loss.a", "loss.log1p"], ["loss.each"])
        b.node("ReduceMean", ["loss.each"], ["loss"], keepdims=0)
        return [helper.make_value_info("target", pred_type)]
    raise OnnxTrainError(f"loss must be one of {LOSSES} or 'output:NAME', got {loss!r}")


def add_optimizer(b: Builder, params: list[str], weights: dict[str, np.ndarray], optimizer: str, options: dict):
    grads = [f"{p}.grad" for p in params]
    b.node("Gradient", params, grads, domain=TRAINING_DOMAIN, xs=params, y="loss")
    types = {p: helper.make_tensor_type_proto(helper.np_dtype_to_tensor_dtype(weights[p].dtype), weights[p].shape)
             for p in params}
    if optimizer == "sgd":
        for p, g in zip(params, grads):
            b.node("Cast", [LEARNING_RATE], [f"{p}.lr"], to=types[p].tensor_type.elem_type)
            b.node("Mul", [f"{p}.lr", g], [f"{p}.step"])
            b.node("Sub", [p, f"{p}.step"], [f"{p}.next"])
            b.update(p, f"{p}.next", types[p])
        return
    slots = {"adam": ("adam_v", "adam_h"), "adagrad": ("adagrad_h",), "momentum": ("momentum_v",),
             "nesterov": ("momentum_v",)}[optimizer]
    op_type = {"adam": "Adam", "adagrad": "Adagrad", "momentum": "Momentum", "nesterov": "Momentum"}[optimizer]
    if op_type == "Momentum":
        options = {"alpha": 0.9, "beta": 1.0, "norm_coefficient": 0.0, **options}
        options["mode"] = "nesterov" if optimizer == "nesterov" else "standard"
    slot_names = [[f"{p}.{s}" for p in params] for s in slots]
    for names in slot_names:
        for p, name in zip(params, names):
            b.state(name, np.zeros_like(weights[p]))
    flat_slots = [n for names in slot_names for n in names]
    new_params, new_slots = [f"{p}.next" for p in params], [f"{n}.next" for n in flat_slots]
    b.node(op_type, [LEARNING_RATE, STEP] + params + grads + flat_slots, new_params + new_slots,
           domain=TRAINING_DOMAIN, **options)
    for p, new in zip(params, new_params):
        b.update(p, new, types[p])
    for names in slot_names:
        for p, name in zip(params, names):
            b.update(name, f"{name}.next", types[p])


def make_trainable(
    model: onnx.ModelProto,
    loss: str = "mse",
    optimizer: str = "adam",
    learning_rate: float = 1e-3,
    trainable: str | Iterable[str] | None = None,
    prediction: str | None = None,
    ignore_index: int | None = None,
    reinitialize: bool = False,
    train_mode: bool = False,
    **optimizer_options: float,
) -> onnx.ModelProto:
    """A copy of `model` carrying one TrainingInfoProto that trains `trainable` (default: every float
    initializer but BatchNormalization's running statistics, which stay as they are) on `loss` between
    `prediction` (default: the first graph output) and an algorithm input `target`. The rate is the algorithm
    input `learning_rate`, whose initializer is the default: feed it to schedule. `optimizer_options` are the
    optimizer op's attributes (alpha, beta, epsilon, norm_coefficient...). `train_mode=True` trains as PyTorch's
    `module.train()`: batch statistics and running-statistics updates in BatchNormalization, Dropout dropping,
    while the inference graph stays in eval mode (onnxtrain/train_mode.py)."""
    if optimizer not in OPTIMIZERS:
        raise OnnxTrainError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    result = onnx.ModelProto()
    result.CopyFrom(model)
    graph = result.graph
    prediction = prediction or graph.output[0].name
    params = select_trainable(result, trainable)
    weights = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    b = Builder()
    if train_mode:
        prediction, loss = add_training_forward(b, result, prediction, loss)
    inputs = add_loss(b, graph, loss, prediction, ignore_index)
    add_optimizer(b, params, weights, optimizer, dict(optimizer_options))
    b.initializers.append(numpy_helper.from_array(np.asarray(learning_rate, np.float32), LEARNING_RATE))
    inputs.append(helper.make_tensor_value_info(LEARNING_RATE, TensorProto.FLOAT, []))
    if optimizer != "sgd":
        b.state(STEP, np.asarray(0, np.int64))
        b.initializers.append(numpy_helper.from_array(np.asarray(1, np.int64), "train.one"))
        b.node("Add", [STEP, "train.one"], [f"{STEP}.next"])
        b.update(STEP, f"{STEP}.next", helper.make_tensor_type_proto(TensorProto.INT64, []))
    if reinitialize:
        reinitialize_weights(b, params, weights)
    algorithm = helper.make_graph(
        b.nodes, "train_step", inputs, [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])] + b.outputs,
        b.initializers,
    )
    initialization = helper.make_graph(b.init_nodes, "initialize", [], b.init_outputs) if b.init_nodes else None
    result.training_info.append(
        helper.make_training_info(algorithm, b.updates, initialization, b.init_bindings or None)
    )
    if not any(o.domain == TRAINING_DOMAIN for o in result.opset_import):
        result.opset_import.append(helper.make_opsetid(TRAINING_DOMAIN, 1))
    result.ir_version = max(result.ir_version, 7)
    return result


def reinitialize_weights(b: Builder, params: list[str], weights: dict[str, np.ndarray]) -> None:
    """Weights of rank >= 2 drawn from N(0, 2 / fan_in) (He), others zero, in the initialization graph."""
    for p in params:
        w = weights[p]
        name = f"{p}.init"
        elem = helper.np_dtype_to_tensor_dtype(w.dtype)
        if w.ndim >= 2:
            fan_in = int(np.prod(w.shape[1:])) if w.ndim > 2 else w.shape[0]
            b.init_nodes.append(helper.make_node("RandomNormal", [], [name], shape=list(w.shape), dtype=elem,
                                                 scale=float(np.sqrt(2.0 / fan_in))))
        else:
            b.init_nodes.append(helper.make_node("Constant", [], [name], value=numpy_helper.from_array(
                np.zeros_like(w), p)))
        b.init_outputs.append(helper.make_tensor_value_info(name, elem, w.shape))
        b.init_bindings.append((p, name))
