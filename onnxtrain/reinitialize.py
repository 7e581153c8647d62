"""make_trainable(reinitialize=True): the initialization graph re-draws each trained parameter as PyTorch's default
initialization of the layer that reads it (each layer's reset_parameters), decided from how the graph reads it.

The reader is the first node, in graph order, that reads the parameter's values, looking through the nodes the
exporters put between a parameter and its layer (VIEWS: the dynamo exporter's Transpose before a Linear's MatMul,
its Slice and Concat that reorder an LSTM's gates, TorchScript's Identity for a deduplicated initializer). RULES
maps (op_type, input index) of that reader to the draw:

- Linear (MatMul's B, Gemm's B; MatMul's A, W @ x) and Conv / ConvTranspose weights: kaiming_uniform_(a=sqrt(5)),
  which is U(-1/sqrt(fan_in), 1/sqrt(fan_in)); fan_in the contracted dimension as the node reads it (Gemm's
  transB, the Transpose's perm), a convolution's weight.size(1) * prod(kernel) (torch's
  _calculate_fan_in_and_fan_out, for ConvTranspose too); their bias (Gemm's C, a convolution's B, the Add of one
  value per output right after such a MatMul) the same bound, from the weight the same node reads.
- Embedding (Gather's data on axis 0): N(0, 1); an embedding's padding row zero, as nn.Embedding(padding_idx).
- A normalization's scale ones, its bias zeros: LayerNormalization, BatchNormalization, GroupNormalization,
  InstanceNormalization, RMSNormalization, and the Mul by the scale and Add of the bias after a decomposed
  normalization (TorchScript's LayerNorm below opset 17: Div by a Sqrt).
- LSTM / GRU / RNN W, R and B: U(-1/sqrt(hidden_size), 1/sqrt(hidden_size)).

A parameter no rule covers (another reader, a fan-in that the views hide) is not re-drawn: it keeps its value,
and a warning names it. The parts of a parameter that get no gradient (optimizers.zero_parts: an embedding's
padding row, the recurrent half tf2onnx adds to a Keras LSTM's bias) start at zero. The running statistics that
train_mode=True updates restart as torch's BatchNorm resets them: mean 0, variance 1, batch count 0."""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .parameters import RECURRENCES, attribute, metadata
from .train_mode import NUM_BATCHES_TRACKED, constant_tensors

if TYPE_CHECKING:
    from .authoring import Builder

Shape = tuple[int, ...]


class Draw(NamedTuple):
    """How a parameter is drawn: "uniform" U(-scale, scale), "normal" N(0, scale**2), "ones" or "zeros"."""

    kind: str
    scale: float = 0.0


ONES, ZEROS = Draw("ones"), Draw("zeros")
NORMALIZATIONS = ("LayerNormalization", "BatchNormalization", "GroupNormalization", "InstanceNormalization",
                  "RMSNormalization")


class Origin(NamedTuple):
    """An initializer reaching a node input, with its shape as the node reads it (None: a view changed it in a
    way not followed, a Slice or Concat)."""

    name: str
    shape: Shape | None


def permuted(node: onnx.NodeProto, shape: Shape, constants: Mapping[str, np.ndarray]) -> Shape | None:
    perm = attribute(node, "perm", list(reversed(range(len(shape)))))
    return tuple(shape[axis] for axis in perm) if sorted(perm) == list(range(len(shape))) else None


def reshaped(node: onnx.NodeProto, shape: Shape, constants: Mapping[str, np.ndarray]) -> Shape | None:
    """Reshape's output shape where its shape input is a constant (0 copies the input's dimension, -1 infers)."""
    target = constants.get(node.input[1])
    if target is None:
        return None
    dims = [shape[i] if d == 0 and i < len(shape) else int(d) for i, d in enumerate(np.ravel(target).tolist())]
    if dims.count(-1) > 1:
        return None
    if -1 in dims:
        known = math.prod(d for d in dims if d != -1)
        dims[dims.index(-1)] = math.prod(shape) // known if known else 0
    return tuple(dims)


def axes_of(node: onnx.NodeProto, constants: Mapping[str, np.ndarray]) -> Any:
    """An Unsqueeze's or Squeeze's axes: an attribute before opset 13, an input since (None where not constant)."""
    return constants.get(node.input[1]) if len(node.input) > 1 else attribute(node, "axes", None)


def squeezed(node: onnx.NodeProto, shape: Shape, constants: Mapping[str, np.ndarray]) -> Shape | None:
    """Squeeze's output shape: without axes, every unit axis removed (the Squeeze/Unsqueeze Hugging Face's Mamba
    reads its depthwise Conv1d's weight through)."""
    if len(node.input) > 1 and node.input[1] and node.input[1] not in constants:
        return None
    axes = axes_of(node, constants)
    if not shape:
        return None
    removed = {int(a) % len(shape) for a in np.ravel(axes)} if axes is not None else \
        {i for i, d in enumerate(shape) if d == 1}
    return tuple(d for i, d in enumerate(shape) if i not in removed)


def unsqueezed(node: onnx.NodeProto, shape: Shape, constants: Mapping[str, np.ndarray]) -> Shape | None:
    """Unsqueeze's output shape where its axes are known."""
    axes = axes_of(node, constants)
    if axes is None:
        return None
    rank = len(shape) + len(axes)
    inserted = {int(a) % rank for a in np.ravel(axes)}
    rest = iter(shape)
    return tuple(1 if axis in inserted else next(rest) for axis in range(rank))


# The nodes between a parameter and the layer reading it, each with the shape of what it hands on (None: not
# followed); their data input is the first (Concat: every one)
VIEWS: dict[str, Callable[[onnx.NodeProto, Shape, Mapping[str, np.ndarray]], Shape | None]] = {
    "Identity": lambda node, shape, constants: shape,
    "Cast": lambda node, shape, constants: shape,
    "CastLike": lambda node, shape, constants: shape,
    "Transpose": permuted,
    "Reshape": reshaped,
    "Unsqueeze": unsqueezed,
    "Squeeze": squeezed,
    "Slice": lambda node, shape, constants: None,
    "Split": lambda node, shape, constants: None,
    "Concat": lambda node, shape, constants: None,
}
# Nodes that read a parameter's shape, not its values: not the layer that decides its initialization
SHAPE_READERS = {"Shape", "Size"}


class Reading(NamedTuple):
    """A node input reading a parameter: the node, the index, the shape it reads, and what reaches each value
    (for a rule that looks at the node's other inputs or at their producers)."""

    node: onnx.NodeProto
    index: int
    shape: Shape | None
    reached: Mapping[str, list[Origin]]
    producers: Mapping[str, onnx.NodeProto]


def uniform(fan_in: int | None) -> Draw | None:
    """kaiming_uniform_(a=sqrt(5)) of a weight, and its layer's bias: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    return Draw("uniform", 1 / math.sqrt(fan_in)) if fan_in else None


def read_shape(r: Reading, index: int) -> Shape | None:
    """The shape of the initializer the node reads at `index` (its weight, for a bias), if one alone reaches it."""
    origins = r.reached.get(r.node.input[index], []) if index < len(r.node.input) else []
    return origins[0].shape if len(origins) == 1 else None


# MatMul input index -> (the contracted axis, the output axis) of a weight read there: Linear's x @ W.T, whose W.T
# the exporters write as B, or W @ x (Hugging Face's Mamba: dt_proj.weight @ x.transpose(1, 2)), W as A
MATMUL_AXES = {0: (-1, -2), 1: (-2, -1)}


def matmul_axis(shape: Shape | None, index: int, which: int) -> int | None:
    return shape[MATMUL_AXES[index][which]] if shape is not None and len(shape) >= 2 else None


def gemm_fan_in(r: Reading) -> int | None:
    shape = read_shape(r, 1)
    return (shape[1] if attribute(r.node, "transB", 0) else shape[0]) if shape is not None and len(shape) == 2 \
        else None


def conv_fan_in(shape: Shape | None) -> int | None:
    """torch's fan_in of a Conv or ConvTranspose weight: weight.size(1) * the kernel's size."""
    return math.prod(shape[1:]) if shape is not None and len(shape) >= 3 else None


def recurrent(r: Reading) -> Draw | None:
    """torch's RNNBase.reset_parameters: every weight and bias U(-1/sqrt(hidden_size), 1/sqrt(hidden_size))."""
    return uniform(attribute(r.node, "hidden_size", 0))


def matmul_bias(r: Reading) -> Draw | None:
    """An operand of an Add right after a MatMul with a parameter as an operand, one value per output: that
    Linear's bias (not a position table added to a Linear's output without bias)."""
    other = r.producers.get(r.node.input[1 - r.index])
    if other is None or other.op_type != "MatMul":
        return None
    index = next((i for i in (1, 0) if read_shape(r._replace(node=other), i) is not None), None)
    weight = None if index is None else read_shape(r._replace(node=other), index)
    outputs = matmul_axis(weight, index, 1) if index is not None else None
    if outputs is None or r.shape is not None and math.prod(r.shape) != outputs:
        return None
    return uniform(matmul_axis(weight, index, 0))


# How a decomposed normalization divides by the deviation: the producers, each following the one before it through
# any of its inputs (TorchScript's LayerNorm below opset 17: Div(x - mean, Sqrt(var + eps)); torch.rsqrt:
# Mul(x, Reciprocal(Sqrt(...))), the dynamo exporter's RMSNorm)
DIVIDED_BY_DEVIATION = (("Div", "Sqrt"), ("Mul", "Reciprocal", "Sqrt"))


def made_by(r: Reading, value: str, chain: tuple[str, ...]) -> bool:
    node = r.producers.get(value)
    if node is None or node.op_type != chain[0]:
        return False
    return len(chain) == 1 or any(made_by(r, operand, chain[1:]) for operand in node.input)


def normalized(r: Reading, value: str) -> bool:
    """`value` is a normalized activation: a normalization op's output without its affine (the exporters' GroupNorm:
    InstanceNormalization, through a Reshape back), or a deviation divided as DIVIDED_BY_DEVIATION."""
    node = r.producers.get(value)
    while node is not None and node.op_type in VIEWS and node.input:
        node = r.producers.get(node.input[0])
    return node is not None and (node.op_type in NORMALIZATIONS or
                                 any(made_by(r, node.output[0], chain) for chain in DIVIDED_BY_DEVIATION))


def decomposed_scale(r: Reading) -> Draw | None:
    """An operand of a Mul by a normalized value: a decomposed normalization's scale."""
    return ONES if normalized(r, r.node.input[1 - r.index]) else None


def decomposed_bias(r: Reading) -> Draw | None:
    """An operand of an Add after the Mul of a normalized value by a scale: that normalization's bias."""
    scale = r.producers.get(r.node.input[1 - r.index])
    while scale is not None and scale.op_type in VIEWS and scale.input:  # the dynamo exporter's CastLike
        scale = r.producers.get(scale.input[0])
    if scale is None or scale.op_type != "Mul":
        return None
    return ZEROS if any(normalized(r, value) for value in scale.input) else None


def add_operand(r: Reading) -> Draw | None:
    return matmul_bias(r) or decomposed_bias(r)


# (op_type, input index) of the first node reading a parameter -> its draw, None where the rule does not apply
RULES: dict[tuple[str, int], Callable[[Reading], Draw | None]] = {
    ("MatMul", 0): lambda r: uniform(matmul_axis(r.shape, 0, 0)),
    ("MatMul", 1): lambda r: uniform(matmul_axis(r.shape, 1, 0)),
    ("Gemm", 1): lambda r: uniform(gemm_fan_in(r)),
    ("Gemm", 2): lambda r: uniform(gemm_fan_in(r)),
    ("Add", 0): add_operand,
    ("Add", 1): add_operand,
    ("Conv", 1): lambda r: uniform(conv_fan_in(r.shape)),
    ("Conv", 2): lambda r: uniform(conv_fan_in(read_shape(r, 1))),
    ("ConvTranspose", 1): lambda r: uniform(conv_fan_in(r.shape)),
    ("ConvTranspose", 2): lambda r: uniform(conv_fan_in(read_shape(r, 1))),
    ("Gather", 0): lambda r: Draw("normal", 1.0) if attribute(r.node, "axis", 0) == 0 else None,
    **{(op, 1): lambda r: ONES for op in NORMALIZATIONS},
    **{(op, 2): lambda r: ZEROS for op in NORMALIZATIONS if op != "RMSNormalization"},
    ("Mul", 0): decomposed_scale,
    ("Mul", 1): decomposed_scale,
    **{(op, index): recurrent for op in RECURRENCES for index in (1, 2, 3)},
}


# What train_mode=True updates, restarted as torch's BatchNorm.reset_parameters restarts it (reset_running_stats):
# the running mean and variance, and the count of batches that momentum=None averages over (from_torch's record)
RUNNING_STATISTICS = {3: ZEROS, 4: ONES}


def running_state(graph: onnx.GraphProto) -> dict[str, Draw]:
    """{running mean, variance or batch count: its start} of the graph's BatchNormalization nodes."""
    found = {}
    for node in graph.node:
        if node.op_type == "BatchNormalization" and not node.domain:
            found |= {node.input[i]: draw for i, draw in RUNNING_STATISTICS.items() if i < len(node.input)}
            if counter := metadata(node, NUM_BATCHES_TRACKED):
                found[counter] = ZEROS
    return found


def int_constants(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    """The int64 vectors a Reshape's shape or Unsqueeze's axes can be: initializers in the model, Constant nodes."""
    return {name: numpy_helper.to_array(t) for name, t in constant_tensors(graph).items()
            if t.data_type == TensorProto.INT64 and len(t.dims) == 1 and t.data_location != TensorProto.EXTERNAL}


def draws(graph: onnx.GraphProto, params: list[str], shapes: Mapping[str, Shape]) -> dict[str, Draw | None]:
    """Each parameter's draw by RULES from its first reader, None where no rule applies."""
    constants = int_constants(graph)
    reached: dict[str, list[Origin]] = {t.name: [Origin(t.name, tuple(t.dims))] for t in graph.initializer}
    producers = {o: node for node in graph.node for o in node.output}
    found: dict[str, Draw | None] = {}
    for node in graph.node:
        if node.op_type in VIEWS and not node.domain:
            data = node.input if node.op_type == "Concat" else node.input[:1]
            origins = [Origin(o.name, None if o.shape is None else VIEWS[node.op_type](node, o.shape, constants))
                       for value in data for o in reached.get(value, [])]
            if origins:
                reached.update((output, origins) for output in node.output)
            continue
        if node.op_type in SHAPE_READERS:
            continue
        for index, value in enumerate(node.input):
            for origin in reached.get(value, []):
                if origin.name in shapes and origin.name not in found:
                    rule = RULES.get((node.op_type, index)) if not node.domain else None
                    found[origin.name] = rule(Reading(node, index, origin.shape, reached, producers)) if rule \
                        else None
    return {p: found.get(p) for p in params}


def reinitialize_weights(b: Builder, graph: onnx.GraphProto, params: list[str], weights: Mapping[str, np.ndarray],
                         zeroed: Mapping[str, np.ndarray]) -> None:
    """Bind each trained parameter to its draw (module docstring) in the initialization graph, the parts in
    `zeroed` (indices as optimizers.zero_parts takes them) set to zero, and the running statistics the train step
    updates (train_mode=True) to their start; warn of the parameters left as they are."""
    found = draws(graph, params, {p: weights[p].shape for p in params})
    kept = [p for p, draw in found.items() if draw is None]
    # the batch count is an algorithm initializer (train_mode moved it out of the inference graph)
    values = {**weights, **{t.name: numpy_helper.to_array(t) for t in b.initializers if not t.dims}}
    updated = {variable for variable, _, _ in b.updates}
    restarted = {name: draw for name, draw in running_state(graph).items() if name in updated and name in values}
    for p, draw in (found | restarted).items():
        if draw is not None:
            bind_draw(b, p, draw, values[p], zeroed.get(p))
    if kept:
        warnings.warn(f"reinitialize=True: {len(kept)} parameters are not re-drawn and keep their values, as no "
                      f"PyTorch layer's initialization is known for how the graph reads them (onnxtrain/"
                      f"reinitialize.py): {', '.join(kept)}", UserWarning, stacklevel=3)


def bind_draw(b: Builder, p: str, draw: Draw, w: np.ndarray, zeroed: np.ndarray | None) -> None:
    """`p <- draw` in the initialization graph, shaped and typed as `w`, the parts at `zeroed` zero."""
    elem = helper.np_dtype_to_tensor_dtype(w.dtype)
    name = f"{p}.init"
    drawn = name if zeroed is None else f"{p}.drawn"
    if draw.kind == "uniform":
        b.init_nodes.append(helper.make_node("RandomUniform", [], [drawn], shape=list(w.shape), dtype=elem,
                                             low=-draw.scale, high=draw.scale))
    elif draw.kind == "normal":
        b.init_nodes.append(helper.make_node("RandomNormal", [], [drawn], shape=list(w.shape), dtype=elem,
                                             scale=draw.scale))
    else:  # ones or zeros, by ConstantOfShape: no full-size constant in the model
        b.init_nodes += [
            helper.make_node("Constant", [], [f"{p}.init.shape"],
                             value=numpy_helper.from_array(np.asarray(w.shape, np.int64))),
            helper.make_node("ConstantOfShape", [f"{p}.init.shape"], [drawn], value=numpy_helper.from_array(
                np.full(1, draw.kind == "ones", w.dtype))),
        ]
    if zeroed is not None:
        at = np.asarray(zeroed, np.int64)
        b.init_nodes += [
            helper.make_node("Constant", [], [f"{p}.init.zeroed"], value=numpy_helper.from_array(at)),
            helper.make_node("Constant", [], [f"{p}.init.zeros"], value=numpy_helper.from_array(
                np.zeros((len(at), *w.shape[at.shape[1]:]), w.dtype))),
            helper.make_node("ScatterND", [drawn, f"{p}.init.zeroed", f"{p}.init.zeros"], [name]),
        ]
    b.init_outputs.append(helper.make_tensor_value_info(name, elem, w.shape))
    b.init_bindings.append((p, name))
