"""The update that make_trainable writes after the Gradient node, as a PyTorch (Hugging Face Trainer) loop does it:

    gradients -> accumulated over `accumulate` micro-batches -> clipped by global norm -> weight decay -> update

Each stage is the torch function of the same name, to float rounding: torch.nn.utils.clip_grad_norm_, the
`weight_decay` of torch.optim (coupled L2 on the gradient; decoupled for AdamW), torch.optim.SGD / Adagrad (the
ai.onnx.preview.training ops, whose step counts start at 0 as torch's do) and torch.optim.Adam / AdamW, written
in plain ops: ONNX's Adam op adds epsilon to sqrt(H) before the bias correction of H, torch after it, and no
attribute can move it (docs/semantics.md). With accumulation, every optimizer state update is gated on the k-th
micro-batch, so the step count and moments advance once per k calls."""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .dtypes import HALF_FLOAT_TYPES
from .errors import AuthoringError
from .lower.registry import TRAINING_DOMAIN
from .parameters import check_pattern

if TYPE_CHECKING:
    from .authoring import Builder

OPTIMIZERS = ("sgd", "momentum", "nesterov", "adagrad", "adam", "adamw")
LEARNING_RATE = "learning_rate"  # an algorithm input with a default: feed it to schedule the rate
STEP = "train.step"  # updates applied so far (micro-batches that completed an accumulation)
MICRO_STEP = "train.micro_step"  # micro-batches accumulated since the last update
ITEMS = "train.items_sum"  # accumulate_by="items": the loss's items (counted labels, elements) since the last update
ACCUMULATE_BY = ("items", "micro_batch")  # what weighs each micro-batch's gradient in an accumulated update
APPLY = "train.apply"  # bool: this call applies the update
# The ai.onnx.preview.training op each optimizer's options are named after (its attributes)
OP_TYPES = {"momentum": "Momentum", "nesterov": "Momentum", "adagrad": "Adagrad", "adam": "Adam", "adamw": "Adam"}
# Attributes weight_decay replaces: one mechanism for every optimizer, with torch's no-decay groups
REPLACED = {"norm_coefficient": "weight_decay", "norm_coefficient_post": "optimizer='adamw' and weight_decay"}
ADAM_DEFAULTS = {"alpha": 0.9, "beta": 0.999, "epsilon": 1e-8}  # torch.optim.Adam's betas and eps
# torch.optim's defaults where the op's differ: Adagrad's eps is 1e-10, the op's 1e-6 (sqrt(h) of a gradient of
# 1e-3 is 1e-3, so 1e-6 moved the weights 0.1%; 5 steps of a small BERT 30% on a near-zero-gradient bias)
OP_DEFAULTS = {"adagrad": {"epsilon": 1e-10}, "adam": ADAM_DEFAULTS, "adamw": ADAM_DEFAULTS}
ADAMW_WEIGHT_DECAY = 0.01  # torch.optim.AdamW's default
CLIP_EPSILON = 1e-6  # torch.nn.utils.clip_grad_norm_ divides max_norm by (total norm + 1e-6)


@dataclass(frozen=True)
class Update:
    """What make_trainable's optimizer options ask for, checked."""

    optimizer: str
    options: dict[str, float]  # the op's attributes (Adam's: alpha = beta1, beta = beta2, epsilon), torch's defaults
    weight_decay: float
    no_decay: str | bool  # a regular expression searched in names, or True: every parameter of rank <= 1
    clip_grad_norm: float | None
    accumulate: int
    accumulate_by: str  # one of ACCUMULATE_BY


def check_update(optimizer: str, options: dict[str, float], weight_decay: float | None, no_decay: str | bool,
                 clip_grad_norm: float | None, accumulate: int, accumulate_by: str = "items") -> Update:
    if optimizer not in OPTIMIZERS:
        raise AuthoringError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    allowed = set() if optimizer == "sgd" else set(
        onnx.defs.get_schema(OP_TYPES[optimizer], 1, TRAINING_DOMAIN).attributes) - set(REPLACED) - {"mode"}
    for name, value in options.items():
        if name in REPLACED:
            raise AuthoringError(f"{name}: use {REPLACED[name]}= (with no_decay= to exclude biases and norms)")
        if name not in allowed:
            raise AuthoringError(f"optimizer {optimizer!r} has no option {name!r} (options: {sorted(allowed)})")
        if not is_number(value):
            raise AuthoringError(f"{name} must be a finite number, got {value!r}")
    if optimizer in ("adam", "adamw"):
        settings = {**ADAM_DEFAULTS, **options}
        if not (0 <= settings["alpha"] < 1 and 0 <= settings["beta"] < 1 and settings["epsilon"] >= 0):
            raise AuthoringError(f"Adam needs 0 <= alpha < 1, 0 <= beta < 1 (torch's betas) and epsilon >= 0, got "
                                 f"alpha={settings['alpha']}, beta={settings['beta']}, epsilon={settings['epsilon']}")
    if weight_decay is None:
        weight_decay = ADAMW_WEIGHT_DECAY if optimizer == "adamw" else 0.0
    if not (is_number(weight_decay) and weight_decay >= 0):
        raise AuthoringError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")
    if no_decay is not False and weight_decay == 0:
        raise AuthoringError(f"no_decay={no_decay!r} excludes parameters from a weight decay of 0: set weight_decay")
    if isinstance(no_decay, str):
        check_pattern("no_decay", no_decay)
    elif no_decay is not True and no_decay is not False:
        raise AuthoringError(f"no_decay must be a regular expression or a bool, got {no_decay!r}")
    if clip_grad_norm is not None and not (is_number(clip_grad_norm) and clip_grad_norm > 0):
        raise AuthoringError(f"clip_grad_norm must be a finite number > 0, got {clip_grad_norm!r}")
    if not is_integer(accumulate) or accumulate < 1:
        raise AuthoringError(f"accumulate must be an integer >= 1 (micro-batches per update), got {accumulate!r}")
    # either value is accepted with accumulate=1, where both are the one micro-batch's gradient: a script that
    # tries several k with one rule runs k=1 too
    if not isinstance(accumulate_by, str) or accumulate_by not in ACCUMULATE_BY:
        raise AuthoringError(f"accumulate_by must be one of {ACCUMULATE_BY} (each micro-batch weighed by its loss's "
                             f"counted labels or elements, or alike), got {accumulate_by!r}")
    options = {**OP_DEFAULTS.get(optimizer, {}), **options}
    return Update(optimizer, {k: float(v) for k, v in options.items()}, float(weight_decay), no_decay,
                  None if clip_grad_norm is None else float(clip_grad_norm), int(accumulate), accumulate_by)


def is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def is_integer(value: object) -> bool:
    """An int or NumPy integer, not a bool (which Python counts as an int)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def decayed(update: Update, params: list[str], ranks: Mapping[str, int]) -> list[str]:
    """The parameters weight decay applies to: all but those `no_decay` names (Hugging Face's convention excludes
    biases and LayerNorm weights: `no_decay=True` excludes every parameter of rank <= 1, which they are; `ranks`
    are the parameters' own, before an exporter reshaped them: parameters.source_ranks)."""
    if update.weight_decay == 0:
        return []
    if update.no_decay is True:
        return [p for p in params if ranks[p] >= 2]
    if update.no_decay is False:
        return list(params)
    excluded = [p for p in params if re.search(update.no_decay, p)]
    if not excluded:
        raise no_decay_matches_nothing(update.no_decay, params)
    return [p for p in params if p not in excluded]


def no_decay_matches_nothing(pattern: str, names: list[str]) -> AuthoringError:
    return AuthoringError(f"no_decay: no trainable parameter's name contains a match of {pattern!r} (parameters: "
                          f"{names[:20]}); no_decay=True leaves out every parameter of rank <= 1 (biases and norm "
                          f"weights, whatever their names: Llama's norms are not LayerNorm)")


def add_update(b: Builder, params: list[str], weights: dict[str, np.ndarray], update: Update,
               zeroed: Mapping[str, np.ndarray], ranks: Mapping[str, int], items: str | None = None,
               loss: str = "loss") -> None:
    """Append the Gradient node and everything after it, binding the new parameters and optimizer state;
    `zeroed`: {parameter: indices of the parts whose gradient is zero} (zero_parts: an embedding's padding row,
    embedding_padding.py; the zero recurrent half of a Keras LSTM's bias, parameters.recurrent_halves);
    `ranks`: the parameters' ranks for no_decay=True (parameters.source_ranks); `items`: the float32 value holding
    what the loss's mean divided by, which weighs the micro-batch under accumulate_by="items" (None: unknown, each
    weighs alike); `loss`: the value differentiated (authoring.Loss.name)."""
    types = {p: helper.make_tensor_type_proto(helper.np_dtype_to_tensor_dtype(weights[p].dtype), weights[p].shape)
             for p in params}
    elems = {p: types[p].tensor_type.elem_type for p in params}
    optimizer_updates = len(b.updates)  # train mode's running statistics, bound before, update every micro-batch
    grads = {p: f"{p}.grad" for p in params}
    b.node("Gradient", params, list(grads.values()), domain=TRAINING_DOMAIN, xs=params, y=loss)
    grads = zero_parts(b, grads, zeroed, weights)
    accumulated, carried = grads, {}
    if update.accumulate > 1:
        by_items = items if update.accumulate_by == "items" else None
        accumulated, carried = accumulate(b, grads, weights, elems, update.accumulate, by_items)
    grads = clip_by_global_norm(b, accumulated, elems, update.clip_grad_norm) if update.clip_grad_norm else accumulated
    to_decay = decayed(update, params, ranks)
    values = {p: p for p in params}  # what the rule updates: AdamW decays the parameters first
    if update.optimizer == "adamw":
        values.update(decay_parameters(b, to_decay, elems, update.weight_decay))
    else:  # a new mapping: `grads` may be `accumulated`, whose sums carry on to the next micro-batch undecayed
        grads = {**grads, **decay_gradients(b, to_decay, grads, elems, update.weight_decay)}
    if update.optimizer in ("adam", "adamw"):
        adam(b, params, values, grads, weights, elems, update.options)
    elif update.optimizer == "sgd":
        sgd(b, params, grads, elems)
    else:
        optimizer_op(b, params, grads, weights, update.optimizer, update.options)
    for p in params:
        b.update(p, f"{p}.next", types[p])
    if update.optimizer != "sgd":
        b.state(STEP, np.asarray(0, np.int64))
        b.node("Add", [STEP, b.scalar("one", 1, TensorProto.INT64)], [f"{STEP}.next"])
        b.update(STEP, f"{STEP}.next", helper.make_tensor_type_proto(TensorProto.INT64, []))
    if update.accumulate > 1:
        b.gate(APPLY, since=optimizer_updates)  # the optimizer's updates happen on the k-th micro-batch only
        finish_accumulation(b, carried)


def zero_parts(b: Builder, grads: dict[str, str], parts: Mapping[str, np.ndarray],
               weights: dict[str, np.ndarray]) -> dict[str, str]:
    """Each parameter's gradient with the parts at `parts[p]` set to zero: indices [k, r] into its leading r axes
    (an embedding's padding row [[row]]; every element of a recurrent bias half, r = 2), a ScatterND of zeros,
    exact whatever the other elements hold (a NaN among them included), where a Mul by a 0/1 mask would keep NaN.
    The zeros are made by ConstantOfShape, a value known when the step is traced (lower/sparse_update.py keeps
    SGD's rows-only update of an embedding through it)."""
    zeroed = dict(grads)
    for p, at in parts.items():
        weight = weights[p]
        index = numpy_helper.from_array(np.asarray(at, np.int64), f"{p}.zeroed")
        shape = numpy_helper.from_array(np.array([len(at), *weight.shape[at.shape[1]:]], np.int64),
                                        f"{p}.zeros.shape")
        b.initializers += [index, shape]
        b.node("ConstantOfShape", [shape.name], [f"{p}.zeros"],
               value=numpy_helper.from_array(np.zeros(1, weight.dtype)))
        b.node("ScatterND", [grads[p], index.name, f"{p}.zeros"], [f"{p}.grad.zeroed"])
        zeroed[p] = f"{p}.grad.zeroed"
    return zeroed


def accumulate(b: Builder, grads: dict[str, str], weights: dict[str, np.ndarray], elems: dict[str, int], k: int,
               items: str | None) -> tuple[dict[str, str], dict[str, tuple[str, onnx.TypeProto]]]:
    """The gradients accumulated since the last update, APPLY (true on the k-th call), and the accumulators:
    {state variable: (its value after this micro-batch, its type)}, which finish_accumulation carries on.
    `items` None: sums of grad / k (torch: `(loss / k).backward()` on each micro-batch), which over k micro-batches
    of equal counts is the gradient of the mean loss over all their rows.
    `items`, the count n_i that this micro-batch's mean loss divides by: the counts' weighted mean of the
    gradients, sum(n_i g_i) / max(sum n_i, 1), the gradient of the mean loss over the union (Hugging Face's
    `num_items_in_batch`) whatever the counts. It is kept as a running mean, m += (g - m) * n_i / max(N, 1) with N
    the counts so far (`train.items_sum`), rather than as the sum of n_i g_i, so that it stays at a gradient's
    scale: a float16 model's sum over thousands of labels would overflow. A micro-batch whose labels are all
    ignored has n_i = 0 and a zero gradient (losses.py), so it leaves m as it was, and a whole window of them
    leaves m at 0: a zero gradient, as torch's, not 0 / 0."""
    b.state(MICRO_STEP, np.asarray(0, np.int64))
    b.node("Add", [MICRO_STEP, b.scalar("one", 1, TensorProto.INT64)], [f"{MICRO_STEP}.next"])
    b.node("Equal", [f"{MICRO_STEP}.next", b.scalar("accumulate", k, TensorProto.INT64)], [APPLY])
    types = {p: helper.make_tensor_type_proto(elems[p], weights[p].shape) for p in grads}
    accumulated, carried = {}, {}
    if items is not None:
        b.state(ITEMS, np.asarray(0, np.float32))
        b.node("Add", [ITEMS, items], [f"{ITEMS}.next"])
        carried[ITEMS] = (f"{ITEMS}.next", helper.make_tensor_type_proto(TensorProto.FLOAT, []))
        b.node("Max", [f"{ITEMS}.next", b.scalar("one", 1, TensorProto.FLOAT)], [f"{ITEMS}.divisor"])
        b.node("Div", [items, f"{ITEMS}.divisor"], ["train.items_share"])
    for p, g in grads.items():
        total = f"{p}.grad_sum" if items is None else f"{p}.grad_mean"
        b.state(total, np.zeros_like(weights[p]))
        if items is None:
            b.node("Mul", [g, b.scalar("inverse_accumulate", 1 / k, elems[p])], [f"{p}.grad_part"])
            b.node("Add", [total, f"{p}.grad_part"], [f"{total}.next"])
        else:
            b.node("Sub", [g, total], [f"{total}.delta"])
            b.node("Mul", [f"{total}.delta", b.cast("train.items_share", elems[p])], [f"{total}.change"])
            b.node("Add", [total, f"{total}.change"], [f"{total}.next"])
        accumulated[p] = f"{total}.next"
        carried[total] = (f"{total}.next", types[p])
    return accumulated, carried


def micro_batches_per_update(algorithm: onnx.GraphProto) -> int:
    """The `accumulate` k written into `algorithm` by add_update: the constant that accumulate's Equal compares
    MICRO_STEP's next count with. 1 where there is none (an update each train step, or a training graph that
    make_trainable did not write: its own state says how it counts). fit divides engine.step_count by it to
    number optimizer updates, as a PyTorch scheduler steps once per optimizer.step()."""
    constants = {t.name: t for t in algorithm.initializer}
    for node in algorithm.node:
        if node.op_type == "Equal" and node.input[0] == f"{MICRO_STEP}.next" and node.input[1] in constants:
            return int(numpy_helper.to_array(constants[node.input[1]]))
    return 1


def finish_accumulation(b: Builder, carried: dict[str, tuple[str, onnx.TypeProto]]) -> None:
    """The accumulators restart from 0 and the micro-batch count from 0 after an update; otherwise they carry on."""
    zero = b.scalar("zero", 0, TensorProto.INT64)
    b.node("Where", [APPLY, zero, f"{MICRO_STEP}.next"], [f"{MICRO_STEP}.carried"])
    b.update(MICRO_STEP, f"{MICRO_STEP}.carried", helper.make_tensor_type_proto(TensorProto.INT64, []))
    for variable, (value, value_type) in carried.items():
        elem = value_type.tensor_type.elem_type
        b.node("Where", [APPLY, b.scalar("zero", 0, elem), value], [f"{variable}.carried"])
        b.update(variable, f"{variable}.carried", value_type)


def clip_by_global_norm(b: Builder, grads: dict[str, str], elems: dict[str, int], max_norm: float) -> dict[str, str]:
    """torch.nn.utils.clip_grad_norm_: every gradient times min(1, max_norm / (total norm + 1e-6)), where the
    total norm is the 2-norm of all gradients together, computed in float32."""
    squares = []
    for p, g in grads.items():
        b.node("ReduceSumSquare", [g], [f"{p}.grad_square"], keepdims=0)
        if elems[p] != TensorProto.FLOAT:
            b.node("Cast", [f"{p}.grad_square"], [f"{p}.grad_square.float"], to=TensorProto.FLOAT)
        squares.append(f"{p}.grad_square" if elems[p] == TensorProto.FLOAT else f"{p}.grad_square.float")
    b.node("Sum", squares, ["clip.square"])
    b.node("Sqrt", ["clip.square"], ["clip.norm"])
    b.node("Add", ["clip.norm", b.scalar("clip_epsilon", CLIP_EPSILON, TensorProto.FLOAT)], ["clip.denominator"])
    b.node("Div", [b.scalar("max_norm", max_norm, TensorProto.FLOAT), "clip.denominator"], ["clip.coefficient"])
    b.node("Min", ["clip.coefficient", b.scalar("one", 1, TensorProto.FLOAT)], ["clip.scale"])
    clipped = {}
    for p, g in grads.items():
        scale = b.cast("clip.scale", elems[p])
        b.node("Mul", [g, scale], [f"{p}.grad_clipped"])
        clipped[p] = f"{p}.grad_clipped"
    return clipped


def decay_gradients(b: Builder, params: list[str], grads: dict[str, str], elems: dict[str, int],
                    weight_decay: float) -> dict[str, str]:
    """torch.optim's coupled weight decay (L2): grad + weight_decay * param."""
    regularized = {}
    for p in params:
        b.node("Mul", [p, b.scalar("weight_decay", weight_decay, elems[p])], [f"{p}.decay"])
        b.node("Add", [grads[p], f"{p}.decay"], [f"{p}.grad_regularized"])
        regularized[p] = f"{p}.grad_regularized"
    return regularized


def decay_parameters(b: Builder, params: list[str], elems: dict[str, int], weight_decay: float) -> dict[str, str]:
    """torch.optim.AdamW's decoupled weight decay, before the Adam step: param * (1 - lr * weight_decay), the
    factor computed in float64 as torch computes it in Python. A float16/bfloat16 parameter is multiplied in
    float32 and rounded once, as torch's kernel does (its opmath): the factor rounded to the parameter's type
    decays it by another amount every step (float16's 0.99707 for 0.997: 100 steps 1.7x farther from float64
    than torch; bfloat16 rounds 0.99 to 0.98828, 17% more decay)."""
    if not params:
        return {}
    b.node("Cast", [LEARNING_RATE], ["decay.lr"], to=TensorProto.DOUBLE)
    b.node("Mul", ["decay.lr", b.scalar("weight_decay", weight_decay, TensorProto.DOUBLE)], ["decay.amount"])
    b.node("Sub", [b.scalar("one", 1, TensorProto.DOUBLE), "decay.amount"], ["decay.factor"])
    decayed_values = {}
    for p in params:
        if elems[p] in HALF_FLOAT_TYPES:
            b.node("Mul", [b.cast(p, TensorProto.FLOAT), b.cast("decay.factor", TensorProto.FLOAT)],
                   [f"{p}.decayed.float"])
            b.node("Cast", [f"{p}.decayed.float"], [f"{p}.decayed"], to=elems[p])
        else:
            b.node("Mul", [p, b.cast("decay.factor", elems[p])], [f"{p}.decayed"])
        decayed_values[p] = f"{p}.decayed"
    return decayed_values


def sgd(b: Builder, params: list[str], grads: dict[str, str], elems: dict[str, int]) -> None:
    for p in params:
        b.node("Mul", [b.cast(LEARNING_RATE, elems[p]), grads[p]], [f"{p}.step"])
        b.node("Sub", [p, f"{p}.step"], [f"{p}.next"])


def optimizer_op(b: Builder, params: list[str], grads: dict[str, str], weights: dict[str, np.ndarray],
                 optimizer: str, options: dict[str, float]) -> None:
    """Momentum, Nesterov and Adagrad as their ai.onnx.preview.training op, fed the step count from 0 as torch
    counts: Momentum's T == 0 (beta_adjusted = 1) is torch's first momentum buffer (the gradient itself), and
    Adagrad's R / (1 + T * decay_factor) is torch's lr / (1 + (step - 1) * lr_decay)."""
    slots = {"adagrad": ("adagrad_h",), "momentum": ("momentum_v",), "nesterov": ("momentum_v",)}[optimizer]
    if OP_TYPES[optimizer] == "Momentum":
        options = {"alpha": 0.9, "beta": 1.0, "norm_coefficient": 0.0, **options,
                   "mode": "nesterov" if optimizer == "nesterov" else "standard"}
    slot_names = [[f"{p}.{s}" for p in params] for s in slots]
    for names in slot_names:
        for p, name in zip(params, names):
            b.state(name, np.zeros_like(weights[p]))
    flat_slots = [n for names in slot_names for n in names]
    b.node(OP_TYPES[optimizer], [LEARNING_RATE, STEP] + params + [grads[p] for p in params] + flat_slots,
           [f"{p}.next" for p in params] + [f"{n}.next" for n in flat_slots], domain=TRAINING_DOMAIN, **options)
    for names in slot_names:
        for p, name in zip(params, names):
            b.update(name, f"{name}.next", helper.make_tensor_type_proto(
                helper.np_dtype_to_tensor_dtype(weights[p].dtype), weights[p].shape))


def adam(b: Builder, params: list[str], values: dict[str, str], grads: dict[str, str],
         weights: dict[str, np.ndarray], elems: dict[str, int], options: dict[str, float]) -> None:
    """torch.optim.Adam's step, in its order of operations: m = lerp(m, g, 1 - beta1); v = beta2 v +
    (1 - beta2) g^2; param -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps), with t = the step
    count + 1 (torch increments it before the update) and the bias corrections in float64, as torch computes them
    in Python (1 - 0.999 in float32 is off by 1.3e-5)."""
    beta1, beta2, eps = options["alpha"], options["beta"], options["epsilon"]
    b.node("Add", [STEP, b.scalar("one", 1, TensorProto.INT64)], ["adam.t_int"])
    b.node("Cast", ["adam.t_int"], ["adam.t"], to=TensorProto.DOUBLE)
    b.node("Pow", [b.scalar("beta1", beta1, TensorProto.DOUBLE), "adam.t"], ["adam.beta1_t"])
    b.node("Sub", [b.scalar("one", 1, TensorProto.DOUBLE), "adam.beta1_t"], ["adam.correction1"])
    b.node("Pow", [b.scalar("beta2", beta2, TensorProto.DOUBLE), "adam.t"], ["adam.beta2_t"])
    b.node("Sub", [b.scalar("one", 1, TensorProto.DOUBLE), "adam.beta2_t"], ["adam.correction2"])
    b.node("Sqrt", ["adam.correction2"], ["adam.correction2_sqrt"])
    b.node("Cast", [LEARNING_RATE], ["adam.lr"], to=TensorProto.DOUBLE)
    b.node("Div", ["adam.lr", "adam.correction1"], ["adam.step_size"])
    for p in params:
        elem, g, m, v = elems[p], grads[p], f"{p}.adam_m", f"{p}.adam_v"
        b.state(m, np.zeros_like(weights[p]))
        b.state(v, np.zeros_like(weights[p]))
        b.node("Sub", [g, m], [f"{m}.delta"])
        b.node("Mul", [f"{m}.delta", b.scalar("one_minus_beta1", 1 - beta1, elem)], [f"{m}.change"])
        b.node("Add", [m, f"{m}.change"], [f"{m}.next"])
        b.node("Mul", [v, b.scalar("beta2", beta2, elem)], [f"{v}.kept"])
        b.node("Mul", [g, b.scalar("one_minus_beta2", 1 - beta2, elem)], [f"{v}.scaled"])
        b.node("Mul", [f"{v}.scaled", g], [f"{v}.change"])
        b.node("Add", [f"{v}.kept", f"{v}.change"], [f"{v}.next"])
        b.node("Sqrt", [f"{v}.next"], [f"{v}.sqrt"])
        b.node("Div", [f"{v}.sqrt", b.cast("adam.correction2_sqrt", elem)], [f"{v}.corrected"])
        b.node("Add", [f"{v}.corrected", b.scalar("epsilon", eps, elem)], [f"{p}.adam_denominator"])
        b.node("Div", [f"{m}.next", f"{p}.adam_denominator"], [f"{p}.adam_direction"])
        b.node("Mul", [b.cast("adam.step_size", elem), f"{p}.adam_direction"], [f"{p}.step"])
        b.node("Sub", [values[p], f"{p}.step"], [f"{p}.next"])
        for slot in (m, v):
            b.update(slot, f"{slot}.next", helper.make_tensor_type_proto(elem, weights[p].shape))
