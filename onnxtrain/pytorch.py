"""`from_torch`: export a PyTorch module so that its ONNX initializers are its parameters one for one, and make it
trainable on exactly the parameters PyTorch would train; `to_torch`: the trained values back into the module.
torch is imported only when called."""

from __future__ import annotations

import itertools
import re
import warnings
from typing import Any, Mapping, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from .authoring import make_trainable
from .errors import AuthoringError, StateError
from .optimizers import no_decay_matches_nothing
from .parameters import check_pattern
from .train_mode import NUM_BATCHES_TRACKED


def from_torch(module: Any, example_inputs: Sequence[Any], *, kwargs: Mapping[str, Any] | None = None,
               input_names: Sequence[str] | None = None, output_names: Sequence[str] | None = None,
               dynamic_shapes: Any = None, **options: Any) -> onnx.ModelProto:
    """make_trainable(torch.onnx.export(module, example_inputs, dynamo=True, optimize=False), trainable=...) where
    the trainable names are the module's parameters that require a gradient. optimize=False keeps each parameter
    one initializer under its own name: the optimizing pass folds transposes into weights, lifts scalar constants,
    merges equal-valued initializers and unties tied ones. A tied parameter (one tensor, several names) is the
    initializer under whichever of its names the exporter kept; a parameter the forward never reads is not
    exported, and PyTorch gives it no gradient either. `kwargs` are forward's keyword arguments (Hugging Face's
    `labels=`), as torch.onnx.export's. Without `output_names`, the outputs of a forward that returns a dict or a
    ModelOutput are named after its keys (`loss`, `logits`: `prediction="logits"`, `loss="output:loss"`), where the
    exporter names them after the op that made them (`linear_7`). `options` go to make_trainable (loss,
    optimizer, ...), a `no_decay` pattern searched in the names named_parameters() gives; with train_mode=True,
    a BatchNorm with momentum=None trains its cumulative average (record_cumulative_averages), which no export
    holds."""
    import torch

    if "trainable" in options:
        raise AuthoringError("from_torch: trainable is the module's parameters that require a gradient; call "
                             "torch.onnx.export and make_trainable yourself to choose others")
    if isinstance(example_inputs, Mapping):
        raise AuthoringError("from_torch: example_inputs are forward's positional arguments, a tuple; pass keyword "
                             "arguments as kwargs={...}")
    averaged = [name for name, bn in cumulative_averages(module) if bn.training]
    if averaged and options.get("train_mode"):  # torch.export would fail on the data-dependent 1 / count
        raise AuthoringError(f"from_torch: BatchNorm {averaged[:3]} (momentum=None) is in train mode, whose "
                             "cumulative average torch.export cannot export; pass the module in eval mode "
                             "(module.eval()): train_mode=True trains it as PyTorch's train() all the same")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        program = torch.onnx.export(module, tuple(example_inputs), kwargs=None if kwargs is None else dict(kwargs),
                                    dynamo=True, optimize=False, verbose=False, input_names=input_names,
                                    output_names=output_names, dynamic_shapes=dynamic_shapes)
    if output_names is None:
        name_outputs_by_key(program)
    model = program.model_proto
    warn_fixed_dimensions(dynamic_shapes, model)
    if options.get("train_mode"):
        record_cumulative_averages(module, model)
    initializers = {t.name for t in model.graph.initializer}
    names_of: dict[int, list[str]] = {}
    required: dict[int, bool] = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(parameter), []).append(name)
        required[id(parameter)] = parameter.requires_grad
    # each trained parameter's initializer, by the name named_parameters() gives it (a tied one's first)
    kept = {names[0]: next(n for n in names if n in initializers) for key, names in names_of.items()
            if required[key] and any(n in initializers for n in names)}
    if isinstance(options.get("no_decay"), str):
        options["no_decay"] = no_decay_by_module_names(options["no_decay"], kept)
    return make_trainable(model, trainable=list(kept.values()), **options)


def to_torch(source: Any, module: Any) -> list[str]:
    """Copy trained values back into `module`, in place: each of its parameters and buffers that `source` (an
    Engine, whose state it reads, or a mapping of name -> array such as jax_function's params) holds under one of
    the module's names for it -- from_torch's export keeps the module's names; a tied parameter is found under
    whichever of its names the exporter kept -- converted to the tensor's own dtype and device. Returns the names
    it did not find, as torch's load_state_dict reports missing keys: those keep their values (a parameter the
    forward never reads, which PyTorch would not train either; an optimizer-free buffer such as a BatchNorm's
    num_batches_tracked; a weight an exporter renamed or folded, as TorchScript's default export renames a
    transposed one). StateError, before anything is copied, for a value whose shape is not the tensor's."""
    import torch

    values = source.state if hasattr(source, "state") else source
    tensors: dict[int, tuple[Any, list[str]]] = {}  # one entry per tensor, with all its names (tied ones)
    named = itertools.chain(module.named_parameters(remove_duplicate=False),
                            module.named_buffers(remove_duplicate=False))
    for name, tensor in named:
        tensors.setdefault(id(tensor), (tensor, []))[1].append(name)
    found, missing = [], []
    for tensor, names in tensors.values():
        key = next((n for n in names if n in values), None)
        if key is None:
            missing += names
        elif tuple(values[key].shape) != tuple(tensor.shape):
            raise StateError(f"to_torch: {key!r} holds shape {list(values[key].shape)}, the module's tensor "
                             f"{list(tensor.shape)}: not a value of the same parameter")
        else:
            found.append((tensor, key))
    with torch.no_grad():
        for tensor, key in found:  # one host copy at a time; NumPy's float32 carries bfloat16 exactly
            value = np.array(values[key])
            if value.dtype.name not in np.sctypeDict or value.dtype.kind == "V":
                value = value.astype(np.float32)
            tensor.copy_(torch.from_numpy(value))
    return missing


def no_decay_by_module_names(pattern: str, kept: Mapping[str, str]) -> str:
    """`no_decay` searched in the parameters' names as named_parameters() gives them, as torch's parameter groups
    and Hugging Face's Trainer search them, as a pattern of their initializers' names (`kept`: module name ->
    initializer). A tied parameter's initializer has whichever of its names the exporter kept (GPT-2's wte is
    lm_head.weight): r"bias|wte" had decayed GPT-2's embedding, which torch's groups exempt. The pattern stays as
    it is where it picks the same parameters either way."""
    check_pattern("no_decay", pattern)
    exempt = sorted(initializer for name, initializer in kept.items() if re.search(pattern, name))
    if not exempt:
        raise no_decay_matches_nothing(pattern, list(kept))
    if exempt == sorted(n for n in kept.values() if re.search(pattern, n)):
        return pattern
    return "^(?:" + "|".join(map(re.escape, exempt)) + ")$"


def record_cumulative_averages(module: Any, model: onnx.ModelProto) -> None:
    """For each BatchNorm with momentum=None (PyTorch's cumulative average over the batches seen, factor
    1 / num_batches_tracked), which no export holds (an eval-mode export writes momentum 1, as for momentum=0, and
    train_mode would leave its running statistics as they are): its num_batches_tracked as an initializer of that
    name, and on its BatchNormalization the record train_mode trains the average from (NUM_BATCHES_TRACKED),
    optional metadata that leaves the model standard ONNX."""
    nodes = {n.input[3]: n for n in model.graph.node if n.op_type == "BatchNormalization" and len(n.input) > 3}
    initializers = {t.name for t in model.graph.initializer}
    for name, bn in cumulative_averages(module):
        prefix = f"{name}." if name else ""
        node, counter = nodes.get(f"{prefix}running_mean"), f"{prefix}num_batches_tracked"
        if node is not None and counter not in initializers:
            count = np.asarray(bn.num_batches_tracked.detach().cpu().numpy(), np.int64)
            model.graph.initializer.append(numpy_helper.from_array(count, counter))
            node.metadata_props.add(key=NUM_BATCHES_TRACKED, value=counter)


def cumulative_averages(module: Any) -> list[tuple[str, Any]]:
    """The module's BatchNorms with momentum=None that track running statistics (PyTorch's cumulative average),
    with their names."""
    import torch

    return [(name, m) for name, m in module.named_modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.momentum is None and m.track_running_stats]


def warn_fixed_dimensions(dynamic_shapes: Any, model: onnx.ModelProto) -> None:
    """Warn where a dimension `dynamic_shapes` names (torch.export.Dim("seq")) is no input's dimension in the
    export: torch.export specializes a dimension the model's code makes a constant (nn.LSTM's and nn.GRU's
    length, in torch 2.13, from the second export of one in a process, even of a fresh module, and after
    torch._dynamo.reset()), torch.onnx.export then exports with the example's size, and the first batch of
    another size would be a FeedError saying the model fixes it, which the user did tell to vary."""
    import torch

    named: set[str] = set()
    stack = [dynamic_shapes]
    while stack:
        spec = stack.pop()
        if isinstance(spec, Mapping):
            stack.extend(spec.values())
        elif isinstance(spec, (list, tuple)):
            stack.extend(spec)
        elif isinstance(spec, torch.export.Dim):  # Dim.AUTO and Dim.DYNAMIC name nothing; a derived 2*seq names seq
            named.add(spec.__name__)
    kept = " ".join(d.dim_param for i in model.graph.input for d in i.type.tensor_type.shape.dim)
    fixed = sorted(n for n in named if not re.search(rf"\b{re.escape(n)}\b", kept))
    if fixed:
        dims = [[d.dim_param or str(d.dim_value) for d in i.type.tensor_type.shape.dim] for i in model.graph.input]
        shapes = ", ".join(f"{i.name} [{', '.join(d)}]" for i, d in zip(model.graph.input, dims))
        warnings.warn(f"from_torch: dynamic_shapes names {fixed}, but the export fixed them to the example's sizes "
                      f"({shapes}): torch.export specialized them (the model's code treats them as constants; "
                      "torch 2.13 does so to an nn.LSTM's or nn.GRU's length from its second export in a process: "
                      "export in a process of its own), so every batch must keep those sizes", stacklevel=3)


def name_outputs_by_key(program: Any) -> None:
    """Renames the outputs of an export whose forward returned a mapping (a dict, a Hugging Face ModelOutput) after
    their keys, nested ones joined with '.' (`hidden_states.0`), as torch.export's output spec records them. A value
    returned under several keys (BertModel's last_hidden_state, also its last hidden_states) takes the first. An
    output that is also a graph input or initializer, or whose key another value already holds, keeps the
    exporter's name: renaming it would rename that input too, or name two values alike."""
    spec = program.exported_program.call_spec.out_spec
    outputs = list(program.model.graph.outputs)
    if spec is None or spec.num_leaves != len(outputs) or keys_of(spec) is None:
        return
    taken = {value.name for value in values_of(program.model.graph)}
    renamed: set[int] = set()
    for value, path in zip(outputs, leaf_paths(spec)):
        name = ".".join(path)
        if (id(value) not in renamed and name not in taken and not value.is_graph_input()
                and not value.is_initializer()):
            taken.discard(value.name)
            value.name = name
            taken.add(name)
            renamed.add(id(value))


def keys_of(spec: Any) -> list[str] | None:
    """A pytree node's child keys where it is a mapping (its context the list of its keys), else None."""
    context = spec.context
    if isinstance(context, (list, tuple)) and len(context) == spec.num_children and all(
            isinstance(k, str) for k in context):
        return list(context)
    return None


def leaf_paths(spec: Any, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Each leaf's path of keys (a sequence's positions as numbers), in flattening order."""
    if spec.is_leaf():
        return [path]
    keys = keys_of(spec) or [str(i) for i in range(spec.num_children)]
    return [leaf for key, child in zip(keys, spec.children()) for leaf in leaf_paths(child, path + (key,))]


def values_of(graph: Any) -> list[Any]:
    """Every value of an onnx_ir graph, its subgraphs' included: the names an output's new name must not take."""
    import onnx_ir as ir

    values = [*graph.inputs, *graph.initializers.values()]
    for node in ir.traversal.RecursiveGraphIterator(graph):
        values.extend(node.outputs)
    return values
