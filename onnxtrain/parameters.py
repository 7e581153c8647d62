"""Which initializers of an exported model are its parameters (what `make_trainable` trains by default), and the
exporter rewrites that change what PyTorch would train (warned about, since no engine can undo them).

Exporters store more than parameters as float initializers: the dynamo exporter lifts scalar constants (GELU's
0.5 / 0.044715, a Pow exponent 3.0, the attention scale, a mask's fill value) and folds attention masks; both
exporters fold transposes into weights, and merge equal-valued initializers. Names do not tell them apart (the
dynamo exporter's folded weights are `val_N` like its constants), so the rules below read how each initializer is
used: a constant sits where no parameter sits. The dynamo exporter also records on each node the PyTorch call it
comes from, which tells the constants a call's decomposition makes for itself (`made_inside_calls`)."""

from __future__ import annotations

import re
import warnings
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import ml_dtypes
import numpy as np
import onnx

from .dtypes import TRAINING_FLOAT_TYPES
from .errors import AuthoringError
from .model import ModelSource, read_model
from .tensor_data import DecodedOnRead, tensor_value


# (op_type, input index) where a float tensor is a setting, never a parameter PyTorch trains
CONSTANT_INPUTS = {
    ("BatchNormalization", 3), ("BatchNormalization", 4),  # running statistics: averages of activations
    ("Pow", 1),  # an exponent: GELU's tanh form cubes with an exponent the dynamo exporter lifts
    ("Clip", 1), ("Clip", 2),  # ReLU6 / Hardtanh bounds
    ("Pad", 2),  # the fill value
    ("Dropout", 1),  # the ratio
    ("Resize", 1), ("Resize", 2), ("Upsample", 1),  # region of interest, scales
    ("Range", 0), ("Range", 1), ("Range", 2),
    # a recurrence's initial state: PyTorch's default is zeros it never trains (dynamo lifts them to a val_N)
    ("LSTM", 5), ("LSTM", 6), ("GRU", 5), ("RNN", 5),
}
# Ops whose 0-d float operand is a lifted constant (a scale, a shift, a fill value), not a parameter. A 0-d
# parameter usually reaches another op first (a logit scale: Exp); a one-element bias (Linear(n, 1)) is 1-d
ELEMENTWISE_OPS = {
    "Add", "Sub", "Mul", "Div", "Pow", "Where", "Max", "Min", "Mod", "Sum", "Mean", "Clip",
    "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual",
}
MASK_MAGNITUDE = 1e30  # attention masks fill with -inf or float32's lowest (-3.4e38); no weight gets near
# Ops that apply a folded additive attention mask to attention scores
MASK_OPS = {"Add", "Where"}
# The nodes the dynamo optimizer folds an eval-mode BatchNorm into (a Linear's Gemm: Linear + BatchNorm1d), with
# the onnxscript rewriter rule it names in the metadata of the node it made
FUSION_RULES = {op: f"FuseBatchNormInto{op}" for op in ("Conv", "ConvTranspose", "Gemm")}
# tf2onnx's optimizer fuses a Conv and the BatchNormalization after it (a Keras Conv2D + BatchNormalization) into
# new initializers `<conv node>_weights_fused_bn` and `<conv node>_bias_fused_bn`, recording nothing else
TF2ONNX_FUSED_WEIGHT = "_weights_fused_bn"


class ParameterizationWarning(UserWarning):
    """The exported model's initializers are not the source model's parameters one for one (the exporter merged,
    untied or broadcast them), so training them is not what the source framework would train."""


Use = tuple[str, int]  # (op_type, input index) of one node reading an initializer


def uses(graph: onnx.GraphProto, through_identity: bool = True) -> dict[str, list[Use]]:
    """Every node input that reads each name, subgraphs included (a subgraph may read an outer initializer). With
    `through_identity`, an Identity's readers read its input: TorchScript's exporter deduplicates equal
    initializers (two fresh BatchNorms' zero running means) by keeping one and reading it through an Identity
    wherever the other was read."""
    found: dict[str, list[Use]] = defaultdict(list)
    copies: dict[str, list[str]] = defaultdict(list)  # name -> the outputs of the Identity nodes reading it

    def walk(g: onnx.GraphProto) -> None:
        for node in g.node:
            if through_identity and node.op_type == "Identity" and len(node.input) == 1:
                copies[node.input[0]].append(node.output[0])
                continue
            for index, name in enumerate(node.input):
                found[name].append((node.op_type, index))
            for attribute in node.attribute:
                for sub in [attribute.g] if attribute.HasField("g") else list(attribute.graphs):
                    walk(sub)

    walk(graph)
    for name in list(copies):  # through chains of Identity too; ONNX graphs are acyclic
        pending = list(copies[name])
        while pending:
            copy = pending.pop()
            found[name].extend(found.get(copy, []))
            pending.extend(copies.get(copy, []))
    return found


# (op_type, input index) whose leading axis is the op's layout, not the parameter's: a recurrence's weights and
# biases, [num_directions, ...]; B holds a direction's input and hidden biases (PyTorch's bias_ih, bias_hh) end to end
DIRECTION_AXIS_INPUTS = {("LSTM", 1), ("LSTM", 2), ("LSTM", 3), ("GRU", 1), ("GRU", 2), ("GRU", 3),
                         ("RNN", 1), ("RNN", 2), ("RNN", 3)}


def source_ranks(graph: onnx.GraphProto, shapes: dict[str, tuple[int, ...]]) -> dict[str, int]:
    """The rank each initializer had as a parameter before the exporter reshaped it for its readers, which is
    what no_decay=True goes by (torch's p.ndim <= 1): less the direction axis of a recurrence's W, R and B, and 1
    for a per-channel vector that only elementwise ops (and PRelu) read, shaped [C, 1, ..., 1] or [1, C, 1, 1] to
    broadcast over the spatial axes (GroupNorm's scale and shift after InstanceNormalization, a PReLU slope). A
    [1, 1, d] operand keeps its rank: nothing follows its vector, as a parameter made [1, 1, d] is shaped."""
    used = uses(graph)
    ranks = {}
    for name, shape in shapes.items():
        readers = used.get(name, [])
        if readers and all(use in DIRECTION_AXIS_INPUTS for use in readers):
            ranks[name] = len(shape) - 1
        elif readers and per_channel(shape) and all(op in ELEMENTWISE_OPS or op == "PRelu" for op, _ in readers):
            ranks[name] = 1
        else:
            ranks[name] = len(shape)
    return ranks


def per_channel(shape: tuple[int, ...]) -> bool:
    """One axis longer than 1, followed by unit axes only: [C, 1, 1], [1, C, 1, 1]."""
    longer = [i for i, d in enumerate(shape) if d > 1]
    return len(longer) == 1 and longer[0] < len(shape) - 1


def running_statistics(graph: onnx.GraphProto) -> set[str]:
    """The running mean and variance inputs of the graph's BatchNormalization nodes (subgraphs included)."""
    return {name for name, used in uses(graph).items() if ("BatchNormalization", 3) in used
            or ("BatchNormalization", 4) in used}


def constant_reason(value: np.ndarray, used: list[Use], folded_result: bool = False) -> str | None:
    """Why an initializer read at `used` is a constant rather than a parameter; None for a parameter. A
    `folded_result` of the source model's call (`folded_results`) is no lifted scalar, even 0-d: CLIP's
    logit_scale.exp() is the parameter logit_scale, folded."""
    if used and all(use in CONSTANT_INPUTS for use in used):
        return f"read only as {', '.join(sorted({f'{op} input {i}' for op, i in used}))}"
    # each reader alone makes a 0-d value a constant, so a mix of them does too: the dynamo optimizer merges equal
    # scalars, and MobileBERT's one 0.0 was both its trigram Pad's fill value and its masks' Where operand (trained)
    if (value.ndim == 0 and used and all(op in ELEMENTWISE_OPS or (op, i) in CONSTANT_INPUTS for op, i in used)
            and not folded_result):
        settings = sorted({f"{op} input {i}" for op, i in used if op not in ELEMENTWISE_OPS})
        return "a 0-d operand of elementwise arithmetic" + (f" and read as {', '.join(settings)}" if settings else "")
    # two reductions, no temporary: a float64 copy of an embedding table once tripled make_trainable's peak memory
    if value.size and not float(max(value.max(), -value.min())) < MASK_MAGNITUDE:  # a NaN fails too
        return "holds infinite or mask-fill values"
    if folded_mask(value, used):
        return "a uniform batch-shaped operand of Add/Where (a folded attention mask)"
    if position_table(value):
        return "sinusoids of the position (a rotary or sinusoidal position table)"
    if position_angles(value, used):
        return "angles p x f of the row index p, read by Sin and Cos (a rotary table before its cos and sin)"
    if alibi_slopes(value):
        return "ALiBi's per-head slopes (a fixed function of the head count)"
    if base_grid(value):
        return "a grid of coordinates in [-1, 1] with a column of ones (affine_grid's base grid)"
    if window_sizes(value, used):
        return "unequal whole numbers read only as a divisor (an adaptive average pool's window sizes)"
    return None


POSITIONS_MIN = 4  # rows: three recurrence steps tell a sinusoid from anything a parameter starts as
SINUSOID_TOLERANCE = 1e-3  # float32's rounding of p x frequency, p into the thousands


def position_table(value: np.ndarray) -> bool:
    """Each column of `value` (rows: the positions, axis -2; any other axes: columns) is sin(p f) or cos(p f) of
    the row index p for a frequency f of its own, and some column varies: the tables a rotary attention
    multiplies queries and keys by (Llama's cos and sin, which the dynamo exporter computes from the inverse
    frequencies buffer and lifts into initializers) and a frozen sinusoidal position embedding (Whisper's
    encoder, requires_grad off), neither of which PyTorch trains. A trained weight never starts as one: a
    column of a sinusoid starts at 0 (sine) or 1 (cosine) and obeys x[p+1] + x[p-1] = 2 cos(f) x[p]."""
    if value.ndim < 2 or value.shape[-2] < POSITIONS_MIN or not value.size:
        return False
    positions = np.moveaxis(value, -2, 0)  # a view: reshaping it to columns may copy the whole table
    # its first rows alone first: an embedding whose padding row is zero fails there, before any copy of it
    if not sinusoids(positions[:POSITIONS_MIN].reshape(POSITIONS_MIN, -1)):
        return False
    table = positions.reshape(value.shape[-2], -1)
    return sinusoids(table) and float(np.ptp(table, axis=0).max()) >= 0.5


def sinusoids(table: np.ndarray) -> bool:
    """Whether each column of `table` (positions x columns) starts at 0 or 1, stays within [-1, 1] and obeys
    x[p+1] + x[p-1] = c x[p] for a constant c of its own (2 cos f, fitted by least squares)."""
    first = table[0]
    if not np.all((np.abs(first) < SINUSOID_TOLERANCE) | (np.abs(first - 1) < SINUSOID_TOLERANCE)):
        return False
    table = table.astype(np.result_type(table.dtype, np.float32), copy=False)
    if float(np.abs(table).max()) > 1 + SINUSOID_TOLERANCE:
        return False
    middle, around = table[1:-1], table[2:] + table[:-2]
    twice_cos = (middle * around).sum(axis=0) / np.maximum((middle * middle).sum(axis=0), 1e-30)
    return bool(np.abs(around - twice_cos * middle).max() < 3 * SINUSOID_TOLERANCE)


def position_angles(value: np.ndarray, used: list[Use]) -> bool:
    """Whether `value`, read only by Sin and Cos, holds along its rows (axis -2) the angles p f of the row index p,
    a frequency f per column (some nonzero): outer(arange(n), inv_freq), concatenated with itself, which
    TorchScript's constant folding makes of a rotary attention that computes its cos and sin in forward (ESM's)
    and lifts into an initializer, Sin and Cos being ops it does not fold. PyTorch never trains it; a weight read
    by Sin or Cos does not start as exact multiples of its second row below a first row of zeros."""
    if (value.ndim < 2 or value.shape[-2] < POSITIONS_MIN or not used
            or not all(op in ANGLE_OPS for op, _ in used)):
        return False
    table = np.moveaxis(value, -2, 0).reshape(value.shape[-2], -1).astype(np.float64)
    ramp = np.arange(len(table))[:, None] * table[1]  # row 0 must then be exactly zero
    return bool(np.any(table[1] != 0)) and bool(np.allclose(table, ramp, rtol=ANGLE_TOLERANCE, atol=0))


ANGLE_OPS = {"Sin", "Cos"}
ANGLE_TOLERANCE = 1e-6  # float32's rounding of p x f, and of (p / scale) x f against p x (f / scale)


def alibi_slopes(value: np.ndarray) -> bool:
    """Whether `value` holds, along its one axis longer than 1, the slopes ALiBi multiplies each head's key
    positions by (Bloom's, Falcon's with alibi=True): computed from the head count alone, so the dynamo exporter
    folds them into an initializer, which PyTorch never trains. A parameter initialised with them (a learned
    ALiBi) looks the same until trained."""
    heads = value.size
    if heads < 2 or max(value.shape) != heads:
        return False
    return bool(np.allclose(value.reshape(-1), alibi(heads), rtol=1e-6, atol=0))


def alibi(heads: int) -> np.ndarray:
    """ALiBi's slopes for `heads` heads (Press et al.'s get_slopes): 2^(-8i/n), i = 1..n, for n the largest
    power of two <= heads; past n, the odd-numbered slopes of 2n heads."""
    n = 2 ** int(np.log2(heads))
    slopes = 2.0 ** (-8.0 * np.arange(1, 2 * n + 1) / (2 * n))  # 2n heads' slopes: n heads' are the even-numbered
    return np.concatenate([slopes[1::2], slopes[0::2][:heads - n]])


def base_grid(value: np.ndarray) -> bool:
    """affine_grid's base grid as PyTorch's decomposition builds it and the dynamo exporter folds it: [points,
    k + 1, 1] for k = 2 or 3 spatial axes, each point its k coordinates and a 1, the points every combination of
    one evenly spaced ramp per axis, symmetric about 0 within [-1, 1] (linspace(-1, 1), shrunk by (n - 1) / n
    without align_corners). PyTorch computes it from the output size; a weight never starts as one."""
    if value.ndim != 3 or value.shape[1] not in (3, 4) or value.shape[2] != 1 or value.shape[0] < 2:
        return False
    points = value[:, :, 0].astype(np.float64)
    if not np.all(points[:, -1] == 1):
        return False
    ramps = [np.unique(axis) for axis in points[:, :-1].T]
    return (int(np.prod([ramp.size for ramp in ramps])) == len(points) == len(np.unique(points, axis=0))
            and all(symmetric_ramp(ramp) for ramp in ramps))


def symmetric_ramp(values: np.ndarray) -> bool:
    """Whether sorted distinct `values` step evenly, symmetric about 0, within [-1, 1] (one value: 0)."""
    if values.size == 1:
        return bool(values[0] == 0)
    steps = np.diff(values)
    return (float(np.abs(values).max()) <= 1 and np.allclose(values, -values[::-1], atol=1e-6)
            and np.allclose(steps, steps[0], rtol=1e-3))


def window_sizes(value: np.ndarray, used: list[Use]) -> bool:
    """Unequal positive whole numbers read only as a Div's divisor: PyTorch's decomposition of an adaptive
    average pool whose windows differ in size (16 -> 7) sums each window and divides by its size, a float
    tensor the dynamo exporter folds (equal windows pool by AveragePool instead). A parameter only divided by
    starts as one value repeated (a temperature of 1), trained it holds fractions."""
    return (value.size > 1 and bool(used) and all(use == ("Div", 1) for use in used)
            and bool(np.all(value >= 1)) and bool(np.all(value == np.round(value)))
            and not np.all(value == value.flat[0]))


def folded_mask(value: np.ndarray, used: list[Use]) -> bool:
    """An all-equal tensor of rank >= 3 with a leading (batch) axis > 1, read only by Add/Where: the dynamo
    exporter folds an all-visible attention mask into such a [batch, 1, query, key] tensor of zeros. A parameter
    broadcasts over the batch (leading axis 1: a zero-initialized position embedding [1, n, d] stays a
    parameter), and zero-initialized weights of matrix products (LoRA B, a zero Conv) are read by MatMul/Conv.
    A batch-1 export's mask [1, 1, q, k] therefore stays trainable (warned about as merged when several layers
    read it)."""
    return (value.ndim >= 3 and value.shape[0] > 1 and value.size > 0 and bool(used)
            and all(op in MASK_OPS for op, _ in used) and bool(np.all(value == value.flat[0])))


def constants(model: onnx.ModelProto, records: ExportRecords) -> dict[str, str]:
    """Float initializers of the main graph that are not parameters, each with the reason."""
    used = uses(model.graph)
    made, results = made_inside_calls(model.graph, records), folded_results(records)
    made |= {name: f"folded from values the source model made in forward ({', '.join(sources)})"
             for name, sources in records.made_in_forward.items() if name not in made}
    if model.producer_name in FILL_VALUE_PRODUCERS:
        made |= {name: "a 0-d fill value expanded to a run-time shape (tf.zeros / tf.ones, as tf2onnx converts them)"
                 for name in fill_values(model.graph, used) if name not in made and name not in results}
    reasons = {}
    for tensor in model.graph.initializer:
        if tensor.data_type in TRAINING_FLOAT_TYPES:
            reason = made.get(tensor.name) or constant_reason(tensor_value(tensor), used.get(tensor.name, []),
                                                              tensor.name in results)
            if reason:
                reasons[tensor.name] = reason
    return reasons


# Converters whose Expand of a 0-d initializer is a fill (tf.zeros / tf.ones of a run-time shape), never a parameter:
# a TorchScript export of a 0-d parameter's `expand` is the same pattern with no record, and trains
FILL_VALUE_PRODUCERS = {"tf2onnx"}


def fill_values(graph: onnx.GraphProto, used: Mapping[str, list[Use]]) -> list[str]:
    """0-d float initializers of the main graph read only (`used`: uses(graph)) as the value an Expand broadcasts to
    a run-time shape: tf2onnx converts TensorFlow's Fill (tf.zeros / tf.ones of a shape the batch decides) so, and
    records nothing: a Keras LSTM's or GRU's zero initial state, the unit scale and zero shift of the
    BatchNormalization tf_keras's LayerNormalization normalizes with before its own gamma and beta. Only for
    FILL_VALUE_PRODUCERS' models: a TorchScript export of a parameter's `expand` has the same form."""
    return [t.name for t in graph.initializer if not t.dims and t.data_type in TRAINING_FLOAT_TYPES
            and used.get(t.name) and all(use == ("Expand", 0) for use in used[t.name])]


# The dynamo exporter records on each node the PyTorch call it comes from (torch.export's FX node, as text)
FX_NODE = "pkg.torch.onnx.fx_node"
FX_CALL = re.compile(r"target=([\w.]+)\]")


def metadata(proto: onnx.NodeProto | onnx.ValueInfoProto, key: str) -> str:
    """The value `proto`'s metadata_props hold under `key` ("" where they hold none)."""
    return {p.key: p.value for p in proto.metadata_props}.get(key, "")


def attribute(node: onnx.NodeProto, name: str, default: Any) -> Any:
    """The node's attribute `name`, `default` where it has none (here, not in train_mode.py, which imports this
    module: the one reader of a node's attributes for both)."""
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def recorded_call(node: onnx.NodeProto) -> str:
    """The dynamo exporter's record of the PyTorch call `node` comes from ("" where there is none)."""
    return metadata(node, FX_NODE)


@dataclass(frozen=True)
class Record:
    """A node's recorded call, read: the call ("" where none is recorded, torch.ops.aten. dropped), its
    positional arguments as written, and the FX values among them (their names without the %)."""

    call: str
    arguments: list[str]
    values: set[str]


def record_of(node: onnx.NodeProto) -> Record:
    text = recorded_call(node)
    call, arguments = FX_CALL.search(text), call_arguments(text)
    return Record(call.group(1).removeprefix(ATEN) if call else "", arguments,
                  set(re.findall(r"%(\w+)", ", ".join(arguments))))


ATEN = "torch.ops.aten."
FX_ARGUMENTS = re.compile(r"\]\(args = \((.*)\), kwargs")


def call_arguments(record: str) -> list[str]:
    """The positional arguments of a recorded call, as written ("%x", "None", "[16]", "[%zeros, %zeros_1]"): split
    at the commas outside brackets, since list arguments hold commas of their own."""
    found = FX_ARGUMENTS.search(record)
    arguments, depth, start = [], 0, 0
    text = found.group(1) if found else ""
    for i, char in enumerate(text):
        depth += {"[": 1, "(": 1, "]": -1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            arguments.append(text[start:i].strip())
            start = i + 1
    return arguments + [text[start:].strip()] if text.strip() else arguments


SDPA = "scaled_dot_product_attention.default"
GROUP_NORM = "group_norm.default"
TO_COPY = "_to_copy.default"
# (call, op_type, input index) -> the largest such constant: where a call's ONNX decomposition reads a constant
# of its own. scaled_dot_product_attention multiplies the query and the key each by the square root of its
# scale, a [1] tensor (a parameter reaching those Muls, a learned query folded over the batch, is larger);
# group_norm normalizes by InstanceNormalization with unit scales and zero shifts, then applies its affine
# parameters by Mul and Add; a cast of a real tensor to a complex dtype (FNet's torch.fft.fftn of its hidden
# states) concatenates zeros, the imaginary part, after the real part, which the exporter folds to [..., 1]
# (the cast's one argument is the real part, input 0). Names do not tell: the optimizing exporter names both
# them and folded weights val_N.
CALL_CONSTANT_INPUTS = {(SDPA, "Mul", 0): 1, (SDPA, "Mul", 1): 1,
                        (GROUP_NORM, "InstanceNormalization", 1): None, (GROUP_NORM, "InstanceNormalization", 2): None,
                        (TO_COPY, "Concat", 1): None}
LAYER_NORM = "layer_norm.default"
EMBEDDING_BAGS = ("embedding_bag.default", "embedding_bag.padding_idx")
INDEX_PUT = "index_put.default"
# (call, op_type, input index) -> the position of the call's argument that input stands for, where the exporter
# may fold what it reads there into an initializer named otherwise: where the call got None, its decomposition
# reads a default of its own, and where it got a factory call's value (FACTORY_VALUE), that value transformed;
# neither is a parameter of the source model. A norm without affine parameters (LayerNorm(elementwise_affine=
# False), GroupNorm(affine=False)) scales by ones and shifts by zeros; embedding_bag without per_sample_weights
# multiplies the rows it sums by ones; index_put (index_add, x[:, i] += v) scatters into its input, moved to put
# the indexed axes first (torch.zeros(...).index_add(1, ...) reads the zeros transposed, as val_N).
ARGUMENT_INPUTS = {(LAYER_NORM, "LayerNormalization", 1): 2, (LAYER_NORM, "LayerNormalization", 2): 3,
                   (GROUP_NORM, "Mul", 1): 2, (GROUP_NORM, "Add", 1): 3,
                   **{(call, "Mul", 1): 6 for call in EMBEDDING_BAGS}, (INDEX_PUT, "ScatterND", 0): 0}

# The source model's calls that make a tensor from shapes and constants alone (torch.zeros(...).scatter_add, the
# float mask F.multi_head_attention_forward makes of a key_padding_mask by zeros_like and masked_fill, the tensor
# a decomposition makes of a Python number: scalar_tensor_default): torch.export names each value after its call
# (zeros, zeros_like_1), and the dynamo exporter names the initializer it folds that value into alike, where its
# readers' records show it as an argument (%zeros_like; a parameter is %p_<name>)
FACTORY_VALUE = re.compile(
    r"(?:(?:new_)?(?:zeros|ones|full|empty)(?:_like)?|eye|arange|scalar_tensor(?:_default)?|lift_fresh_copy)(?:_\d+)?")
# torch.export's placeholders of what the source model holds besides its parameters (p_<name>): buffers
# (register_buffer: a float scale or mask) and lifted constants (a torch.tensor made in forward), which PyTorch
# never trains; the exporter keeps a buffer's name for its initializer (dots made underscores in the placeholder)
NOT_TRAINED_PLACEHOLDERS = ("b_", "c_")


def made_inside_calls(graph: onnx.GraphProto, records: ExportRecords) -> dict[str, str]:
    """Initializers of the main graph read only where the recorded PyTorch call's decomposition reads a constant
    of its own (CALL_CONSTANT_INPUTS, ARGUMENT_INPUTS), as the value of a factory call (FACTORY_VALUE) or inside
    one, or as a buffer or lifted constant (NOT_TRAINED_PLACEHOLDERS), each with the reason."""
    sizes = {t.name: int(np.prod(t.dims)) for t in graph.initializer}
    readers: dict[str, list[str]] = defaultdict(list)  # name -> per reading, who made it, or ""
    for node, record in records.nodes:
        arguments, values = record.arguments, record.values
        # a node of a factory call's own decomposition: torch.zeros of a size that depends on a dynamic dimension
        # (an RNN's initial state of the batch's size) is Expand(a 0-d fill value, the size), not folded
        factory_call = FACTORY_VALUE.fullmatch(record.call.split(".")[0])
        for index, name in enumerate(node.input):
            key = (record.call, node.op_type, index)
            largest = CALL_CONSTANT_INPUTS.get(key, 0)
            own = key in CALL_CONSTANT_INPUTS and name in sizes and (largest is None or sizes[name] <= largest)
            position = ARGUMENT_INPUTS.get(key, len(arguments))
            argument = arguments[position] if position < len(arguments) else ""  # what the input stands for
            made_by = name if name in values else merged_value(name, values) or argument.removeprefix("%")
            factory = FACTORY_VALUE.fullmatch(made_by)
            held = [kind + re.sub(r"\W", "_", name) in values for kind in NOT_TRAINED_PLACEHOLDERS]
            readers[name].append(f"by the exporter inside {key[0]}" if own or argument == "None" else
                                 f"by the source model's {record.call} (no parameter)" if factory_call else
                                 f"by the source model's {made_by} (no parameter)" if factory else
                                 "by the source model as a buffer or constant (no parameter)" if any(held) else "")
    used = uses(graph, through_identity=False)  # `readers` counts each node, an Identity too
    return {name: f"made {', '.join(sorted(set(made)))}" for name, made in readers.items()
            if name in sizes and all(made) and len(made) == len(used[name])}


def merged_value(name: str, values: set[str]) -> str:
    """The value of a record's `values` that initializer `name`, named after a factory call's value (zeros),
    stands for where the exporter merged that call's equal values: each of Mamba's layers starts its scan from
    torch.zeros, recorded as %zeros, %zeros_1, and the exporter keeps one initializer, `zeros`, for both. A
    parameter merged into it is recorded as its placeholder (%p_<name>), not as such a value. "" where none."""
    if not FACTORY_VALUE.fullmatch(name):
        return ""
    call = call_named(name)
    return next((v for v in sorted(values) if FACTORY_VALUE.fullmatch(v) and call_named(v) == call), "")


def call_named(value: str) -> str:
    """The call a value of torch.export's graph is named after: its result's name less the index that tells
    repeated calls apart (%zeros_1, %exp_2, %embedding_1)."""
    return re.sub(r"_\d+$", "", value)


# The export flags that keep an eval-mode BatchNorm a node of its own (train_mode needs it, the warning says it).
KEEP_BATCH_NORM = (
    "export with torch.onnx.export(..., dynamo=False, do_constant_folding=False) (or "
    "training=torch.onnx.TrainingMode.TRAINING), or with dynamo=True and optimize=False: the default exports fold "
    "an eval-mode BatchNorm into the preceding Conv (ConvTranspose, Linear); a Keras model: "
    "tf2onnx.convert.from_keras(..., optimizers={}), whose optimizer fuses the Conv and the BatchNormalization"
)


def check_pattern(option: str, pattern: str) -> None:
    """AuthoringError unless `pattern`, which `option` matches against parameter names, is a regular expression."""
    try:
        re.compile(pattern)
    except re.error as exc:
        raise AuthoringError(f"{option} {pattern!r} is not a regular expression ({exc})") from exc


def parameter_names(source: ModelSource, trainable: str | None = None) -> list[str]:
    """The initializers `make_trainable(model)` trains by default: its float initializers less the constants an
    exporter stores beside them (`constants`), warning where the export changed the
    parameterisation; `trainable`, a regular expression, keeps those whose names match it, as make_trainable's."""
    model, _ = read_model(source)
    return select_trainable(model, trainable)


def select_trainable(model: onnx.ModelProto, trainable: str | Iterable[str] | None) -> list[str]:
    """The model's parameters (None), those whose names match a regular expression, or exactly the names given;
    warns (ParameterizationWarning) where the exporter changed the parameterisation of the chosen ones."""
    return choose_trainable(model, trainable)[0]


def choose_trainable(model: onnx.ModelProto,
                     trainable: str | Iterable[str] | None) -> tuple[list[str], dict[str, np.ndarray]]:
    """select_trainable's names, and the added_recurrent_biases among them: found (and decoded) once, for the
    warning about an all-zero one and for make_trainable's recurrent_halves."""
    floats = [t.name for t in model.graph.initializer if t.data_type in TRAINING_FLOAT_TYPES]
    records = read_records(model.graph)  # once: the default set and the warnings read them several times
    if isinstance(trainable, str):
        check_pattern("trainable", trainable)
    if trainable is None or isinstance(trainable, str):
        left_out = constants(model, records)
        chosen = [n for n in floats if n not in left_out and (trainable is None or re.fullmatch(trainable, n))]
        if not chosen:
            why = "" if floats else (attribute_weights(model.graph) + weights_left_out(model.graph)
                                     + sparse_weights(model.graph))
            raise AuthoringError(f"trainable: no parameter matches {trainable!r} (float initializers: {floats[:20]})"
                                 f"{why}")
    else:
        chosen = list(trainable)
        if not chosen:
            raise AuthoringError("trainable: the list of names is empty")
        check_names(model, chosen)
    added = added_recurrent_biases(model, set(chosen))
    warn_about_parameterization(model, chosen, records, added)
    return chosen, added


def attribute_weights(graph: onnx.GraphProto) -> str:
    """Why a model without float initializers has nothing to train, where its weights are attributes of ai.onnx.ml
    nodes (skl2onnx's LinearClassifier and LinearRegressor for float32 inputs), which no gradient reaches."""
    ops = sorted({node.op_type for node in graph.node if node.domain == "ai.onnx.ml"
                  and any(a.type in (onnx.AttributeProto.FLOATS, onnx.AttributeProto.TENSOR) for a in node.attribute)})
    if not ops:
        return ""
    return (f"; its weights are attributes of its ai.onnx.ml nodes ({', '.join(ops)}), which ONNX's Gradient does "
            f"not differentiate (it differentiates with respect to tensors): a model trains when its weights are "
            f"initializers of plain ops, as skl2onnx writes a linear model for float64 inputs "
            f"(to_onnx(model, X.astype(numpy.float64)))")


def sparse_weights(graph: onnx.GraphProto) -> str:
    """Why a model without float initializers has nothing to train, where its float weights are sparse
    initializers: make_trainable trains dense initializers (graph.initializer), whose values a state variable holds."""
    names = [t.values.name for t in graph.sparse_initializer if t.values.data_type in TRAINING_FLOAT_TYPES]
    if not names:
        return ""
    return (f"; its float weights {names[:5]}{'...' if len(names) > 5 else ''} are sparse initializers, which "
            "make_trainable does not train: store them as dense initializers (graph.initializer) to train them")


# What torch.onnx.export(..., export_params=False) does with the weights, and what to do instead
WEIGHTS_LEFT_OUT = ("torch.onnx.export(..., export_params=False) leaves the weights out of the model (TorchScript's "
                    "exporter makes them graph inputs; the dynamo exporter's model reads them undefined): export with "
                    "export_params=True, the default, for a model that holds the weights it trains")


def weights_left_out(graph: onnx.GraphProto) -> str:
    """Why a model without float initializers has nothing to train, where its export left the weights out: float
    graph inputs besides one (the weights as inputs), or values that nodes read and nothing defines."""
    defined = ({i.name for i in graph.input} | {t.name for t in graph.initializer}
               | {t.values.name for t in graph.sparse_initializer} | {o for n in graph.node for o in n.output})
    undefined = sorted({i for n in graph.node for i in n.input if i and i not in defined})
    fed = [i.name for i in graph.input if i.type.tensor_type.elem_type in TRAINING_FLOAT_TYPES]
    if undefined:
        return (f"; its nodes read values nothing defines ({undefined[:5]}{'...' if len(undefined) > 5 else ''}): "
                f"{WEIGHTS_LEFT_OUT}")
    if len(fed) > 1:
        return f"; its float inputs {fed[:5]}{'...' if len(fed) > 5 else ''} may be its weights: {WEIGHTS_LEFT_OUT}"
    return ""


def check_names(model: onnx.ModelProto, names: list[str]) -> None:
    kinds = {t.name: t.data_type for t in model.graph.initializer}
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise AuthoringError(f"trainable: {repeated} listed twice")
    not_float = sorted(n for n in names if n in kinds and kinds[n] not in TRAINING_FLOAT_TYPES)
    if not_float:
        raise AuthoringError(f"trainable: {not_float} are not float initializers (only floats have gradients)")
    unknown = sorted(n for n in names if n not in kinds)
    if inputs := [n for n in unknown if n in {i.name for i in model.graph.input}]:
        raise AuthoringError(f"trainable: {inputs[:10]} are graph inputs without an initializer, values each call "
                             f"feeds, not weights the model holds: {WEIGHTS_LEFT_OUT}")
    if unknown:
        raise AuthoringError(
            f"trainable: {unknown[:10]}{' ...' if len(unknown) > 10 else ''} ({len(unknown)}) are not initializers "
            f"of the model. A PyTorch export keeps parameter names only with "
            f"torch.onnx.export(..., dynamo=True, optimize=False); a tied parameter appears under one of its names "
            f"(onnxtrain.from_torch maps them); the model's float initializers are: "
            f"{[n for n, k in kinds.items() if k in TRAINING_FLOAT_TYPES][:20]}"
        )


KEEP_PARAMETERS = "Export with torch.onnx.export(..., dynamo=True, optimize=False) (onnxtrain.from_torch)"


# Recurrence ops, whose W, R and B hold one slice per direction along axis 0: a fresh bidirectional layer's two
# directions start from equal slices (a Keras LSTM's zero bias with its forget gate at 1), no exporter's broadcast
RECURRENCES = frozenset({"LSTM", "GRU", "RNN"})


def warn_about_parameterization(model: onnx.ModelProto, chosen: list[str], records: ExportRecords,
                                added: Mapping[str, np.ndarray]) -> None:
    """Warn, once per kind, about chosen initializers the exporter merged, untied, broadcast or folded; `added`:
    the chosen ones' added_recurrent_biases."""
    used = uses(model.graph)
    arrays = DecodedOnRead({t.name: t for t in model.graph.initializer if t.name in set(chosen)})
    merged, repeated, alike = [], [], defaultdict(list)
    for n, a in arrays.items():  # one decoding each (most of this check's time); untied_copies reads pairs again
        if a.size > 1 and np.all(a == a.flat[0]):
            if len(used.get(n, [])) > 1:
                merged.append(f"{n} (every element {a.flat[0]:g}, read by {len(used[n])} nodes)")
            continue  # constant: no copy of a weight, no repetition of one
        if a.size > 1:
            alike[summary(a)].append(n)
        if (how := repetition(a)) and not (how == "along axis 0" and used.get(n) and
                                           all(op in RECURRENCES for op, _ in used[n])):
            repeated.append(f"{n} ({how})")
    untied = [f"{b} is a {how} copy of {a}" for a, b, how in untied_copies(arrays, alike.values())]
    folded = folded_batchnorm(model.graph, set(chosen))
    absent = [n for n, value in added.items() if not np.any(value)]
    keep = KEEP_PARAMETERS
    kinds = [
        (", ".join(merged),
         "exporters merge equal-valued initializers (a freshly initialized model's zero biases and unit norm "
         "scales) into one, which then trains as one parameter shared by every layer that reads it. If they were "
         f"distinct parameters, {keep[0].lower()}{keep[1:]}, or give them distinct values before exporting"),
        (", ".join(untied),
         "the exporter copied a weight the source model uses more than once (an embedding tied to the output "
         "layer, a layer shared by several layers as ALBERT's); the copies would train apart. "
         f"{keep} to keep one weight"),
        (", ".join(repeated),
         "equal slices or repeated values, as when the exporter folds a broadcast, a repeat or a gather of a "
         "parameter into a constant (a token-type embedding's row; DeBERTa's relative position projections "
         "repeated per sequence; a relative position bias table gathered per query-key pair, as Swin's); each copy "
         f"would train on its own, where the source model sums their gradients. {keep}"),
        (", ".join(computed_weights(model.graph, set(chosen), records)),
         "a weight the source model computes from its parameters (a parametrization: weight_norm's g * v / |v|, "
         "spectral_norm; a projection of a parameter, DeBERTa's pos_key_proj(rel_embeddings)), which the exporter "
         f"computed once and folded into a plain tensor; training it trains that tensor, not the parameters. {keep} "
         "to keep them"),
        (f"{', '.join(folded[:6])}{' ...' if len(folded) > 6 else ''} ({len(folded)} in all)" if folded else "",
         "BatchNorm folded into Conv (ConvTranspose, Gemm) by the exporter: the BatchNorm's scale and shift are "
         "gone and the fused kernel W*gamma/sqrt(var+eps) and bias would train instead, another parameterisation. "
         f"To keep BatchNorm, {KEEP_BATCH_NORM}"),
        (", ".join(absent),
         "a recurrence's B that is all zeros, as tf2onnx writes it for a Keras LSTM(use_bias=False), which has no "
         "bias: trained, its input half moves (its recurrent half, added by the converter, stays zero). If the "
         "Keras layer has no bias, leave B out of the trainable set"),
    ]
    for names, why in kinds:
        if names:
            warnings.warn(ParameterizationWarning(f"{names}: {why}"), stacklevel=4)


# The argument that is the weight, in the calls that read one (the dynamo exporter's record of each node)
WEIGHT_ARGUMENTS = {call: 1 for call in (
    "linear.default", "conv1d.default", "conv2d.default", "conv3d.default", "convolution.default",
    "conv_transpose1d.default", "conv_transpose2d.input", "conv_transpose3d.input")}
# The source model's calls whose result, folded by the exporter into an initializer named after it (torch.export
# names a call's result after the call: %embedding_1), trains as the parameters it comes from would: a view, a
# gather of rows, a copy, a shift by a constant (Gemma's 1 + weight) leave each element's SGD step as it was (a
# broadcast, expand, is the equal slices warned about). Any other call's result (sigmoid(decay), a product) is a
# parametrization: trained, its steps are not the parameters'.
STEP_PRESERVING_CALLS = {
    "view", "reshape", "_unsafe_view", "t", "transpose", "permute", "unsqueeze", "squeeze", "select", "slice",
    "index", "embedding", "expand", "clone", "contiguous", "alias", "detach", "lift_fresh_copy", "_to_copy", "add",
    "sub", "cat", "stack", "split", "unbind", "getitem",
}


def folded_results(records: ExportRecords) -> dict[str, tuple[str, str]]:
    """{initializer: (call, reader)} for the initializers a recorded call (`reader`) reads as the result of one of
    the source model's calls: torch.export names a result after its call (%sigmoid, %embedding_1), and the
    exporter names the initializer it folds that result into alike. Factory calls' results aside (constants)."""
    found: dict[str, tuple[str, str]] = {}
    for node, record in records.nodes:
        for name in node.input:
            if (record.call and name in record.values and not FACTORY_VALUE.fullmatch(name)
                    and name not in records.made_in_forward):
                found.setdefault(name, (call_named(name), record.call))
    return found


# onnxscript's optimizer, which the dynamo exporter runs, records on the value_info of what it folds the values
# it folded it from (transitively): parameters and buffers under their state names (model.logit_scale), lifted
# constants (a torch.tensor made in forward: <module>.lifted_tensor_N), FX results (mul_4) and ONNX values (val_N)
FOLDED_FROM = "pkg.onnxscript.optimizer.folded_from"
LIFTED_CONSTANT = re.compile(r"(?:[\w.]+\.)?lifted_tensor_\d+")


def folded_sources(graph: onnx.GraphProto) -> dict[str, list[str]]:
    """{value: the values the exporter folded it from}, where it recorded them (FOLDED_FROM)."""
    return {info.name: re.findall(r"'([^']*)'", record) for info in graph.value_info
            if (record := metadata(info, FOLDED_FROM))}


@dataclass(frozen=True)
class ExportRecords:
    """The dynamo exporter's records in a graph, read once per choose_trainable (each rule reads them again):
    each node of the main graph with its Record, what the optimizer folded each value from (`folded`:
    folded_sources), and `made_in_forward`, those of them folded from tensors the source model made in forward
    alone (constant_sources): PatchTST's scaler divides by clamp_min(ones_like(x).sum(1), 1), x's shape folded
    into a tensor of 16s that no parameter reaches."""

    nodes: list[tuple[onnx.NodeProto, Record]]
    folded: dict[str, list[str]]
    made_in_forward: dict[str, list[str]]
    run_time: set[str]  # the values the graph computes when run: its inputs and its nodes' outputs


def read_records(graph: onnx.GraphProto) -> ExportRecords:
    folded = folded_sources(graph)
    return ExportRecords([(node, record_of(node)) for node in graph.node], folded,
                         {name: sources for name, sources in folded.items() if constant_sources(sources)},
                         {i.name for i in graph.input} | {o for node in graph.node for o in node.output})


def constant_sources(sources: list[str]) -> bool:
    """Whether folded `sources` show a tensor the source model made in forward (a lifted constant, a factory
    call's value) and no state of a submodule (a dotted name other than a lifted constant): DeBERTa's
    sqrt(torch.tensor(d) * scale) is a constant, CLIP's logit_scale.exp() (from model.logit_scale) is not. A
    root module's parameter has no dot: one folded with a lifted constant is taken for a constant."""
    made = [s for s in sources if LIFTED_CONSTANT.fullmatch(s) or FACTORY_VALUE.fullmatch(s)]
    return bool(made) and not any("." in s for s in sources if s not in made)


def computed_weights(graph: onnx.GraphProto, chosen: set[str], records: ExportRecords) -> list[str]:
    """Chosen initializers that a recorded linear or convolution call reads where its weight argument is a value
    computed in the source model (not a parameter's placeholder p_<name>), or that a recorded call reads as the
    folded result of a call other than STEP_PRESERVING_CALLS: a parametrization the exporter folded. The
    exporter's record of what it folded an initializer from (FOLDED_FROM) adds those folded through one of the
    PARAMETRIZING_CALLS (Mamba's A = -exp(A_log), unsqueezed: a folded `unsqueeze`; DeBERTa's relative position
    keys pos_key_proj(rel_embeddings), viewed per head: a folded `linear`) and clears a weight folded through views
    alone (Mamba's conv1d weight.squeeze(1).unsqueeze(1): the parameter itself)."""
    calls = {name: folded_calls(sources, records.run_time) for name, sources in records.folded.items()}
    found = {name: f"{name} (the result of {made_by}, read by {reader})"
             for name, (made_by, reader) in folded_results(records).items()
             if name in chosen and made_by not in STEP_PRESERVING_CALLS}
    found |= {name: f"{name} (folded from {', '.join(sorted(computed & PARAMETRIZING_CALLS))})"
              for name, computed in calls.items() if name in chosen and name not in found
              and computed & PARAMETRIZING_CALLS}
    for node, record in records.nodes:
        names, position = record.arguments, WEIGHT_ARGUMENTS.get(record.call)
        if position is None:
            continue
        weight = names[position] if len(names) > position else ""
        if not weight.startswith("%") or weight.startswith("%p_"):
            continue
        parameters = {re.sub(r"\W", "_", n[3:]) for n in names if n.startswith("%p_")}
        for name in node.input:
            views_of_a_parameter = name in calls and not calls[name]
            if name in chosen and re.sub(r"\W", "_", name) not in parameters and not views_of_a_parameter:
                found.setdefault(name, f"{name} (the weight {weight} of {record.call})")
    return list(found.values())


ONNX_VALUE = re.compile(r"val_\d+")  # the exporter's names of ONNX values (a Reshape's shape), not calls
# Calls whose result is a non-linear function of each element, a product or a normalization: a value folded from a
# parameter through one is a parametrization, whatever views follow; a product scales each step (by the other
# factor: a projection of a parameter table, DeBERTa's pos_key_proj(rel_embeddings)). The sources also name the
# calls that made indices (arange, gather, the comparisons of a mask), none of them here.
PARAMETRIZING_CALLS = {
    "exp", "log", "sigmoid", "softplus", "tanh", "sqrt", "rsqrt", "reciprocal", "pow",
    "linear", "mm", "bmm", "matmul", "addmm", "baddbmm", "einsum", "mul", "div", "conv1d", "conv2d", "conv3d",
    "convolution", "layer_norm", "group_norm", "rms_norm", "linalg_vector_norm",
}


def folded_calls(sources: list[str], run_time: set[str]) -> set[str]:
    """The calls other than STEP_PRESERVING_CALLS among folded `sources`: the FX results there are named after
    their calls (exp_2); state names (dotted), lifted constants, factory values and ONNX values are no calls of a
    parameter, nor is a value the graph still computes at `run_time` (a graph input, an activation): the sources
    list values whose shape alone was read (a Reshape's target folded from layer_norm's output shape). A root
    module's parameter has no dot: it is taken for a call (a view of it, for a computed weight)."""
    return {call for s in sources if "." not in s and not ONNX_VALUE.fullmatch(s) and s not in run_time
            and not LIFTED_CONSTANT.fullmatch(s) and not FACTORY_VALUE.fullmatch(s)
            and (call := call_named(s)) not in STEP_PRESERVING_CALLS}


def folded_batchnorm(graph: onnx.GraphProto, chosen: set[str]) -> list[str]:
    """Chosen weights of a Conv, ConvTranspose or Gemm that carries a BatchNorm folded in at export. The dynamo
    optimizer's rewriter records its rule in the fused node's metadata (FUSION_RULES) and, for a node without a
    bias of its own, names the new bias `<weight>_bias` (the fused kernel keeps the weight's name); TorchScript's
    constant folding (into a Conv alone) names computed initializers after their reader (`onnx::Conv_N`), where a
    Conv's own parameters keep their names. tf2onnx names its fused kernel `<node>_weights_fused_bn`."""
    folded = []
    for node in graph.node:
        if node.op_type not in FUSION_RULES or len(node.input) < 2 or node.input[1] not in chosen:
            continue
        weight, bias = node.input[1], node.input[2] if len(node.input) > 2 else ""
        rules = {p.value for p in node.metadata_props if p.key == "pkg.onnxscript.rewriter.rule_name"}
        if FUSION_RULES[node.op_type] in rules or bias == f"{weight}_bias" or (
                weight.startswith("onnx::Conv_") and bias.startswith("onnx::Conv_")) or (
                weight.endswith(TF2ONNX_FUSED_WEIGHT)):
            folded.append(weight)
    return folded


# Converters that give an ONNX recurrence a zero recurrent bias where the source model has one bias (Wb + Rb is added
# in each gate, so Rb = 0 is exact for inference); PyTorch's exports carry bias_ih and bias_hh, two parameters
ZERO_RECURRENT_BIAS_PRODUCERS = {"tf2onnx"}


def added_recurrent_biases(model: onnx.ModelProto, chosen: set[str]) -> dict[str, np.ndarray]:
    """{B: its values} of the chosen B inputs of the LSTM, RNN and GRU (linear_before_reset=0: there too each gate
    adds Wb + Rb) nodes of a converter that adds a zero Rb (ZERO_RECURRENT_BIAS_PRODUCERS), where Rb is all zeros
    (tf2onnx 1.17 writes a Keras LSTM's bias so; a B trained with Rb held, recurrent_halves, stays so). A GRU with
    linear_before_reset=1 (Keras's reset_after=True) has two biases in the source model too."""
    if model.producer_name not in ZERO_RECURRENT_BIAS_PRODUCERS:
        return {}
    found = {}
    for node in model.graph.node:
        if (node.op_type not in RECURRENCES
                or (node.op_type == "GRU" and attribute(node, "linear_before_reset", 0))
                or len(node.input) < 4 or node.input[3] not in chosen or node.input[3] in found):
            continue
        tensor = next((t for t in model.graph.initializer if t.name == node.input[3]), None)
        value = tensor_value(tensor) if tensor is not None else None
        if value is not None and not np.any(value[..., value.shape[-1] // 2:]):
            found[node.input[3]] = value
    return found


def recurrent_halves(added: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """{B: the indices of its recurrent half} of each trained B of `added` (added_recurrent_biases of the trained
    ones, as choose_trainable found them): the source model has one bias b = Wb + Rb, so make_trainable zeroes
    Rb's gradient (optimizers.zero_parts): Rb stays zero and Wb takes b's whole gradient, as Keras trains b, under
    every optimizer (Rb's zero gradient leaves its moments and its decay at zero). Trained as two halves, b had
    moved twice Keras's SGD step."""
    return {name: np.argwhere(np.broadcast_to(np.arange(value.shape[-1]) >= value.shape[-1] // 2, value.shape))
            for name, value in added.items()}


def summary(a: np.ndarray) -> tuple:
    """What a copy of `a` shares with it, transposed or not: order-free and exact."""
    return a.dtype.str, a.size, a.min(), a.max(), np.count_nonzero(a > 0)


def untied_copies(arrays: Mapping[str, np.ndarray], alike: Iterable[list[str]]) -> list[tuple[str, str, str]]:
    """Pairs (a, b, 'transposed' or 'plain') where b holds a's values (or its transpose), among each list of
    names of `alike` (non-constant arrays of one summary)."""
    pairs = []
    for names in alike:
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                x, y = arrays[a], arrays[b]
                if x.shape == y.shape and np.array_equal(x, y):
                    pairs.append((a, b, "plain"))
                elif x.ndim == 2 and x.T.shape == y.shape and np.array_equal(x.T, y):
                    pairs.append((a, b, "transposed"))
    return pairs


def repetition(a: np.ndarray) -> str:
    """How `a` repeats its values ("" if it does not): equal slices along an axis, else repeated values."""
    axes = repeated_axes(a)
    if axes:
        axis, block = axes[0]
        return f"along axis {axis}" + (f", blocks of {block}" if block > 1 else "")
    return repeated_values(a)


REPEATS_MIN = 16  # distinct values: a structured initialization (identity, Dirac, STN's [1, 0, 0, 0, 1, 0]) has fewer
REPEATS_SAMPLE = 4096  # the leading values looked at: sorting a whole embedding table costs seconds


def repeated_values(a: np.ndarray) -> str:
    """How many distinct values the first REPEATS_SAMPLE nonzero values of a 32- or 64-bit float `a` hold, when
    it is at most half of them and at least REPEATS_MIN ("" otherwise): a gather of a parameter with repeated
    indices that the exporter folded (TorchScript folds Swin's relative_position_bias_table[relative_position_index],
    49 values into 256 per head). A trained weight's nonzero values are distinct but for those that start or are
    stored so: a structured initialization's few values (an identity; all equal, the merged and constant rules'
    case) and values a 16-bit float holds exactly (weights trained in bfloat16 and stored in float32 repeat at its
    precision)."""
    if a.dtype.itemsize < 4:
        return ""
    flat = a.reshape(-1)[:REPEATS_SAMPLE]
    sample = flat[flat != 0]  # a pruned weight's zeros repeat; its other values do not
    if sample.size < 2 * REPEATS_MIN:
        return ""
    distinct = np.unique(sample).size
    if not REPEATS_MIN <= distinct <= sample.size // 2 or any(
            np.array_equal(sample.astype(narrow).astype(sample.dtype), sample)
            for narrow in (np.float16, ml_dtypes.bfloat16)):
        return ""
    return f"{sample.size} values, {distinct} distinct"


def repeated_axes(a: np.ndarray) -> list[tuple[int, int]]:
    """(axis, block) for the axes of length > 1 along which `a` is copies of its first `block` slices, the
    smallest such block: 1 where every slice equals the first (a row broadcast over the batch), more where a
    block repeats, as `repeat(batch, 1, 1)` of a [heads, ...] tensor seen as [batch * heads, ...] (DeBERTa's
    relative position projections). Never for a constant-valued array."""
    if a.ndim < 2 or a.size <= 1 or np.all(a == a.flat[0]):
        return []
    found = []
    for axis, length in enumerate(a.shape):
        block = length
        # the periods dividing the length are the multiples of the smallest: divide by each prime while one holds
        for prime in prime_factors(length):
            if periodic(a, axis, block // prime):
                block //= prime
        if block < length:
            found.append((axis, block))
    return found


def periodic(a: np.ndarray, axis: int, period: int) -> bool:
    """Whether slice i + period of `a` along `axis` equals slice i for every i (views compared, no copy of `a`);
    one slice pair first, which settles a trained weight at once."""
    def along(start: int | None, stop: int | None) -> np.ndarray:
        return a[(slice(None),) * axis + (slice(start, stop),)]

    return (np.array_equal(along(0, 1), along(period, period + 1))
            and np.array_equal(along(period, None), along(0, -period)))


def prime_factors(n: int) -> list[int]:
    """The prime factors of n, each as often as it divides n."""
    factors, p = [], 2
    while p * p <= n:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    return factors + ([n] if n > 1 else [])
