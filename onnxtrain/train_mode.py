"""Train an exported model as PyTorch's `module.train()` does: `make_trainable(..., train_mode=True)`.

The train step's forward pass is a copy of the inference graph's nodes in the algorithm graph (names prefixed
`train/`) in which every BatchNormalization normalizes with the batch's statistics and every Dropout drops; the
running mean and variance become state variables that each step updates with PyTorch's rule. The inference
graph itself is put in eval mode (BatchNormalization `training_mode=0`, Dropout without `training_mode`), so
`infer`, the exported model and any runtime use the running statistics. All of it is standard ONNX: another
runtime that trains from TrainingInfoProto gets the same steps. The algorithm outputs each inference output's
copy (`train/NAME`), which onnxtrain's train step returns as NAME (steps.train_step): one forward pass a step.

PyTorch's update, for momentum `t` (ONNX stores `momentum = 1 - t`):
    running_mean = (1 - t) * running_mean + t * batch_mean
    running_var  = (1 - t) * running_var  + t * batch_var * n / (n - 1)     (the unbiased batch variance)
while the batch is normalized with the biased variance. ONNX's own running_var output uses the biased one, so the
copy asks its BatchNormalization for the batch statistics alone (`momentum=0` makes the running outputs exactly
the batch mean and biased variance) and writes the update as plain ops.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .errors import OnnxTrainError
from .lower.ops.normalization import MIN_VALUES_PER_CHANNEL
from .parameters import KEEP_BATCH_NORM, attribute, metadata

if TYPE_CHECKING:
    from .authoring import Builder

PREFIX = "train/"
# from_torch's record on the BatchNormalization of a module with momentum=None (PyTorch's cumulative average over
# the batches seen, which no export holds: an eval-mode one writes momentum 1, as for momentum=0): the name of the
# initializer it adds holding the module's num_batches_tracked. Optional metadata, read by add_batch_statistics.
NUM_BATCHES_TRACKED = "onnxtrain.num_batches_tracked"
ONNX_DOMAINS = ("", "ai.onnx")


def default_opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ONNX_DOMAINS), 1)


def ancestors(graph: onnx.GraphProto, names: list[str]) -> list[onnx.NodeProto]:
    """The nodes `names` depend on (subgraphs' outer reads included), in the graph's order."""
    producer = {out: k for k, node in enumerate(graph.node) for out in node.output if out}
    needed: set[int] = set()
    pending = [producer[n] for n in names if n in producer]
    while pending:
        k = pending.pop()
        if k in needed:
            continue
        needed.add(k)
        pending += [producer[n] for n in reads(graph.node[k]) if n in producer]
    return [graph.node[k] for k in sorted(needed)]


def reads(node: onnx.NodeProto) -> set[str]:
    """Every name a node reads, including those its subgraphs read from the enclosing scope."""
    names = {n for n in node.input if n}
    for graph in subgraphs(node):
        for inner in graph.node:
            names |= reads(inner)
    return names


def subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    return [g for a in node.attribute for g in ([a.g] if a.HasField("g") else list(a.graphs))]


def renamed(node: onnx.NodeProto, names: dict[str, str]) -> onnx.NodeProto:
    """A copy of `node` whose values (subgraphs' too) are renamed by `names`, unknown names kept."""
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    rename_values(copy, names)
    return copy


def rename_values(node: onnx.NodeProto, names: dict[str, str]) -> None:
    node.input[:] = [names.get(n, n) for n in node.input]
    node.output[:] = [names.get(n, n) for n in node.output]
    if node.name:
        node.name = PREFIX + node.name
    for graph in subgraphs(node):
        for value in list(graph.input) + list(graph.output):
            value.name = names.get(value.name, value.name)
        for inner in graph.node:
            rename_values(inner, names)


def produced(nodes: list[onnx.NodeProto]) -> set[str]:
    """Every value the nodes (and their subgraphs, inputs included) define: all get the training prefix."""
    names: set[str] = set()
    for node in nodes:
        names.update(n for n in node.output if n)
        for graph in subgraphs(node):
            names.update(v.name for v in graph.input)
            names |= produced(list(graph.node))
    return names


def set_attribute(node: onnx.NodeProto, name: str, value) -> None:
    kept = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend(kept + [helper.make_attribute(name, value)])


def own_running_statistics(graph: onnx.GraphProto) -> None:
    """Give each BatchNormalization's running statistics an initializer of their own. TorchScript's export shares
    initializers of equal value (a fresh model's zero means and unit variances) through Identity nodes, and one
    state variable cannot take the updates of two nodes."""
    initializers = {t.name: t for t in graph.initializer}
    producer = {out: n for n in graph.node for out in n.output}
    for node in batch_norms(graph):
        for name in node.input[3:5]:
            source = name
            while source not in initializers and source in producer and producer[source].op_type == "Identity":
                source = producer[source].input[0]
            if source != name and source in initializers:
                graph.node.remove(producer[name])
                copy = onnx.TensorProto()
                copy.CopyFrom(initializers[source])
                copy.name = name
                graph.initializer.append(copy)
                initializers[name] = copy


def batch_norms(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    return [n for n in graph.node if n.op_type == "BatchNormalization" and n.domain in ONNX_DOMAINS]


def batch_statistics(graph: onnx.GraphProto, node: onnx.NodeProto, initializers: set[str]) -> bool:
    """Whether a BatchNormalization's mean and variance inputs are computed from the graph's inputs: PyTorch's
    `track_running_stats=False`, which both exporters write as ReduceMean nodes over the batch. Such a node
    normalizes with the batch's statistics in train and eval mode alike and has no running statistics to update,
    so the training copy keeps it as it is. `initializers`: the graph's initializer names, collected once for all
    its nodes (a scan of them per node cost BatchNormalizations x initializers)."""
    if initializers & set(node.input[3:5]):  # the usual case, without walking the graph
        return False
    inputs = {i.name for i in graph.input}
    return all(any(inputs & reads(n) for n in ancestors(graph, [name])) for name in node.input[3:5])


def running_statistic(graph: onnx.GraphProto, node: onnx.NodeProto, index: int) -> onnx.TensorProto:
    """Input `index` (3: mean, 4: variance) of a BatchNormalization: an initializer no other node updates."""
    name, what = node.input[index], ("running mean", "running variance")[index - 3]
    label = f"BatchNormalization {node.name or node.output[0]!r}"
    tensor = next((t for t in graph.initializer if t.name == name), None)
    if tensor is None:
        raise OnnxTrainError(f"train_mode: the {what} {name!r} of {label} is not an initializer, so it cannot be "
                             "a state variable that training updates")
    readers = [n for n in batch_norms(graph) if name in n.input[3:5]]
    if len(readers) > 1:
        raise OnnxTrainError(f"train_mode: the {what} {name!r} of {label} is shared with another "
                             "BatchNormalization; each node's running statistics need their own initializer")
    return tensor


def to_eval_mode(graph: onnx.GraphProto) -> None:
    """The inference graph of a train-mode export in eval mode: BatchNormalization with the running statistics,
    Dropout without its `training_mode` input (which defaults to false)."""
    consumed = {n for node in graph.node for n in reads(node)} | {o.name for o in graph.output}
    for node in graph.node:
        if node.domain not in ONNX_DOMAINS:
            continue
        if node.op_type == "BatchNormalization" and attribute(node, "training_mode", 0):
            used = sorted(set(node.output[1:]) & consumed - {""})
            if used:
                raise OnnxTrainError(
                    f"train_mode: {used} (running statistics of BatchNormalization {node.name!r}) are read by the "
                    "model; its inference graph cannot be put in eval mode"
                )
            set_attribute(node, "training_mode", 0)
            del node.output[1:]
        if node.op_type == "Dropout" and len(node.input) > 2:
            del node.input[2:]


def constant_tensors(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    """Each value that an initializer or a Constant node's `value` holds, by name, not decoded."""
    found = {t.name: t for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ONNX_DOMAINS and len(node.output) == 1:
            value = attribute(node, "value", None)
            if value is not None:
                found[node.output[0]] = value
    return found


def always_dropping(node: onnx.NodeProto, constants: Mapping[str, onnx.TensorProto]) -> bool:
    """A Dropout whose `training_mode` input is a constant true and whose ratio is not a constant 0: both
    exporters write a train() module's Dropout so (TorchScript's with TrainingMode.TRAINING or PRESERVE, the dynamo
    exporter whatever its options), and ONNX says it drops wherever it runs, `infer` included. ONNX Runtime's
    inference session drops nothing there, so the same model computes PyTorch's eval() in ONNX Runtime and not in
    onnxtrain's infer: nothing in the numbers tells which is meant."""
    if len(node.input) < 3 or not node.input[2]:
        return False
    mode, ratio = (constants.get(node.input[2]), constants.get(node.input[1]) if node.input[1] else None)
    return (mode is not None and bool(numpy_helper.to_array(mode).all())
            and not (ratio is not None and not numpy_helper.to_array(ratio).any()))


def warn_of_train_mode_nodes(graph: onnx.GraphProto) -> None:
    """Without train_mode, a train-mode export (TrainingMode.TRAINING) trains and infers on batch statistics and
    never updates the running ones, and its Dropouts drop in infer too: neither PyTorch's train() nor its eval().
    Warned, naming the option."""
    initializers = {t.name for t in graph.initializer}
    batch_statistics_only = [n for n in batch_norms(graph)
                             if attribute(n, "training_mode", 0) and not batch_statistics(graph, n, initializers)]
    dropouts = [n for n in graph.node if n.op_type == "Dropout" and n.domain in ONNX_DOMAINS]
    constants = constant_tensors(graph) if dropouts else {}
    dropping_always = [n for n in dropouts if always_dropping(n, constants)]
    kinds = {"BatchNormalization": [n.name or n.output[0] for n in batch_statistics_only],
             "Dropout": [n.name or n.output[0] for n in dropping_always]}
    what = {"BatchNormalization": "normalize with the batch's statistics (training_mode=1) and nothing updates their "
                                  "running statistics",
            "Dropout": "drop (training_mode a constant true), where ONNX Runtime's inference drops nothing"}
    found = [f"{kind} {nodes[:3]}{' ...' if len(nodes) > 3 else ''} {what[kind]}" for kind, nodes in kinds.items()
             if nodes]
    if found:
        warnings.warn(f"{'; '.join(found)}, in train steps and in infer alike: an export of a module in train() mode "
                      "(torch.onnx.TrainingMode.TRAINING, or the dynamo exporter's). Pass train_mode=True to train "
                      "as PyTorch's module.train() and infer as its eval(), or export the module in eval() mode",
                      stacklevel=3)


# The nodes an exporter folds a BatchNorm into, whose model without one may have lost its BatchNorms so
BATCH_NORM_HOSTS = frozenset({"Conv", "ConvTranspose"})


def add_training_forward(b: Builder, model: onnx.ModelProto, prediction: str, loss: str) -> tuple[str, str]:
    """Append the train-mode forward pass to the algorithm being built and put `model`'s inference graph in eval
    mode; returns `prediction` and `loss` (an `output:NAME` loss included) as the forward pass names them."""
    graph = model.graph
    if default_opset(model) < 14:
        raise OnnxTrainError(
            f"train_mode: the model imports opset {default_opset(model)}; training BatchNormalization on batch "
            "statistics needs opset 14 or later (its training_mode attribute): export with opset_version >= 14"
        )
    kinds = {node.op_type for node in graph.node if node.domain in ONNX_DOMAINS}
    if "BatchNormalization" not in kinds:
        if "Dropout" not in kinds:
            raise OnnxTrainError(
                "train_mode: the model has no BatchNormalization or Dropout node. An eval-mode export holds no Dropout "
                "(both exporters leave it out): export the module in train() mode to keep it (TorchScript's with "
                f"training=torch.onnx.TrainingMode.TRAINING). For BatchNorm, {KEEP_BATCH_NORM}")
        if kinds & BATCH_NORM_HOSTS:  # a CNN whose BatchNorms the export may have folded; a transformer has none
            warnings.warn(f"train_mode: the model has convolutions but no BatchNormalization node (only Dropout); "
                          f"{KEEP_BATCH_NORM}", stacklevel=3)
    own_running_statistics(graph)
    loss_output = loss.partition(":")[2] if loss.startswith("output:") else None
    # every output's forward is copied, as PyTorch's train() runs the whole module (each BatchNorm on the way
    # updates its statistics): the step returns the copies as the model's outputs (steps.train_step), so it
    # computes no eval-mode forward pass beside the training one
    outputs = [o.name for o in graph.output]
    nodes = ancestors(graph, [prediction] + ([loss_output] if loss_output else []) + outputs)
    names = {n: PREFIX + n for n in produced(nodes)}
    initializers = {t.name for t in graph.initializer}
    trained = [n for n in nodes if n.domain in ONNX_DOMAINS and n.op_type == "BatchNormalization"
               and not batch_statistics(graph, n, initializers)]  # those with running statistics
    normalized = {n.output[0] for n in trained}
    for node in nodes:
        copy = renamed(node, names)
        if node.output[0] in normalized:
            add_batch_statistics(b, graph, node, copy)
        elif copy.domain in ONNX_DOMAINS and copy.op_type == "Dropout":
            b.nodes.append(dropping(b, copy))
        else:
            b.nodes.append(copy)
    to_eval_mode(graph)
    declared = {v.name: v for v in list(graph.output) + list(graph.input) + list(graph.value_info)}
    for name in [prediction, loss_output]:
        if name in declared and name in names:
            # the loss nodes read the copy's type here: the training graph is the concatenation of both graphs
            graph.value_info.append(helper.make_value_info(names[name], declared[name].type))
    b.outputs.extend(helper.make_value_info(names[o.name], o.type) for o in graph.output if o.name in names)
    prediction = names.get(prediction, prediction)
    return prediction, (f"output:{names.get(loss_output, loss_output)}" if loss_output else loss)


def dropping(b: Builder, node: onnx.NodeProto) -> onnx.NodeProto:
    """The Dropout with its `training_mode` input true (an input since opset 12; train_mode needs 14)."""
    true = f"{PREFIX}training_mode"
    if not any(t.name == true for t in b.initializers):
        b.initializers.append(numpy_helper.from_array(np.array(True), true))
    while len(node.input) < 2:
        node.input.append("")
    node.input[2:] = [true]
    return node


def add_batch_statistics(b: Builder, graph: onnx.GraphProto, original: onnx.NodeProto, copy: onnx.NodeProto) -> None:
    """`copy` normalizing with the batch's statistics, and PyTorch's update of the running ones as state."""
    mean, var = running_statistic(graph, original, 3), running_statistic(graph, original, 4)
    y = copy.output[0]
    batch_mean, batch_var = f"{y}.batch_mean", f"{y}.batch_var"
    set_attribute(copy, "training_mode", 1)
    set_attribute(copy, "momentum", 0.0)  # the "running" outputs are then exactly the batch's statistics
    # n / (n - 1) below is undefined for n = 1: the engine refuses such a step (optional metadata for the trace)
    copy.metadata_props.add(key=MIN_VALUES_PER_CHANNEL, value="2")
    copy.output[:] = [y, batch_mean, batch_var]
    b.nodes.append(copy)
    keep, take = averaging_weights(b, graph, original, y, mean.data_type)
    # n / (n - 1), n the values per channel: the unbiased variance PyTorch's running_var averages
    b.node("Size", [copy.input[0]], [f"{y}.size"])
    b.node("Size", [copy.input[1]], [f"{y}.channels"])
    b.node("Div", [f"{y}.size", f"{y}.channels"], [f"{y}.n.int"])
    b.node("Cast", [f"{y}.n.int"], [f"{y}.n"], to=mean.data_type)
    b.node("Sub", [f"{y}.n", b.scalar("one", 1, mean.data_type)], [f"{y}.n-1"])
    b.node("Div", [f"{y}.n", f"{y}.n-1"], [f"{y}.bessel"])
    b.node("Mul", [batch_var, f"{y}.bessel"], [f"{y}.unbiased_var"])
    for stat, batch in ((mean, batch_mean), (var, f"{y}.unbiased_var")):
        b.node("Mul", [stat.name, keep], [f"{stat.name}.kept"])
        b.node("Mul", [batch, take], [f"{stat.name}.taken"])
        b.node("Add", [f"{stat.name}.kept", f"{stat.name}.taken"], [f"{stat.name}.next"])
        b.update(stat.name, f"{stat.name}.next", helper.make_tensor_type_proto(stat.data_type, list(stat.dims)))


def averaging_weights(b: Builder, graph: onnx.GraphProto, original: onnx.NodeProto, y: str,
                      elem: int) -> tuple[str, str]:
    """The names of the weights of the running statistic and of the batch's in the update. PyTorch's momentum t
    (ONNX's 1 - t): 1 - t and t, constants. momentum=None, where from_torch recorded the module's count
    (NUM_BATCHES_TRACKED): its cumulative average, 1 - 1/k and 1/k at the k-th batch seen, with the count a state
    variable each step advances, as PyTorch's num_batches_tracked."""
    label = f"BatchNormalization {original.name or original.output[0]!r}"
    keep, take = f"{y}.keep", f"{y}.take"
    counter = metadata(original, NUM_BATCHES_TRACKED)
    if counter:
        count = next((t for t in graph.initializer if t.name == counter), None)
        if count is None or count.dims:
            raise OnnxTrainError(f"train_mode: {label} records its batch count as {counter!r}, which is no 0-d "
                                 "initializer")
        # the count is the train step's alone: an algorithm initializer (a state variable as well, IR.md), where
        # the inference graph would hold one it never reads (ONNX Runtime warns of it, removing it)
        graph.initializer.remove(count)
        b.initializers.append(count)
        b.node("Add", [counter, b.scalar("one", 1, count.data_type)], [f"{counter}.next"])
        b.update(counter, f"{counter}.next", helper.make_tensor_type_proto(count.data_type, []))
        b.node("Cast", [f"{counter}.next"], [f"{y}.batches"], to=elem)
        one = b.scalar("one", 1, elem)
        b.node("Div", [one, f"{y}.batches"], [take])
        b.node("Sub", [one, take], [keep])
        return keep, take
    momentum = float(attribute(original, "momentum", 0.9))
    if momentum == 1:
        warnings.warn(f"train_mode: {label} has momentum 1 (PyTorch's momentum=0, or momentum=None), so training "
                      "leaves its running statistics as they are, as PyTorch's momentum=0 does. PyTorch's "
                      "momentum=None (a cumulative average over the batches seen) is in no export: from_torch, "
                      "which reads the module, trains it; else set the module's momentum to a number before "
                      "exporting", stacklevel=5)
    dtype = helper.tensor_dtype_to_np_dtype(elem)
    b.initializers += [numpy_helper.from_array(np.asarray(momentum, dtype), keep),
                       numpy_helper.from_array(np.asarray(1 - momentum, dtype), take)]
    return keep, take
