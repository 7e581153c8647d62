"""Turn an inference model into a training model: a standard TrainingInfoProto with loss nodes, a Gradient
node, the optimizer's update (onnxtrain/optimizers.py) with its state and step count as algorithm initializers,
and an initialization graph that resets the optimizer (and optionally the weights)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Iterable, Mapping, NamedTuple

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .embedding_padding import padding_rows
from .errors import AuthoringError
from .lower.registry import TRAINING_DOMAIN
from .optimizers import (  # noqa: F401 (OPTIMIZERS, STEP: API)
    LEARNING_RATE, OPTIMIZERS, STEP, add_update, check_update, is_number,
)
from .dtypes import TRAINING_FLOAT_TYPES
from .parameters import (  # noqa: F401 (running_statistics: API)
    choose_trainable, record_of, recorded_call, recurrent_halves, running_statistics, source_ranks,
)
from .reinitialize import reinitialize_weights
from .train_mode import PREFIX, add_training_forward, warn_of_train_mode_nodes

LOSSES = ("mse", "cross_entropy", "bce_logits")
LOSS = "loss"  # the algorithm's loss value and output, where the model has no value of that name
# A 0-d model output named `loss` (a Hugging Face model's, loss="output:loss") is the algorithm's loss itself. With
# train_mode it is the train-mode copy's, `train/loss`: the model's own `loss` is its eval-mode output then (infer's;
# a train step returns the copy under both names), which the training graph (both graphs concatenated) cannot
# define a second time.
OWN_LOSSES = (LOSS, PREFIX + LOSS)
# torch.nn.functional.cross_entropy's default ignore_index: Hugging Face pads labels with it. Never a class (labels
# are in [0, classes)), so ignoring it by default changes no loss over valid labels
TORCH_IGNORE_INDEX = -100


@dataclass
class Builder:
    """Nodes, initializers and bindings of the algorithm and initialization graphs being written."""

    nodes: list[onnx.NodeProto] = field(default_factory=list)
    initializers: list[onnx.TensorProto] = field(default_factory=list)
    updates: list[tuple[str, str, onnx.TypeProto]] = field(default_factory=list)
    init_nodes: list[onnx.NodeProto] = field(default_factory=list)
    init_outputs: list[onnx.ValueInfoProto] = field(default_factory=list)
    init_bindings: list[tuple[str, str]] = field(default_factory=list)
    made: set[str] = field(default_factory=set)  # the scalars and casts written so far (each once)
    # algorithm outputs beside the loss and the updates: train_mode's copies of the inference graph's outputs
    outputs: list[onnx.ValueInfoProto] = field(default_factory=list)

    def node(self, op_type: str, inputs: list[str], outputs: list[str], domain: str = "", **attrs) -> None:
        self.nodes.append(helper.make_node(op_type, inputs, outputs, domain=domain, **attrs))

    def update(self, variable: str, new_value: str, value_type: onnx.TypeProto) -> None:
        """Bind `variable <- new_value`; the value is declared an algorithm output as the spec requires."""
        self.updates.append((variable, new_value, value_type))

    def gate(self, condition: str, since: int) -> None:
        """Every update bound since the `since`-th happens only where the bool `condition` holds; otherwise the
        variable keeps its value (Where, not arithmetic masking: an update that is NaN or Inf stays out)."""
        for i, (variable, new_value, value_type) in list(enumerate(self.updates))[since:]:
            self.node("Where", [condition, new_value, variable], [f"{new_value}.gated"])
            self.updates[i] = (variable, f"{new_value}.gated", value_type)

    def state(self, name: str, value: np.ndarray) -> None:
        """An algorithm initializer that the initialization graph resets to `value`. An all-zero value (an
        optimizer's moments, each as large as its weight) is reset by ConstantOfShape, so the model does not
        carry a second full-size copy of zeros in the initialization graph."""
        tensor = numpy_helper.from_array(value, name)
        self.initializers.append(tensor)
        if value.size > 1 and not np.any(value):
            shape = numpy_helper.from_array(np.asarray(value.shape, np.int64), f"{name}.shape")
            self.init_nodes += [
                helper.make_node("Constant", [], [f"{name}.shape"], value=shape),
                helper.make_node("ConstantOfShape", [f"{name}.shape"], [f"{name}.init"],
                                 value=numpy_helper.from_array(np.zeros(1, value.dtype))),
            ]
        else:
            self.init_nodes.append(helper.make_node("Constant", [], [f"{name}.init"], value=tensor))
        self.init_outputs.append(helper.make_tensor_value_info(f"{name}.init", tensor.data_type, value.shape))
        self.init_bindings.append((name, f"{name}.init"))

    def scalar(self, what: str, value: float, elem: int) -> str:
        """The name of a 0-d algorithm initializer holding `value` as ONNX type `elem` (one per what and type)."""
        name = f"train.{what}.{TensorProto.DataType.Name(elem).lower()}"
        if name not in self.made:
            self.made.add(name)
            dtype = helper.tensor_dtype_to_np_dtype(elem)
            self.initializers.append(numpy_helper.from_array(np.asarray(value, dtype), name))
        return name

    def cast(self, value: str, elem: int) -> str:
        """The name of `value` cast to ONNX type `elem` (one Cast per value and type)."""
        name = f"{value}.{TensorProto.DataType.Name(elem).lower()}"
        if name not in self.made:
            self.made.add(name)
            self.node("Cast", [value], [name], to=elem)
        return name


def declare_intermediate(model: onnx.ModelProto, name: str) -> None:
    """Declare (graph.value_info, by onnx's shape inference) the type of a value that a node computes and no output
    or value_info declares, named as the prediction: a classifier converter's outputs are its label and its
    probabilities (skl2onnx's MLPClassifier: Softmax of scores `add_result1`), and a loss on logits needs the
    scores before them, which only value_info declares once shape inference has run."""
    graph = model.graph
    declared = {v.name for v in list(graph.output) + list(graph.input) + list(graph.value_info)}
    if name in declared or not any(name in node.output for node in graph.node):
        return
    inferred = onnx.shape_inference.infer_shapes(model).graph.value_info
    graph.value_info.extend(v for v in inferred if v.name == name)


def tensor_type(graph: onnx.GraphProto, name: str, role: str) -> onnx.TypeProto:
    for value in list(graph.output) + list(graph.input) + list(graph.value_info):
        if value.name == name:
            return value.type
    outputs = [o.name for o in graph.output]
    raise AuthoringError(f"{role} {name!r} is not a declared output of the model, nor a value its nodes compute "
                         f"(outputs: {outputs})")


def float_tensor(graph: onnx.GraphProto, name: str, role: str) -> onnx.TypeProto:
    """The declared type of `name`, which must be a float tensor: losses and gradients need floats."""
    value_type = tensor_type(graph, name, role)
    elem = value_type.tensor_type.elem_type if value_type.HasField("tensor_type") else None
    if elem not in TRAINING_FLOAT_TYPES:
        kind = TensorProto.DataType.Name(elem).lower() if elem else f"a {value_type.WhichOneof('value')}, not a tensor"
        hint = ""
        if value_type.HasField("sequence_type"):  # a converter's probabilities per class, as maps (skl2onnx's ZipMap)
            hint = (" (a ZipMap's list of {class: probability} maps: convert with skl2onnx's options={id(model): "
                    "{'zipmap': False}} for a tensor, and name the scores before its Softmax for a loss on logits)")
        raise AuthoringError(f"{role} {name!r} is {kind}; the loss needs a float tensor{hint}")
    return value_type


def dims(value_type: onnx.TypeProto) -> list[int | str | None] | None:
    """Declared dimensions (size, symbol or None), or None when the rank is unknown."""
    if not value_type.tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else d.dim_param or None for d in value_type.tensor_type.shape.dim]


class Loss(NamedTuple):
    """What add_loss wrote: the algorithm inputs (the target, if any), the loss's type (its operand's: a float64
    model's loss is float64), `items`, a float32 scalar value holding what the loss's mean divides by (None
    where not asked for, or unknown: a model's own loss output), and `name`, the value that is the loss (the
    algorithm's loss output, the Gradient's y)."""

    inputs: list[onnx.ValueInfoProto]
    elem: int
    items: str | None
    name: str = LOSS


def add_loss(b: Builder, graph: onnx.GraphProto, loss: str, prediction: str, ignore_index: int | None,
             class_axis: int | None, label_smoothing: float = 0.0, opset: int = 18,
             count_items: bool = False) -> Loss:
    """Append loss nodes producing `loss`. The options are checked against the declared output first, so a
    mismatch fails here rather than at the first step. `count_items`: also count what the mean divides by
    (accumulate_by="items" weighs each micro-batch by it): the labels that count for the cross-entropy, the
    elements averaged for mse and bce_logits."""
    if not isinstance(loss, str) or loss not in LOSSES and not loss.startswith("output:"):
        raise AuthoringError(f"loss must be one of {LOSSES} or 'output:NAME', got {loss!r}")
    if loss != "cross_entropy" and (ignore_index is not None or class_axis is not None or label_smoothing):
        raise AuthoringError(f"ignore_index, class_axis and label_smoothing apply to loss='cross_entropy', not "
                             f"{loss!r}")
    if not (is_number(label_smoothing) and 0 <= label_smoothing <= 1):
        raise AuthoringError(f"label_smoothing must be a number in [0, 1], got {label_smoothing!r}")
    if loss.startswith("output:"):
        name = loss.partition(":")[2]
        value_type = float_tensor(graph, name, "loss output")
        # what the model's loss averages over, if anything, is not in the graph to count: not guessed
        if name in OWN_LOSSES and dims(value_type) == []:
            return Loss([], value_type.tensor_type.elem_type, None, name)
        b.node("ReduceSum", [name], [LOSS], keepdims=0)  # a scalar stays as it is; a vector is summed
        return Loss([], value_type.tensor_type.elem_type, None)
    pred_type = float_tensor(graph, prediction, "prediction")
    elem = pred_type.tensor_type.elem_type
    if loss == "mse":
        b.node("Sub", [prediction, "target"], ["loss.diff"])
        b.node("Mul", ["loss.diff", "loss.diff"], ["loss.sq"])
        b.node("ReduceMean", ["loss.sq"], ["loss"], keepdims=0)
        return Loss([helper.make_value_info("target", pred_type)], elem,
                    element_count(b, "loss.sq") if count_items else None)
    if loss == "cross_entropy":
        ignore_index = TORCH_IGNORE_INDEX if ignore_index is None else ignore_index
        inputs = add_cross_entropy(b, prediction, dims(pred_type), ignore_index,
                                   1 if class_axis is None else class_axis, float(label_smoothing), opset, elem)
        return Loss(inputs, elem, label_count(b, ignore_index, TensorProto.FLOAT) if count_items else None)
    # bce_logits: mean(max(x, 0) - x * t + log(1 + exp(-|x|))), the overflow-free form of BCE on logits
    b.node("Relu", [prediction], ["loss.pos"])
    b.node("Mul", [prediction, "target"], ["loss.xt"])
    b.node("Abs", [prediction], ["loss.abs"])
    b.node("Neg", ["loss.abs"], ["loss.negabs"])
    b.node("Softplus", ["loss.negabs"], ["loss.log1p"])
    b.node("Sub", ["loss.pos", "loss.xt"], ["loss.a"])
    b.node("Add", ["loss.a", "loss.log1p"], ["loss.each"])
    b.node("ReduceMean", ["loss.each"], ["loss"], keepdims=0)
    return Loss([helper.make_value_info("target", pred_type)], elem,
                element_count(b, "loss.each") if count_items else None)


def element_count(b: Builder, averaged: str) -> str:
    """The number of elements of `averaged` (what a ReduceMean of it divides by), as a float32 scalar."""
    b.node("Size", [averaged], ["loss.size"])
    b.node("Cast", ["loss.size"], ["loss.items"], to=TensorProto.FLOAT)
    return "loss.items"


def label_count(b: Builder, ignore_index: int, elem: int) -> str:
    """The number of labels that are not `ignore_index` (what the cross-entropy's mean divides by) as a scalar of
    type `elem`; written once per type, the mask of those labels (`loss.counted`) once."""
    name = f"loss.count.{TensorProto.DataType.Name(elem).lower()}"
    if name not in b.made:
        b.made.add(name)
        if "loss.counted" not in b.made:
            b.made.add("loss.counted")
            b.node("Equal", ["target", b.scalar("ignore_index", ignore_index, TensorProto.INT64)], ["loss.ignored"])
            b.node("Not", ["loss.ignored"], ["loss.counted"])
        b.node("ReduceSum", [b.cast("loss.counted", elem)], [name], keepdims=0)
    return name


# The losses that read logits (they apply a softmax or sigmoid themselves)
LOGIT_LOSSES = ("cross_entropy", "bce_logits")
# The ops whose output is probabilities, each with the loss that takes its input as logits
PROBABILITY_OPS = {"Softmax": "cross_entropy", "Sigmoid": "bce_logits"}
# The nodes a converter hands probabilities on through, each with the input that holds them and, where the op could
# be anything else, the op that makes its other input: skl2onnx names a Softmax's output through an Identity, writes
# a binary classifier's two columns as Concat(Sub(1, p), p) (MLPClassifier, SGDClassifier) and a
# LogisticRegression's one-vs-rest sigmoids normalized, Div(p, ReduceSum(Abs(p))) (binary: scores [-z, z])
PROBABILITY_VIEWS = {"Identity": (0, None), "Concat": (1, (0, "Sub")), "Div": (0, (1, "ReduceSum"))}


def check_logits(graph: onnx.GraphProto, loss: str, prediction: str) -> None:
    """A warning for a loss on logits whose prediction is already probabilities (the Softmax or Sigmoid a
    classifier's export ends in, through PROBABILITY_VIEWS: skl2onnx's `probabilities`): the loss applies its
    softmax again and trains toward another loss (skl2onnx's MLPClassifier: 1.14 against the log-loss's 1.36,
    falling 8x more slowly). Not an error: torch's cross_entropy on a module that ends in a softmax trains just so,
    and so does this."""
    producers = {o: node for node in graph.node for o in node.output}
    node = producers.get(prediction)
    while node is not None and (held := probabilities_passed_on(node, producers)) is not None:
        node = producers.get(held)
    if loss in LOGIT_LOSSES and node is not None and node.op_type in PROBABILITY_OPS and not node.domain:
        logit_loss = PROBABILITY_OPS[node.op_type]
        warnings.warn(
            f"loss={loss!r} takes logits, as torch's does, but prediction {prediction!r} holds probabilities, "
            f"the output of {node.op_type} {node.name or node.output[0]!r}: it trains the {loss} of those "
            f"probabilities (as torch's loss on such a module would); for the {logit_loss} of the logits, name its "
            f"input: prediction={node.input[0]!r}{f', loss={logit_loss!r}' if logit_loss != loss else ''}",
            UserWarning, stacklevel=3)


# torch.ops.aten.cross_entropy_loss(scores, target, weight, reduction, ignore_index, label_smoothing), as the dynamo
# exporter records the call a node comes from
CROSS_ENTROPY_CALL, LABEL_SMOOTHING_ARGUMENT = "cross_entropy_loss.default", 5


def warn_of_dropped_label_smoothing(graph: onnx.GraphProto) -> None:
    """A warning for each SoftmaxCrossEntropyLoss that the dynamo exporter (torch 2.13) made, alone, from a
    cross_entropy call with label_smoothing: the op has no smoothing and the exporter drops it, so the model's loss
    (a module returning F.cross_entropy(..., label_smoothing=0.2)) is the unsmoothed one, which trains toward
    another optimum than torch's; ONNX Runtime computes it so too. A call the exporter decomposed into more nodes
    (a smoothing written out) is left alone."""
    calls: dict[str, int] = {}
    for node in graph.node:
        if (call := recorded_call(node)):
            calls[call] = calls.get(call, 0) + 1
    for node in graph.node:
        if node.op_type != "SoftmaxCrossEntropyLoss" or node.domain or calls.get(recorded_call(node)) != 1:
            continue
        record = record_of(node)
        if record.call != CROSS_ENTROPY_CALL or len(record.arguments) <= LABEL_SMOOTHING_ARGUMENT:
            continue
        try:
            smoothing = float(record.arguments[LABEL_SMOOTHING_ARGUMENT])
        except ValueError:  # not a number as written: nothing to tell
            continue
        if smoothing:
            warnings.warn(
                f"SoftmaxCrossEntropyLoss {node.name or node.output[0]!r} computes torch's cross_entropy without its "
                f"label_smoothing={smoothing}: the exporter dropped it (ONNX's op has no smoothing), so the model's "
                f"loss is the unsmoothed one; for torch's, train the scores: loss='cross_entropy', "
                f"label_smoothing={smoothing}, prediction={node.input[0]!r}", UserWarning, stacklevel=3)


def probabilities_passed_on(node: onnx.NodeProto, producers: Mapping[str, onnx.NodeProto]) -> str | None:
    """The input of `node` that holds the probabilities it hands on (PROBABILITY_VIEWS), None if it is no view."""
    if node.op_type not in PROBABILITY_VIEWS or node.domain:
        return None
    held, other = PROBABILITY_VIEWS[node.op_type]
    if len(node.input) != (1 if other is None else 2):
        return None
    if other is not None:
        made_by = producers.get(node.input[other[0]])
        if made_by is None or made_by.op_type != other[1]:
            return None
    return node.input[held]


def add_cross_entropy(b: Builder, prediction: str, shape: list | None, ignore_index: int,
                      class_axis: int, label_smoothing: float = 0.0, opset: int = 18,
                      elem: int = TensorProto.FLOAT) -> list[onnx.ValueInfoProto]:
    """Softmax cross-entropy over `class_axis` of the scores against int64 class labels (the scores' shape less
    that axis), averaged over the labels that are not `ignore_index`, as
    torch.nn.functional.cross_entropy.
    SoftmaxCrossEntropyLoss wants the classes on axis 1, so another class axis is transposed there first. With
    `label_smoothing` e, torch's: (1 - e) times that plus e times the mean over the same labels of
    -mean(log_softmax) over the classes (the cross-entropy against a uniform target), summed in float32 (float64
    for a float64 model: a half-precision sum over many labels would overflow) and returned in the scores' type
    `elem`, as the loss without smoothing is."""
    if opset < 12:  # the loss nodes share the model's opset import, and raising it would change its nodes' meaning
        raise AuthoringError(
            f"loss='cross_entropy' needs opset 12 or later (SoftmaxCrossEntropyLoss), and the model imports opset "
            f"{opset}: export with opset_version >= 12, or convert the model first "
            f"(onnx.version_converter.convert_version(model, 13))")
    if shape is None:
        if class_axis != 1:
            raise AuthoringError(f"class_axis={class_axis}: prediction {prediction!r} has no declared rank")
        label_shape = None
    else:
        rank = len(shape)
        if rank < 2:
            raise AuthoringError(f"loss='cross_entropy' needs scores [batch, classes, ...]; prediction "
                                 f"{prediction!r} has rank {rank}")
        if not -rank <= class_axis < rank or class_axis % rank == 0:
            raise AuthoringError(f"class_axis={class_axis} is not a class axis of prediction {prediction!r} of "
                                 f"rank {rank} (axis 0 is the batch)")
        class_axis %= rank
        if shape[class_axis] == 1:
            raise AuthoringError(f"prediction {prediction!r} has one class on axis {class_axis}: cross-entropy over "
                                 f"one class is always 0 (use loss='bce_logits' for one logit per example)")
        label_shape = shape[:class_axis] + shape[class_axis + 1:]
        if class_axis != 1:
            perm = [0, class_axis] + [a for a in range(1, rank) if a != class_axis]
            b.node("Transpose", [prediction], ["loss.scores"], perm=perm)
            prediction = "loss.scores"
    if not label_smoothing:
        b.node("SoftmaxCrossEntropyLoss", [prediction, "target"], ["loss"], reduction="mean",
               ignore_index=ignore_index)
        return [helper.make_tensor_value_info("target", TensorProto.INT64, label_shape)]
    b.node("SoftmaxCrossEntropyLoss", [prediction, "target"], ["loss.nll", "loss.log_prob"], reduction="mean",
           ignore_index=ignore_index)
    if opset >= 18:  # per label: its scores' mean log-probability (ReduceMean's axes an input since opset 18)
        axes = numpy_helper.from_array(np.array([1], np.int64), "loss.class_axes")
        b.initializers.append(axes)
        b.node("ReduceMean", ["loss.log_prob", axes.name], ["loss.mean_log_prob"], keepdims=0)
    else:
        b.node("ReduceMean", ["loss.log_prob"], ["loss.mean_log_prob"], axes=[1], keepdims=0)
    wide = TensorProto.DOUBLE if elem == TensorProto.DOUBLE else TensorProto.FLOAT
    b.node("Cast", ["loss.mean_log_prob"], ["loss.uniform_each"], to=wide)
    # the mean over the labels that count, as the nll's
    count = label_count(b, ignore_index, wide)
    b.node("Mul", ["loss.uniform_each", b.cast("loss.counted", wide)], ["loss.uniform_kept"])
    b.node("ReduceSum", ["loss.uniform_kept"], ["loss.uniform_sum"], keepdims=0)
    # at least 1: with every label ignored the sum is 0 and the loss already the nll's NaN, as torch's, while
    # 1 / 0 would reach the gradient as inf times the ignored labels' zeros, a NaN
    b.node("Max", [count, b.scalar("one", 1, wide)], ["loss.divisor"])
    b.node("Div", ["loss.uniform_sum", "loss.divisor"], ["loss.uniform_negative"])
    b.node("Cast", ["loss.nll"], ["loss.nll_wide"], to=wide)
    b.node("Mul", ["loss.nll_wide", b.scalar("kept", 1 - label_smoothing, wide)], ["loss.hard"])
    b.node("Mul", ["loss.uniform_negative", b.scalar("smoothing", label_smoothing, wide)], ["loss.soft_negative"])
    b.node("Sub", ["loss.hard", "loss.soft_negative"], ["loss.wide"])
    b.node("Cast", ["loss.wide"], ["loss"], to=elem)
    return [helper.make_tensor_value_info("target", TensorProto.INT64, label_shape)]


def make_trainable(
    model: onnx.ModelProto,
    loss: str = "mse",
    optimizer: str = "adam",
    learning_rate: float = 1e-3,
    trainable: str | Iterable[str] | None = None,
    prediction: str | None = None,
    ignore_index: int | None = None,
    class_axis: int | None = None,
    reinitialize: bool = False,
    train_mode: bool = False,
    weight_decay: float | None = None,
    no_decay: str | bool = False,
    clip_grad_norm: float | None = None,
    accumulate: int = 1,
    accumulate_by: str = "items",
    padding_idx: Mapping[str, int] | None = None,
    label_smoothing: float = 0.0,
    **optimizer_options: float,
) -> onnx.ModelProto:
    """A copy of `model` carrying one TrainingInfoProto that trains `trainable` on `loss` between `prediction`
    (default: the first graph output) and an algorithm input `target`.

    `trainable`: None (the default) trains the model's parameters: every float initializer except the constants
    an exporter stores beside them (onnxtrain/parameters.py: BatchNormalization's running statistics, exponents,
    0-d operands of elementwise arithmetic, mask fill values); a string trains the parameters whose names
    match it as a regular expression; a list of names trains exactly those (e.g. a PyTorch module's parameter
    names when exported with dynamo=True, optimize=False). A ParameterizationWarning says where the exporter
    merged, untied or broadcast parameters. `loss`: "mse", "bce_logits", "cross_entropy" (int64 labels;
    `class_axis` where the scores hold the classes, default 1 as in PyTorch, -1 for [batch, seq, vocab] logits;
    labels equal to `ignore_index` count in neither sum nor mean: by default torch's -100, which Hugging Face
    pads labels with; `label_smoothing` as torch's) or "output:NAME" (a model output that is already the loss;
    with train_mode, the loss of a 0-d output `loss` is its train-mode copy `train/loss`, the model's `loss`
    staying its eval-mode one for infer; a train step returns each output's train-mode copy under its name).
    The rate is the algorithm input `learning_rate`, whose initializer is the
    default: feed it to schedule.

    The update is torch.optim's, to float rounding (onnxtrain/optimizers.py): `optimizer` "sgd", "momentum",
    "nesterov", "adagrad", "adam" (torch.optim.Adam) or "adamw" (torch.optim.AdamW); `optimizer_options` are
    named as the ai.onnx.preview.training op's attributes (Adam: alpha = beta1, beta = beta2, epsilon; torch's
    defaults 0.9, 0.999, 1e-8). `weight_decay`: torch's (L2 added to the gradient; decoupled for "adamw", whose
    default is 0.01). `no_decay`: parameters left undecayed, a regular expression searched in their names
    (Hugging Face's example scripts' r"bias|LayerNorm\\.weight", which names BERT's norms, not GPT-2's ln_1) or
    True for every parameter of rank <= 1 (biases and norm weights, whatever their names: the Trainer's set on
    most models; docs/semantics.md says where they part).
    `clip_grad_norm`: torch.nn.utils.clip_grad_norm_'s max_norm. `accumulate=k`: one update per k train steps;
    the rate fed with the k-th is the one used. `accumulate_by`: how the k micro-batches' gradients combine.
    "items" (the default): weighted by what each one's mean loss divides by (the labels that are not
    `ignore_index` for the cross-entropy, the elements for mse and bce_logits), so the update is one step on the
    union of the k micro-batches whatever their sizes and padding, as Hugging Face's Trainer divides by
    `num_items_in_batch`; a loss="output:NAME" gives no count, so each of its micro-batches weighs alike.
    "micro_batch": each micro-batch's mean alike, as torch's `(loss / k).backward()` loop.
    `train_mode=True` trains as PyTorch's `module.train()`: batch statistics and running-statistics updates in
    BatchNormalization, Dropout dropping, while the inference graph stays in eval mode (onnxtrain/train_mode.py).
    `padding_idx={table: row}`: embedding rows that get no gradient, as PyTorch's `nn.Embedding(padding_idx=row)`
    gives them none (onnxtrain/embedding_padding.py); by default the rows the dynamo exporter records, which a
    TorchScript export does not (pass them); {} for none. The zero recurrent half that tf2onnx adds to a Keras
    LSTM's one bias gets no gradient either, so that bias trains as Keras's (parameters.recurrent_halves).
    `reinitialize=True`: the initialization graph (engine.init(seed)) re-draws each parameter as PyTorch's default
    initialization of the layer that reads it (onnxtrain/reinitialize.py): Linear and Conv/ConvTranspose weights
    and biases U(-1/sqrt(fan_in), 1/sqrt(fan_in)) with fan_in as the node contracts, Embedding N(0, 1) (its
    padding row 0), norm scales 1 and biases 0, LSTM/GRU/RNN U(-1/sqrt(hidden_size), 1/sqrt(hidden_size)); a
    parameter no rule covers keeps its value, with a warning naming it; with train_mode=True, BatchNorm's running
    statistics restart at mean 0, variance 1.

    Mixed precision is not a make_trainable option: it is how a runtime computes the graph, not part of it, so
    the model stays plain float32 ONNX; choose it when running: `load(model, mixed_precision="bfloat16")`."""
    update = check_update(optimizer, dict(optimizer_options), weight_decay, no_decay, clip_grad_norm, accumulate,
                          accumulate_by)
    if not (is_number(learning_rate) and learning_rate >= 0):  # as every optimizer option: NumPy scalars too
        raise AuthoringError(f"learning_rate must be a finite number >= 0, got {learning_rate!r}")
    if not isinstance(model, onnx.ModelProto):
        raise AuthoringError(f"make_trainable takes an onnx.ModelProto (onnx.load(path) reads one), not "
                             f"{type(model).__name__}")
    result = onnx.ModelProto()
    result.CopyFrom(model)
    graph = result.graph
    if not prediction and not graph.output:  # the default prediction is the first output: an IndexError had said so
        raise AuthoringError("the model's graph declares no output, so there is no prediction to train: name one "
                             "with prediction=")
    prediction = prediction or graph.output[0].name
    declare_intermediate(result, prediction)
    check_logits(graph, loss, prediction)  # the model's own nodes: train_mode's copy renames them
    warn_of_dropped_label_smoothing(graph)
    b = Builder()
    if train_mode:
        prediction, loss = add_training_forward(b, result, prediction, loss)
    else:
        warn_of_train_mode_nodes(graph)
    opset = next((o.version for o in result.opset_import if o.domain in ("", "ai.onnx")), 1)
    # the loss has its operand's type: a float64 model's (skl2onnx converts a linear model for float64 inputs to
    # MatMul and Add in float64) is float64, which a declared float had refused at the first step
    inputs, loss_elem, items, loss_value = add_loss(
        b, graph, loss, prediction, ignore_index, class_axis, label_smoothing, opset,
        count_items=update.accumulate > 1 and update.accumulate_by == "items")
    if update.accumulate > 1 and update.accumulate_by == "items" and items is None:
        # a model's own loss (a Hugging Face model's mean over its -100 labels) hides what it averaged over
        warnings.warn(f"accumulate_by='items' (the default) weighs each micro-batch by what its mean loss divides "
                      f"by, which loss={loss!r} does not say: its {update.accumulate} micro-batches weigh alike, as "
                      "accumulate_by='micro_batch' (pass it to say so); for one step on their union, train the "
                      "logits with loss='cross_entropy' and prediction=", UserWarning, stacklevel=2)
    params, added = choose_trainable(result, trainable)
    # the update reads each weight's shape and dtype, never its values: zero-stride stand-ins, not a decoded copy
    weights = {t.name: np.broadcast_to(np.zeros((), helper.tensor_dtype_to_np_dtype(t.data_type)), tuple(t.dims))
               for t in graph.initializer}
    b.initializers.append(numpy_helper.from_array(np.asarray(learning_rate, np.float32), LEARNING_RATE))
    inputs.append(helper.make_tensor_value_info(LEARNING_RATE, TensorProto.FLOAT, []))
    shapes = {p: weights[p].shape for p in params}
    # gradients the source model has none of: an embedding's padding row, a Keras LSTM bias's added recurrent half
    zeroed = {table: np.array([[row]]) for table, row in padding_rows(result, params, padding_idx, shapes).items()}
    halves = recurrent_halves(added)
    add_update(b, params, weights, update, zeroed | halves, source_ranks(graph, shapes), items, loss_value)
    if reinitialize:
        reinitialize_weights(b, graph, params, weights, zeroed | halves)
    check_names_free(graph, b, inputs)
    check_opset_forms(b, opset)
    outputs = [helper.make_value_info(value, value_type) for _, value, value_type in b.updates]
    algorithm = helper.make_graph(
        b.nodes, "train_step", inputs,
        [helper.make_tensor_value_info(loss_value, loss_elem, [])] + outputs
        + [o for o in b.outputs if o.name != loss_value],  # (a copied `loss` output is the loss itself)
        b.initializers,
    )
    initialization = helper.make_graph(b.init_nodes, "initialize", [], b.init_outputs) if b.init_nodes else None
    result.training_info.append(helper.make_training_info(
        algorithm, [(variable, value) for variable, value, _ in b.updates], initialization, b.init_bindings or None))
    if not any(o.domain == TRAINING_DOMAIN for o in result.opset_import):
        result.opset_import.append(helper.make_opsetid(TRAINING_DOMAIN, 1))
    result.ir_version = max(result.ir_version, 7)
    return result


# The first ai.onnx opset in which each op make_trainable writes has the form it writes it in: the training graphs
# share the model's opset import, and an older one means another op (Cast-1 takes its `to` as a string, Add-6
# broadcasts only with broadcast=1, Max-7 not at all). Ops absent here have one form since opset 1.
FORM_SINCE = {"Cast": 6, "Add": 7, "Sub": 7, "Mul": 7, "Div": 7, "Pow": 7, "Equal": 7, "Max": 8, "Min": 8,
              "Sum": 8, "Where": 9, "ConstantOfShape": 9, "ScatterND": 11}  # (the loss op: add_cross_entropy's own check)


def check_opset_forms(b: Builder, opset: int) -> None:
    """Each ai.onnx op the training graphs use exists in the model's opset in the form written (FORM_SINCE): one
    that does not had been read as the older op, at load or the first step (Cast-1's string `to`)."""
    since = {n.op_type: FORM_SINCE.get(n.op_type, 1) for n in b.nodes + b.init_nodes if n.domain in ("", "ai.onnx")}
    if newer := sorted((version, op) for op, version in since.items() if version > opset):
        needed = max(version for version, _ in newer)
        ops = ", ".join(f"{op} from {version}" for version, op in newer)
        raise AuthoringError(f"the training graphs need ai.onnx opset {needed} or later ({ops}), and the model "
                             f"imports opset {opset}: convert it first "
                             f"(onnx.version_converter.convert_version(model, {max(needed, 13)}))")


def check_names_free(graph: onnx.GraphProto, b: Builder, inputs: list[onnx.ValueInfoProto]) -> None:
    """The algorithm graph reads the inference graph's values by name, so a name it defines (`target`,
    `learning_rate`, `loss`, `<param>.next`, ...) that the model already holds would shadow the model's value: a
    model output named `target` was read as the target (a shape error at the first step). Refused here."""
    ours = {i.name for i in inputs} | {t.name for t in b.initializers} | {o for n in b.nodes for o in n.output}
    theirs = ({i.name for i in graph.input} | {t.name for t in graph.initializer}
              | {o for n in graph.node for o in n.output})
    if clash := sorted(ours & theirs - {""}):
        raise AuthoringError(f"the model already has values named {clash}, names the training graph gives its "
                             "own (the target, the loss, the rate, updated weights): rename them in the model "
                             "(torch.onnx.export's or from_torch's output_names=)")
